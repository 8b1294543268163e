"""Where the current command's jobs stand (``STATE``): how many, how many done and failed, and
where their records go; shared by the sweep's progress callback (``harness.report.progress``)
and the command line, which reads it without importing the report's tables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class SweepState:
    """The current command's jobs, shared by the sweeper, this callback and the CLI."""

    total: int = 0
    """Jobs in the sweep (set once every job's config has been validated); 0 if unknown."""
    done: int = 0
    failed: int = 0
    records: Path | None = None
    """The run or sweep directory the records go to."""


STATE = SweepState()
