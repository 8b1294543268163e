"""What a sweep leaves on the terminal when it ends: one aligned line per cell (layout and
payload size) with the fastest strategy, its p50 and interval, the strategies really tied with
it, the floor and how much slower ``pickled`` was; then one line per cell that failed or left
strategies out. Everything fits ``WIDTH`` columns; the full table is ``results.csv`` beside the
records, the full answer the report.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.job.interval import interval_of
from harness.job.verdict import served
from harness.report import collect, tables
from harness.units import human_bytes

WIDTH = 100
"""The widest line the summary prints."""
MOST_LINES = 30
"""Cells (and then notes) past this many are counted, not listed: the screen stays readable."""


def sweep_summary(root: Path | str, raw: pd.DataFrame | None = None) -> list[str]:
    """The summary lines of the sweep under ``root`` (none where it holds no record); ``raw``:
    its records, where the caller read them already (``collect.load``)."""
    raw = collect.load(root) if raw is None else raw
    df = tables.of_records(raw)
    if df.empty:
        return _jobs(raw)
    return [*_cells(df), *_failed(raw), *_refused(df)]


def _jobs(df: pd.DataFrame) -> list[str]:
    """A sweep of no broadcast job (Ray dispatch modes): one line per job, its p50."""
    lines = []
    for _, row in df.iterrows():
        name = row.get("mode") if isinstance(row.get("mode"), str) else row.get("strategy")
        size = human_bytes(row.get("payload_bytes"))
        what = f"{name} {row.get('layout')} {size}"
        if row.get("status") != "ok":
            what += f"  {str(row.get('status')).upper()}: {row.get('error')}"
        else:
            what += f"  p50 {_p50(row)}"
        lines.append(_fit(what, WIDTH))
    return _bounded(lines, "jobs")


def _cells(df: pd.DataFrame) -> list[str]:
    rec = tables.recommendation(df)
    if rec.empty:
        return []
    head = f"{'layout':<11}{'payload':>9}  {'fastest (≈ tied)':<31}{'p50 [95 %]':<23}{'floor':<17}pickled"
    lines = [head]
    crowded: set[str] = set()
    for _, cell in rec.sort_values(["layout", "payload_bytes"]).iterrows():
        rows = df[(df["layout"] == cell["layout"]) & (df["payload_bytes"] == cell["payload_bytes"])]
        best = rows[rows["strategy"] == cell["winner"]]
        row = best.iloc[0] if not best.empty else None
        name = _served(rows, cell["winner"])
        fastest = _named([name, *(_served(rows, n) for n in cell["tied_with"])], 30)
        over = cell.get("oversubscribed")
        mark = " †" if isinstance(over, str) else ""
        if mark:
            crowded.add(over)
        line = (
            f"{str(cell['layout']) + mark:<11}{human_bytes(cell['payload_bytes']):>9}  "
            f"{fastest:<31}{_p50(row):<23}{_floor(row):<17}{_pickled(row)}"
        )
        lines.append(_fit(line, WIDTH))
    lines = _bounded(lines, "cells")
    if crowded:
        counts = ", ".join(sorted(crowded))
        lines.append(_fit(f"† oversubscribed ({counts}): trust same-job ratios there", WIDTH))
    return lines


def _failed(raw: pd.DataFrame) -> list[str]:
    """One line per job that failed (the report leaves them out; their records say why)."""
    if "status" not in raw.columns:
        return []
    lines = []
    for _, row in raw[raw["status"] == "failed"].iterrows():
        where = f"{row.get('strategy')} {row.get('layout')} b{row.get('batch_size')}"
        lines.append(_fit(f"FAILED  {where}: {row.get('error')}", WIDTH))
    return _bounded(lines, "failures")


def _refused(df: pd.DataFrame) -> list[str]:
    """One line per cell whose job refused strategies (or was refused whole)."""
    lines = []
    refused = df[~df["supported"]]
    for (layout, size), rows in refused.groupby(["layout", "payload_bytes"], sort=True):
        names = ", ".join(sorted(str(n) for n in rows["strategy"].unique()))
        why = _reason(rows.iloc[0].get("error"), set(rows["strategy"].astype(str)))
        lines.append(_fit(f"refused {layout} {human_bytes(size)}: {names}{why}", WIDTH))
    return _bounded(lines, "refusals")


def _served(rows: pd.DataFrame, name: str) -> str:
    """``name``, or ``auto (→ shm)`` for a strategy that served its calls with another."""
    return served(
        name, tables.choices(rows, rows["layout"].iloc[0], rows["payload_bytes"].iloc[0]).get(name)
    )


def _p50(row) -> str:
    if row is None or _missing(row.get("p50_us")):
        return "—"
    interval = interval_of(row, "p50_us")
    text = f"{row['p50_us'] / 1e3:.3g} ms"
    if interval is not None:
        text += f" [{interval.lo / 1e3:.3g}–{interval.hi / 1e3:.3g}]"
    return text


def _floor(row) -> str:
    if row is None or _missing(row.get("floor_p50_us")):
        return "—"
    method = row.get("floor_method")
    return f"{row['floor_p50_us'] / 1e3:.3g} ms" + (
        f" ({method})" if isinstance(method, str) else ""
    )


def _pickled(row) -> str:
    """How many times slower ``pickled`` was than the fastest, in the same job."""
    ratio = None if row is None else row.get("vs_baseline")
    if _missing(ratio) or not ratio:
        return "—"
    return f"{1 / ratio:.3g}×"


def _named(names: list[str], width: int) -> str:
    """``shm ≈ flat ≈ +2``: the names, tied, as many as fit ``width``, the rest counted."""
    text = names[0]
    for k, name in enumerate(names[1:], 1):
        rest = len(names) - k - 1
        more = f" ≈ {name}" + (f" ≈ +{rest}" if rest else "")
        if len(text) + len(more) > width:
            return _fit(f"{text} ≈ +{len(names) - k}", width)
        text += f" ≈ {name}"
    return _fit(text, width)


def _reason(error, names: set[str]) -> str:
    """The refusal's kind: the first one-word part of its text that is not a strategy's name
    (``memory``, ``layout``), or nothing."""
    if not isinstance(error, str):
        return ""
    skip = {*names, "Refused"}
    words = [p for p in error.split(": ")[1:] if p and " " not in p and p not in skip]
    return f" ({words[0]})" if words else ""


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _bounded(lines: list[str], what: str) -> list[str]:
    if len(lines) <= MOST_LINES:
        return lines
    left = len(lines) - MOST_LINES + 1
    return [*lines[: MOST_LINES - 1], f"… {left} more {what} in results.csv"]
