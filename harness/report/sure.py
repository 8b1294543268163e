"""How sure the report is of what it says: which strategy a cell (layout × payload size)
recommends, tied or not (``cell_verdict``, the rule of ``harness.job.verdict``), which cells ran
on an oversubscribed host (``oversubscribed_cells``, marked ``†``), the host in one clause
(``host_text``), and every record's p50 recomputed from the samples the job kept
(``check_samples``), so a report never quotes a figure its own samples do not give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from harness.job.interval import Interval, interval_keys
from harness.job.samples import SLOWEST
from harness.job.verdict import Verdict, decide

MARK = "†"
"""Marks a cell whose jobs ran more ranks on a node than the host had cores."""


# -- ties -----------------------------------------------------------------------------------
def bare(name: str) -> str:
    """A strategy's name as references are keyed (``pickled [serialization=x]`` -> pickled)."""
    return name.split(" [")[0]


def _union(lows: pd.Series, highs: pd.Series) -> Interval | None:
    """The widest interval over the jobs that gave one (each job's own is honest; several jobs
    of one cell agree on a tie only where all of them allow it); None where none did."""
    lo = pd.to_numeric(lows, errors="coerce").dropna()
    hi = pd.to_numeric(highs, errors="coerce").dropna()
    if lo.empty or hi.empty:
        return None
    return Interval(float(lo.min()), float(hi.max()))


def cell_verdict(df: pd.DataFrame, layout: str, size: float, times: dict[str, float]) -> Verdict:
    """The verdict of one cell: ``times`` ranks the strategies (their median ``vs_floor``, a
    same-job ratio), the intervals come from the fastest one's records in ``df`` (the rows
    ``tables.load`` made: ``ref_<other>_vs_strategy``'s interval, paired in its job's rounds)."""
    best = min((t, n) for n, t in times.items() if not math.isnan(t))[1]
    own = _jobs_of(df, layout, size, best)  # once per cell: every other strategy reads it
    return decide(times, lambda name: _paired_in(own, name))


def paired_interval(
    df: pd.DataFrame, layout: str, size: float, name: str, over: str
) -> Interval | None:
    """The interval of ``name``'s time over ``over``'s, paired in the rounds of ``over``'s jobs
    of this cell (the interval of its records' ``ref_<name>_vs_strategy``); None where those
    jobs did not time ``name`` beside it."""
    return _paired_in(_jobs_of(df, layout, size, over), name)


def _jobs_of(df: pd.DataFrame, layout: str, size: float, strategy: str) -> pd.DataFrame:
    """The records of ``strategy`` in this cell."""
    return df[
        (df["layout"] == layout) & (df["payload_bytes"] == size) & (df["strategy"] == strategy)
    ]


def _paired_in(own: pd.DataFrame, name: str) -> Interval | None:
    lo, hi = interval_keys(f"ref_{bare(name)}_vs_strategy")
    if own.empty or lo not in own.columns or hi not in own.columns:
        return None
    return _union(own[lo], own[hi])


# -- the host -------------------------------------------------------------------------------
def _numbers(df: pd.DataFrame, col: str) -> pd.Series:
    if col not in df.columns:
        return pd.Series(dtype=float)
    return pd.to_numeric(df[col], errors="coerce").dropna()


def _span(values: pd.Series, fmt: str = "{:g}") -> str:
    lo, hi = values.min(), values.max()
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}–{fmt.format(hi)}"


def host_text(df: pd.DataFrame) -> str:
    """``2 cores, 2–4 ranks on a node, 1-min load 1.2–7.2 before the jobs``: how far to trust the host, from
    the records' own fields; '' where they carry none (older records)."""
    parts = []
    for col, fmt in (("host_cores", "{} cores"), ("ranks_on_node", "{} ranks on a node"),
                     ("load_avg_1m", "1-min load {} before the jobs")):  # fmt: skip
        values = _numbers(df, col)
        if not values.empty:
            parts.append(fmt.format(_span(values, "{:.1f}" if col == "load_avg_1m" else "{:g}")))
    return ", ".join(parts)


