"""Where the current command's jobs stand (``STATE``): how many, how many done and failed, and
where their records go; shared by the sweep's progress callback (``harness.report.progress``)
and the command line, which reads it without importing the report's tables."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class SweepState:
    """The current command's jobs, shared by the sweeper, this callback and the CLI."""

    total: int = 0
    """Jobs in the sweep (set once every job's config has been validated); 0 if unknown."""
    weights: list[float] = field(default_factory=list)
    """Each job's share of the sweep's time, in the order it runs them
    (``harness.job.sweep_plan.job_weight``); empty if unknown (every job weighs the same)."""
    done: int = 0
    failed: int = 0
    records: Path | None = None
    """The run or sweep directory the records go to."""


STATE = SweepState()


def eta_s(elapsed_s: float, done: int, total: int, weights: list[float]) -> float:
    """Seconds the sweep's other jobs will take, at the pace of those done: by ``weights``
    where there is one per job (a world of 8 ranks takes longer than one of 2), else by count;
    NaN when the total is unknown."""
    if not total or not done:
        return math.nan
    if len(weights) == total:
        paid, left = sum(weights[:done]), sum(weights[done:])
        return elapsed_s * left / paid if paid > 0 else math.nan
    return elapsed_s / done * (total - done)
