"""What every measured phase is: the ``Job`` a phase measures through, one timed call's
``Timing``, and the ``Phase`` base class. The phases themselves are ``harness.job.phases`` (and
``harness.job.node_memory``); their order is ``harness.job.phases.PHASES``."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

from harness.job.results import RankResult
from harness.job.spec import Scope


class Timing(NamedTuple):
    """One timed call: wall seconds, the CPU seconds of this process inside them, on a leader
    the call's (wall, CPU) seconds per phase (``strategies.core.phase_clock``), and where the
    call was checked (``Job.timed(check=True)``) what the check found."""

    wall_s: float
    cpu_s: float | None = None
    phases: dict | None = None
    problems: list[str] | None = None


class Job(Protocol):
    """What a phase measures through: one job's strategies (or dispatch modes) and its calls."""

    scope: Scope
    order: list[str]
    """The strategy (or mode) under test first, then what it is compared with."""

    def use(self, shape) -> None:
        """Make ``shape`` (a ``harness.payload.workload.CallShape``) the one calls move."""

    def call(self, name: str) -> Any:
        """One untimed call of ``name``, finished (device work included) when it returns."""

    def timed(
        self, name: str, check: bool = False, during: AbstractContextManager | None = None
    ) -> Timing:
        """One call of ``name``: its seconds, the clock where the scope puts it, and the CPU
        seconds this process spent in it (None where the clock is a driver's); with ``check``,
        its result checked bit for bit once the clock stopped (``Timing.problems``).
        ``during``: a context the call alone runs in, as ``verify``'s."""

    def fence(self) -> None:
        """Separate what came before from what comes next (a barrier over the world where the
        phase runs on every rank; nothing on a driver, whose calls end when every rank has)."""

    def verify(self, name: str, during: AbstractContextManager | None = None) -> list[str]:
        """One call of ``name`` checked bit for bit: each problem names its rank and key.
        ``during``: a context the call alone runs in (a recorder of what it does), not the
        check after it."""


BOTH = frozenset(Scope)
"""Every scope: a phase that measures a broadcast job and a dispatch job alike."""


class Phase:
    """One measured phase (see the module docstring)."""

    scopes: frozenset[Scope] = frozenset({Scope.BROADCAST})
    """The scopes whose jobs run it; a rank-side measurement (collectives, memory) only runs
    where the phase runs on the ranks."""

    def applies(self, ctx, spec) -> bool:
        """Whether the phase runs in this job on this context (the same on every rank)."""
        return True

    part: str | None = None
    """The ``StrategyFigures`` field ``fold`` fills (None: the phase folds nothing)."""

    def measure(self, ctx, spec, job: Job) -> dict[str, Any]:
        """What this rank (or a dispatch job's driver) measured: ``RankResult`` fields, taken
        into its result (picklable)."""
        raise NotImplementedError

    def check(self, spec, results: list[RankResult]) -> None:
        """Raise if the ranks' answers fail the job (verification); nothing by default."""

    def fold(self, spec, name: str, results: list[RankResult]) -> Any:
        """Strategy ``name``'s part (``part``) from every rank's result (rank order); None
        where the phase measured nothing for it."""
        return None

    record_fields: tuple[str, ...] = ()
    """The summary fields of the strategy under test a record carries as they are."""


def checks_in_rounds(spec) -> bool:
    """Whether a job's calls are checked inside its rounds (``TimedRounds``) instead of in
    calls of their own (``Verification``): each strategy's last timed call is compared bit for
    bit once its clock stopped, and its last warm-up call, the second or later (a first call
    sets up channels a steady one does not), is the one whose collectives are recorded; the
    node's memory is read in its first warm-up calls (``harness.job.node_memory.Watch``). Each
    strategy's calls then pay for no call of its own, which at a gigabyte is the price of a
    round. Broadcast jobs of a constant workload with at least two warm-up rounds; elsewhere
    (a dispatch's check travels inside its call; a varying workload checks one call per shape
    of its period) ``Verification`` makes its own calls."""
    return (
        spec.scope is Scope.BROADCAST
        and spec.warmup >= 2
        and not (spec.workload is not None and spec.workload.varying)
    )