def oversubscribed_cells(df: pd.DataFrame) -> dict[tuple[str, float], str]:
    """{(layout, payload_bytes): '4 ranks on 2 cores'} for every cell one of whose jobs ran on
    an oversubscribed host (its record's ``oversubscribed``)."""
    if "oversubscribed" not in df.columns:
        return {}
    over = df[df["oversubscribed"].eq(True)]
    out = {}
    for (layout, size), rows in over.groupby(["layout", "payload_bytes"]):
        ranks, cores = _span(_numbers(rows, "ranks_on_node")), _span(_numbers(rows, "host_cores"))
        out[(layout, size)] = f"{ranks or '?'} ranks on {cores or '?'} cores"
    return out


def mark_legend(cells: dict[tuple[str, float], str]) -> str:
    """The line under a table that marks cells: what ``†`` means, with each distinct count."""
    if not cells:
        return ""
    counts = ", ".join(sorted(set(cells.values())))
    return (
        f"{MARK} oversubscribed: more ranks on a node than the host had cores ({counts}); the "
        "scheduler, not the strategy, decides much of the spread there: trust same-job ratios "
        "only, and gate where every rank has a core."
    )


# -- p50 recomputed from the samples --------------------------------------------------------
@dataclass
class SamplesCheck:
    """What recomputing every record's p50 from its samples found."""

    checked: int = 0
    matched: int = 0
    mismatches: list[str] = field(default_factory=list)
    """A record whose p50 is not its samples' median, or whose samples file is unreadable."""
    without: int = 0
    """Records that name no samples file (written before jobs kept their samples)."""


def _read(path: Path, cache: dict) -> pd.DataFrame | str:
    """The slowest-rank rows of a samples file, or why they cannot be read."""
    if path not in cache:
        try:
            frame = pd.read_csv(path)
            missing = {"strategy", "rank", "wall_us"} - set(frame.columns)
            if missing:
                raise ValueError(f"no column {', '.join(sorted(missing))}")
            frame = frame[pd.to_numeric(frame["rank"], errors="coerce") == SLOWEST]
            cache[path] = frame.assign(wall_us=pd.to_numeric(frame["wall_us"], errors="coerce"))
        except FileNotFoundError:
            cache[path] = f"{path} is missing"
        except (OSError, ValueError, EOFError) as exc:  # gzip's and pandas' own complaints
            cache[path] = f"{path} is not a samples file ({str(exc)[:80]})"
    return cache[path]


def check_samples(df: pd.DataFrame) -> SamplesCheck:
    """Each measured record's ``p50_us`` against the median of its samples file's rank -1
    ``wall_us`` rows for its strategy (to rounding): the report quotes figures it can redo."""
    out, cache = SamplesCheck(), {}
    if "p50_us" not in df.columns:
        return out
    for row in df[df["supported"] & df["p50_us"].notna()].to_dict("records"):
        name = row.get("samples_file")
        if not isinstance(name, str) or not name or not isinstance(row.get("job_dir"), str):
            out.without += 1
            continue
        out.checked += 1
        who = f"{row['strategy']} {row['layout']} {row.get('batch_size', '?')} ({row['job_dir']})"
        frame = _read((Path(row["job_dir"]) / name).resolve(), cache)
        if isinstance(frame, str):
            out.mismatches.append(f"{who}: {frame}")
            continue
        walls = frame.loc[frame["strategy"] == row.get("strategy_name", row["strategy"]), "wall_us"]
        if walls.dropna().empty:
            out.mismatches.append(f"{who}: its samples file has no rows for it")
            continue
        median = float(np.median(walls.dropna()))
        if math.isclose(median, row["p50_us"], rel_tol=1e-6, abs_tol=1e-3):
            out.matched += 1
        else:
            out.mismatches.append(
                f"{who}: p50 {row['p50_us']:.3f} µs, its samples' median {median:.3f} µs"
            )
    return out


def samples_markdown(check: SamplesCheck) -> str:
    """The report's paragraph on the recomputation: how many matched, and every exception."""
    if not check.checked and not check.without:
        return "No measured record to check."
    lines = [
        f"Every record's p50 was recomputed from its job's samples file (the median of the "
        f"slowest rank's `wall_us` per call): {check.matched} of {check.checked} records "
        f"checked match"
        + (f", {len(check.mismatches)} do not (below)" if check.mismatches else "")
        + "."
    ]
    if check.without:
        lines.append(
            f"{check.without} record(s) name no samples file (written before jobs kept their "
            "calls): not checked."
        )
    return " ".join(lines) + "".join(f"\n- {m}" for m in check.mismatches)
