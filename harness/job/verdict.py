"""Whether a comparison names a winner: the fastest strategy wins only when the 95 % interval of
every other strategy's time over its own, paired round by round in the same job
(``vs_strategy_lo``/``_hi`` of a record's references, ``harness.job.stats``), lies above 1.
Where an interval holds 1 the strategies are tied and all of them are named (``shm ≈ auto
(tied)``); where the runner-up has no interval (an older record, too few rounds, a strategy
timed in another job) the answer says so (``no interval``) instead of inventing a winner.

``decide`` is the rule on plain figures; ``job_verdict`` applies it to the records one job wrote
(the job's own and, with ``record_each``, one per strategy), for the terminal's job line and
the reports.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

Interval = tuple[float, float] | None
"""A ratio's 95 % interval (lo, hi), or None where there is none."""

WINNER, TIED, NO_INTERVAL, ALONE = "winner", "tied", "no interval", "alone"
RESULT_FILE = "result.json"


def holds_one(interval: Interval) -> bool:
    """Whether a ratio's interval says the two may be equal (it holds 1)."""
    return interval is not None and interval[0] <= 1 <= interval[1]


def interval_text(value: float | None, interval: Interval, unit: str = "×") -> str:
    """``1.23× [1.10–1.40]``; the figure alone where there is no interval, ``—`` for none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    text = f"{value:.2f}{unit}"
    if interval is None or any(v is None or math.isnan(v) for v in interval):
        return text
    return f"{text} [{interval[0]:.2f}–{interval[1]:.2f}]"


@dataclass(frozen=True)
class Verdict:
    """The answer for one cell: the fastest strategy, who is tied with it and how sure."""

    best: str
    tied: tuple[str, ...] = ()
    """The others whose interval against ``best`` holds 1, fastest first."""
    runner_up: str | None = None
    runner_up_ratio: float | None = None
    """The runner-up's time over the best's (above 1)."""
    runner_up_interval: Interval = None

    @property
    def kind(self) -> str:
        if self.runner_up is None:
            return ALONE
        if self.tied:
            return TIED
        return WINNER if self.runner_up_interval is not None else NO_INTERVAL

    @property
    def is_tie(self) -> bool:
        return self.kind == TIED

    @property
    def names(self) -> tuple[str, ...]:
        """Every strategy the answer recommends: the best and those tied with it."""
        return (self.best, *self.tied)

    def text(self) -> str:
        """``shm``, ``shm ≈ auto (tied)`` or ``shm (no interval)``."""
        if self.kind == TIED:
            return " ≈ ".join(self.names) + " (tied)"
        if self.kind == NO_INTERVAL:
            return f"{self.best} (no interval)"
        return self.best

    def runner_up_text(self) -> str:
        """``flat 1.23× [1.10–1.40]``: the runner-up's time over the best's; '' for none."""
        if self.runner_up is None:
            return ""
        return f"{self.runner_up} {interval_text(self.runner_up_ratio, self.runner_up_interval)}"


def decide(times: Mapping[str, float], interval_of: Callable[[str], Interval]) -> Verdict | None:
    """The verdict over ``times`` (lower is better; a same-job ratio or a p50), where
    ``interval_of(name)`` is the interval of ``name``'s time over the fastest's, paired in the
    same rounds (None: none). A winner only when no other's interval holds 1."""
    ranked = sorted((t, n) for n, t in times.items() if t is not None and not math.isnan(t))
    if not ranked:
        return None
    best = ranked[0][1]
    if len(ranked) == 1:
        return Verdict(best)
    intervals = {n: interval_of(n) for _, n in ranked[1:]}
    second = ranked[1][1]
    return Verdict(
        best,
        tied=tuple(n for _, n in ranked[1:] if holds_one(intervals[n])),
        runner_up=second,
        runner_up_ratio=ranked[1][0] / ranked[0][0] if ranked[0][0] else None,
        runner_up_interval=intervals[second],
    )


def _competes(name: str) -> bool:
    """A strategy a user could pick: the floor's raw methods are yardsticks, not choices."""
    return name.split(":")[0] != "floor"


def _reference_interval(ref: Mapping) -> Interval:
    lo, hi = ref.get("vs_strategy_lo"), ref.get("vs_strategy_hi")
    return None if lo is None or hi is None else (float(lo), float(hi))


def job_verdict(records: Iterable[Mapping]) -> Verdict | None:
    """The verdict of one job from the records it wrote: the fastest strategy by p50 among the
    records and their references, the intervals from the fastest one's own record (its
    references' ``vs_strategy``). Without that record (no ``record_each``) only the strategy
    whose record it is has an interval against it (the inverse of its own ratio)."""
    records = [r for r in records if r.get("status", "ok") == "ok" and r.get("p50_us")]
    times: dict[str, float] = {}
    for rec in records:
        for name, ref in (rec.get("references") or {}).items():
            if _competes(name) and isinstance(ref, Mapping) and ref.get("p50_us"):
                times.setdefault(name, float(ref["p50_us"]))
    for rec in records:  # a strategy's own record has the last word on its p50
        times[str(rec["strategy"])] = float(rec["p50_us"])
    if not times:
        return None
    best = min(times, key=times.get)
    own = {str(r["strategy"]): r for r in records}

    def interval_of(name: str) -> Interval:
        if best in own:
            return _reference_interval((own[best].get("references") or {}).get(name) or {})
        ref = ((own.get(name) or {}).get("references") or {}).get(best) or {}
        inverse = _reference_interval(ref)  # best over name: turn it round
        return None if inverse is None else (1 / inverse[1], 1 / inverse[0])

    return decide(times, interval_of)


def records_beside(job_dir: Path | str) -> list[dict]:
    """The records a ``record_each`` job wrote for its other strategies (one directory each
    under the job's own); [] where there are none or one cannot be read (the job line still
    stands without them)."""
    out = []
    for path in sorted(Path(job_dir).glob(f"*/{RESULT_FILE}")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out
