"""What each call of a job moves: one shape every call (a constant workload) or a period of
shapes cycled call by call (``payload.cycle``, ``payload.cycle_file``, ``payload.draws``,
``payload.dp_split``), built on the driver and checked before any world starts.

A real RL step does not repeat one shape: each rollout is padded to its own longest response,
dynamic sampling changes the row count, and a DP dispatch that does not divide evenly hands
replicas different numbers of rows. The period is computed here once, seeded, and shipped to
every rank in the ``JobSpec``, so every rank sees the same sequence and a re-run repeats it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CYCLE_KEYS = ("batch_size", "seq_len")
"""What one entry of ``payload.cycle`` (or of a shapes file) may override."""
DP_SPLITS = ("even", "drawn")
"""``payload.dp_split``'s named forms; the third is a list of row counts, one per replica."""
MAX_SHAPES_FILE_BYTES = 256 << 10
"""Largest shapes file read: a list of overrides is a few kilobytes."""
MAX_PERIOD = 4096
"""Most calls one period may hold (entries × draws): each distinct batch is built up front."""


class WorkloadError(ValueError):
    """A workload that cannot run; its message is one line (raised before any rank starts)."""


@dataclass(frozen=True)
class CallShape:
    """The batch one call moves: each replica leader's row count, the tokens per row, and
    which seeded draw of the data (0 for every call of a cycle without ``payload.draws``)."""

    rows: tuple[int, ...]
    """Rows on each replica's leader, replica 0 first."""
    seq_len: int | None
    draw: int = 0

    @property
    def batch_size(self) -> int:
        """The most rows a leader holds in this call (the one that bounds it)."""
        return max(self.rows)


@dataclass(frozen=True)
class Workload:
    """The period of shapes a job cycles through (call c moves ``period[c % len(period)]``)."""

    period: tuple[CallShape, ...]
    label: str | None = None
    """How the record and the report name a varying workload; None for a constant one."""
    dp_split: str | list[int] | None = None
    """``payload.dp_split`` as given: drawn or the row counts; None when even."""

    @property
    def varying(self) -> bool:
        return self.label is not None


def constant(batch_size: int, seq_len: int | None, dp: int) -> Workload:
    """One shape every call, every replica leader holding ``batch_size`` rows."""
    return Workload((CallShape((batch_size,) * dp, seq_len),))


