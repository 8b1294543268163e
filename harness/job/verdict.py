"""Whether a comparison names a winner: the fastest strategy wins only when the 95 % interval of
every other strategy's time over its own, paired round by round in the same job
(``vs_strategy``'s interval in a record's references, ``harness.job.stats``), lies above 1.
Where an interval holds 1 the strategies are tied and all of them are named (``shm ≈ flat
(tied)``); a strategy that serves its calls with another one timed beside it (``auto`` serving
``shm``) is no competitor of it and is left out (``without_servers``), and is named with what it
serves (``auto (→ shm)``); where the runner-up has no interval (an older record, too few rounds, a strategy
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

from harness.job.interval import Interval, interval_of
from harness.job.label import Label

WINNER, TIED, NO_INTERVAL, ALONE = "winner", "tied", "no interval", "alone"
RESULT_FILE = "result.json"


def served(name: str, choice: str | None) -> str:
    """How a strategy that serves its calls with another one is named: ``auto (→ shm)``; any
    other as it is."""
    return f"{name} (→ {choice})" if choice and choice != name else name


def without_servers(times: Mapping[str, float], choices: Mapping[str, str]) -> dict:
    """``times`` less every strategy that serves its calls with another one timed beside it
    (``choices``: ``auto`` -> ``shm``). Its calls are that one's and its choice: a tie by
    construction, not a competitor."""
    return {n: t for n, t in times.items() if choices.get(n) not in times}


def holds_one(interval: Interval | None) -> bool:
    """Whether a ratio's interval says the two may be equal (it holds 1)."""
    return interval is not None and interval.contains(1)


def interval_text(value: float | None, interval: Interval | None, unit: str = "×") -> str:
    """``1.23× [1.10–1.40]``; the figure alone where there is no interval (or an end is
    missing), ``—`` for none. ``interval``: an Interval, or its ``(lo, hi)`` pair."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    text = f"{value:.2f}{unit}"
    interval = Interval.of(interval)
    if interval is None:
        return text
    return f"{text} [{interval.lo:.2f}–{interval.hi:.2f}]"


@dataclass(frozen=True)
class Verdict:
    """The answer for one cell: the fastest strategy, who is tied with it and how sure."""

    best: str
    tied: tuple[str, ...] = ()
    """The others whose interval against ``best`` holds 1, fastest first."""
    runner_up: str | None = None
    runner_up_ratio: float | None = None
    """The runner-up's time over the best's (above 1)."""
    runner_up_interval: Interval | None = None

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


def decide(times: Mapping[str, float], paired: Callable[[str], Interval | None]) -> Verdict | None:
    """The verdict over ``times`` (lower is better; a same-job ratio or a p50), where
    ``paired(name)`` is the interval of ``name``'s time over the fastest's, paired in the same
    rounds (an Interval or its ``(lo, hi)`` pair; None: none). A winner only when no other's
    interval holds 1."""
    ranked = sorted((t, n) for n, t in times.items() if t is not None and not math.isnan(t))
    if not ranked:
        return None
    best = ranked[0][1]
    if len(ranked) == 1:
        return Verdict(best)
    intervals = {n: Interval.of(paired(n)) for _, n in ranked[1:]}
    second = ranked[1][1]
    return Verdict(
        best,
        tied=tuple(n for _, n in ranked[1:] if holds_one(intervals[n])),
        runner_up=second,
        runner_up_ratio=ranked[1][0] / ranked[0][0] if ranked[0][0] else None,
        runner_up_interval=intervals[second],
    )


def job_verdict(records: Iterable[Mapping]) -> Verdict | None:
    """The verdict of one job from the records it wrote: the fastest strategy by p50 among the
    records and their references, the intervals from the fastest one's own record (its
    references' ``vs_strategy``). Without that record (no ``record_each``) only the strategy
    whose record it is has an interval against it (the inverse of its own ratio)."""
    records = [r for r in records if r.get("status", "ok") == "ok" and r.get("p50_us")]
    times: dict[str, float] = {}
    for rec in records:
        for name, ref in (rec.get("references") or {}).items():
            # A strategy a user could pick: floor methods and probes are yardsticks.
            if Label.parse(name).competes and isinstance(ref, Mapping) and ref.get("p50_us"):
                times.setdefault(name, float(ref["p50_us"]))
    for rec in records:  # a strategy's own record has the last word on its p50
        times[str(rec["strategy"])] = float(rec["p50_us"])
    choices = {str(r["strategy"]): r["auto_choice"] for r in records if r.get("auto_choice")}
    times = without_servers(times, choices)
    if not times:
        return None
    best = min(times, key=times.get)
    own = {str(r["strategy"]): r for r in records}

    def paired(name: str) -> Interval | None:
        if best in own:
            return interval_of((own[best].get("references") or {}).get(name) or {}, "vs_strategy")
        ref = ((own.get(name) or {}).get("references") or {}).get(best) or {}
        inverse = interval_of(ref, "vs_strategy")  # best over name: turn it round
        return None if inverse is None else inverse.inverted()

    return decide(times, paired)


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