def read_cycle_file(path: str | Path) -> list[dict]:
    """A recorded sequence of shapes: a YAML (or JSON) list of ``payload.cycle`` entries, read
    only if it is a small regular file, with the safe loader (no code runs from it)."""
    import yaml

    path = Path(path).expanduser()
    where = f"payload.cycle_file={path}"
    try:
        st = os.stat(path)
    except OSError as exc:
        raise WorkloadError(f"{where} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise WorkloadError(f"{where} is not a regular file; expected a YAML list of shapes")
    if st.st_size > MAX_SHAPES_FILE_BYTES:
        raise WorkloadError(
            f"{where} is {st.st_size:,} bytes > {MAX_SHAPES_FILE_BYTES:,}; expected a small "
            "YAML list of shapes"
        )
    with open(path, "rb") as f:
        text = f.read(MAX_SHAPES_FILE_BYTES + 1)
    try:
        entries = yaml.safe_load(text.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        first = " ".join(str(exc).split())[:120]
        raise WorkloadError(f"{where} is not a YAML list of shapes: {first}") from None
    if not isinstance(entries, list):
        raise WorkloadError(
            f"{where} holds a {type(entries).__name__}; expected a YAML list of shapes such as "
            "[{batch_size: 768}, {batch_size: 3}]"
        )
    return entries


def check_entries(entries, where: str, recorded: bool) -> list[dict]:
    """Each cycle entry a mapping of known keys with positive integers; a recorded payload
    fixes seq_len, so an entry may only change its rows there."""
    if not isinstance(entries, list) or not entries:
        what = "is empty" if isinstance(entries, list) else f"is {entries!r}, not a list"
        raise WorkloadError(
            f"{where} {what}; expected a non-empty list of overrides such as "
            "[{batch_size: 768}, {batch_size: 3}]"
        )
    allowed = ("batch_size",) if recorded else CYCLE_KEYS
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise WorkloadError(
                f"{where}[{i}] is {entry!r}; expected a mapping such as {{batch_size: 8}}"
            )
        unknown = sorted(set(map(str, entry)) - set(allowed))
        if unknown:
            raise WorkloadError(
                f"{where}[{i}]: unknown key(s) {unknown}; valid keys: {list(allowed)}"
                + (
                    " (a recorded payload fixes seq_len)"
                    if recorded and "seq_len" in unknown
                    else ""
                )
            )
        for key, value in entry.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WorkloadError(f"{where}[{i}].{key} must be a positive integer, got {value!r}")
        out.append(dict(entry))
    return out


def check_dp_split(dp_split, dp: int) -> str | list[int] | None:
    """``payload.dp_split`` checked against the layout's replica count; None when even."""
    if isinstance(dp_split, str):
        if dp_split not in DP_SPLITS:
            raise WorkloadError(
                f"payload.dp_split={dp_split!r}; expected even, drawn or a list of {dp} row "
                "counts (one per replica)"
            )
        if dp_split == "drawn" and dp < 2:
            raise WorkloadError(
                "payload.dp_split=drawn needs more than one replica (layout.dp >= 2)"
            )
        return None if dp_split == "even" else "drawn"
    counts = list(dp_split) if isinstance(dp_split, (list, tuple)) else None
    if counts is None or any(isinstance(c, bool) or not isinstance(c, int) for c in counts):
        raise WorkloadError(
            f"payload.dp_split={dp_split!r}; expected even, drawn or a list of {dp} integer row "
            "counts (one per replica)"
        )
    if len(counts) != dp:
        raise WorkloadError(
            f"payload.dp_split has {len(counts)} row counts {counts} but the layout has dp={dp} "
            f"replicas; give {dp} counts, one per replica"
        )
    if min(counts) < 1:
        raise WorkloadError(f"payload.dp_split={counts}: every replica needs at least 1 row")
    return counts


def drawn_rows(total: int, dp: int, seed: int, draw: int) -> tuple[int, ...]:
    """``total`` rows split among ``dp`` replicas at seeded random cut points (each at least 1
    row): a DP dispatch that does not divide evenly."""
    gen = np.random.default_rng([seed, draw])
    cuts = np.sort(gen.choice(np.arange(1, total), size=dp - 1, replace=False))
    return tuple(int(n) for n in np.diff([0, *cuts, total]))


def build(payload, dp: int, seq_len: int | None, recorded: bool) -> Workload:
    """The job's workload from its ``payload`` node (a dict); ``seq_len`` is the job's (the
    recording's own for a recorded payload). WorkloadError, one line, for a bad one."""
    cycle, cycle_file = payload.get("cycle"), payload.get("cycle_file")
    if cycle is not None and cycle_file:
        raise WorkloadError("payload.cycle and payload.cycle_file both set; give one of them")
    draws = payload.get("draws") or 0
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 0:
        raise WorkloadError(f"payload.draws must be a non-negative integer, got {draws!r}")
    split = check_dp_split(payload.get("dp_split", "even"), dp)
    if split == "drawn" and draws < 1:
        raise WorkloadError(
            "payload.dp_split=drawn needs payload.draws >= 1: how many seeded splits the job "
            "cycles through"
        )
    if cycle_file:
        entries = check_entries(read_cycle_file(cycle_file), "payload.cycle_file", recorded)
    elif cycle is not None:
        entries = check_entries(cycle, "payload.cycle", recorded)
    else:
        entries = [{}]
    if len(entries) * max(draws, 1) > MAX_PERIOD:
        raise WorkloadError(
            f"{len(entries)} cycle entries × {max(draws, 1)} draws = "
            f"{len(entries) * max(draws, 1)} calls per period > {MAX_PERIOD}"
        )
    base = {"batch_size": int(payload["batch_size"]), "seq_len": seq_len}
    period = tuple(
        _shape({**base, **entry}, split, dp, int(payload.get("seed", 0)), j)
        for j in range(max(draws, 1))
        for entry in entries
    )
    label = _label(entries, cycle_file, draws, split)
    return Workload(period, label, split) if label else constant(base["batch_size"], seq_len, dp)


def _shape(values: dict, split, dp: int, seed: int, draw: int) -> CallShape:
    if isinstance(split, list):
        rows = tuple(split)
    elif split == "drawn":
        rows = drawn_rows(values["batch_size"] * dp, dp, seed, draw)
    else:
        rows = (values["batch_size"],) * dp
    return CallShape(rows, values["seq_len"], draw)


def _label(entries: list[dict], cycle_file, draws: int, split) -> str | None:
    """``cycle:b768/b3``, ``cycle_file:<stem>``, ``draws:8``, ``dp_split:5+3``, joined by
    spaces; None for a constant workload (one entry, no draws, an even split)."""
    parts = []
    if cycle_file:
        parts.append(f"cycle_file:{Path(cycle_file).stem}")
    elif entries != [{}]:
        texts = ["".join(f"{k[0]}{e[k]}" for k in CYCLE_KEYS if k in e) or "base" for e in entries]
        parts.append("cycle:" + "/".join(texts))
    if draws:
        parts.append(f"draws:{draws}")
    if split is not None:
        parts.append(f"dp_split:{'+'.join(map(str, split)) if isinstance(split, list) else split}")
    return " ".join(parts) or None
