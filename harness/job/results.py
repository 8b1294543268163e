"""What a job measured, typed from the rank to the summary: each rank's ``RankResult`` (a
dispatch job's driver makes one too), the figures each phase folds out of them for one
strategy (``StrategyFigures``), and the ``JobSummary`` a record is built from.

A phase fills the ``RankResult`` fields it names (``harness.job.phases``); unknown names are
refused, so what crosses from the ranks is what is declared here. Strategy-keyed dicts stay
dicts (their keys are the job's strategy names, data rather than fields).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from harness.payload.workload import CallShape


@dataclass(frozen=True)
class RankResult:
    """One rank's answer to a broadcast job (or a dispatch job driver's): who it is, what its
    batch weighed, and what each phase measured, strategy by strategy."""

    rank: int
    is_leader: bool
    device: str = "cpu"
    payload_bytes: int | None = None
    """A leader's: what the floor sends for the period's first shape (``strategies.floor``)."""
    shape_bytes: list[int] | None = None
    """A leader's: the same for each distinct shape of the period, in order."""
    unsupported: str | None = None
    """Why the strategy under test refused the layout or batch (raised on every rank before any
    collective); nothing else is measured then."""
    refused: dict[str, str] = field(default_factory=dict)
    """A dispatch job: the leader modes' strategies that refused the layout, with why."""
    times_s: dict[str, list[float]] = field(default_factory=dict)
    """Seconds per timed call, by strategy (``TimedRounds``)."""
    cpu_s: dict[str, list[float | None]] | None = None
    """CPU seconds this process spent inside each timed call, by strategy (None per call
    where the clock is a driver's)."""
    phases_s: dict[str, list[dict | None]] | None = None
    """A leader's: each timed call's {phase: (wall, CPU) seconds}, by strategy, for the
    strategies that mark their phases (``strategies.core.phase_clock``)."""
    steady_s: dict[str, list[list[float]]] | None = None
    """Seconds per steady-state call, by strategy then distinct shape (``SteadyRounds``)."""
    link_bytes_per_call: dict[str, float] | None = None
    """Node-link bytes per call, by strategy, read on rank 0 (``LinkBytes``)."""
    collectives: dict[str, list[tuple] | None] | None = None
    """(kind, ranks, root, bytes) of each collective one call made, by strategy; None where the
    recorder could not see every path to a collective (``Verification``'s first call)."""
    collectives_unavailable: dict[str, str | None] | None = None
    """Why a strategy's collectives could not be counted (None: counted)."""
    work: dict[str, dict[str, int]] | None = None
    """Bytes one call packed, pickled, copied..., by strategy (``Verification``'s first call)."""
    peak_rss_bytes: dict[str, int] | None = None
    """VmHWM after one call, by strategy (``PeakMemory``, or ``NodeMemory``'s calls)."""
    peak_rss_delta_bytes: dict[str, int | None] | None = None
    """What that call added to the resident set (None: it could not be isolated)."""
    peak_cuda_bytes: dict[str, int] | None = None
    """CUDA's peak allocation of that call (0 on CPU)."""
    problems: dict[str, list[str]] | None = None
    """What verification found wrong, by strategy, each naming rank and key (``Verification``)."""
    choices: dict[str, str] | None = None
    """The strategy a choosing strategy (``auto``) serves its next call with (``AutoChoice``)."""
    node_memory: dict[str, dict] | None = None
    """By strategy: this rank's host, its idle PSS, its sampled peak PSS (and that sample's
    shared-memory part) and its VmHWM over the strategy's calls from nothing (``NodeMemory``)."""
    base_pss_bytes: int | None = None
    """This rank's PSS before any batch of the job existed: the harness's own floor."""

    def taking(self, measured: dict[str, Any]) -> RankResult:
        """This result with a phase's measurements added (names must be fields: a phase that
        returns anything else is a bug, raised here rather than lost)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(measured) - known)
        if unknown:
            raise TypeError(f"RankResult has no fields {unknown}; declare them in {__name__}")
        return replace(self, **measured)


@dataclass(frozen=True)
class TimingFigures:
    """A strategy's calls over the job: each call costs its slowest rank (``TimedRounds``)."""

    p50_us: float
    p90_us: float
    p99_us: float
    min_us: float
    max_us: float
    mean_us: float
    rank_skew_us: float | None
    """Median over calls of one call's spread across ranks (None: a driver's clock)."""
    p50_lo_us: float | None = None
    p50_hi_us: float | None = None
    """The p50's 95 % interval (``harness.job.stats.p50_interval``; None: too few calls)."""
    cpu_us_per_call: float | None = None
    """CPU microseconds per call, every rank of the replica together (median over calls)."""
    cpu_us_leader: float | None = None
    """The replica leader's alone."""
    leader_plan_us: float | None = None
    """The leader's wall microseconds per phase of a call (``harness.job.leader_phases``)."""
    leader_encode_us: float | None = None
    leader_copy_us: float | None = None
    leader_signal_us: float | None = None
    leader_clock_us: float | None = None
    leader_plan_cpu_us: float | None = None
    """The leader's thread-CPU microseconds per phase of a call."""
    leader_encode_cpu_us: float | None = None
    leader_copy_cpu_us: float | None = None
    leader_signal_cpu_us: float | None = None
    leader_clock_cpu_us: float | None = None


@dataclass(frozen=True)
class LinkFigures:
    """Bytes the emulated cluster's node links carried per call (``LinkBytes``)."""

    cross_node_bytes_per_call: float


@dataclass(frozen=True)
class CollectiveFigures:
    """What one call issued and copied (``Verification``'s first call, recorded)."""

    collectives_per_call: int | None
    collectives_leader: int | None
    comm_bytes_leader: int | None
    collectives_unavailable: str | None
    work_leader: dict[str, int]
    work_receiver_max: dict[str, int]


@dataclass(frozen=True)
class MemoryFigures:
    """One call's memory high-water marks, the highest over ranks (``PeakMemory``)."""

    peak_rss_bytes: int
    peak_rss_delta_bytes: int | None
    peak_rss_heap_released: bool
    peak_cuda_bytes: int


@dataclass(frozen=True)
class NodeMemoryFigures:
    """What one strategy keeps resident on its busiest node, measured from nothing
    (``harness.job.node_memory.NodeMemory``)."""

    rank_peak_bytes: int
    node_peak_bytes: int
    node_idle_bytes: int
    node_kept_bytes: int
    node_shm_bytes: int
    node_copies: float
    harness_copies: float | None
    node_ranks: int
    memory_sample_ms: float


@dataclass(frozen=True)
class ChoiceFigures:
    """The strategy ``auto`` served its last call with (``AutoChoice``)."""

    choice: str


@dataclass(frozen=True)
class StrategyFigures:
    """One strategy's figures in one job: each phase that ran and applied fills its own part
    (``Phase.part`` names it); the rest stay None."""

    timing: TimingFigures
    link: LinkFigures | None = None
    collectives: CollectiveFigures | None = None
    memory: MemoryFigures | None = None
    choice: ChoiceFigures | None = None
    node_memory: NodeMemoryFigures | None = None

    def flat(self) -> dict[str, Any]:
        """Every measured figure by its record name (the parts that ran, in order)."""
        out: dict[str, Any] = {}
        for part in fields(self):
            value = getattr(self, part.name)
            if value is not None:
                out.update(asdict(value))
        return out

    @property
    def p50_us(self) -> float:
        return self.timing.p50_us


@dataclass(frozen=True)
class FloorFigures:
    """The honest floor of a job (or of one shape): the fastest raw method timed in it."""

    p50_us: float
    method: str
    """A broadcast job's raw method (one | chunks2 | ... | shm); a dispatch job's floor mode."""
    name: str
    """The floor's own name among the job's strategies (``floor``, ``floor:shm``, ...)."""
    single_p50_us: float | None
    """One raw broadcast over the replica (``floor``), where it was timed."""
    network_p50_us: float | None
    """The fastest raw method through the collective library (every method but shm)."""
    network_name: str | None = None
    """That method's own name among the job's strategies."""


@dataclass(frozen=True)
class ShapeStrategyFigures:
    """One strategy on one distinct shape of a varying workload."""

    p50_us: float | None
    """Its calls of this shape in the sequence (None: no timed call moved it)."""
    steady_p50_us: float | None = None
    """The same shape alone, after one untimed call of it (None: no steady rounds)."""


@dataclass(frozen=True)
class ShapeFigures:
    """A varying workload's figures for one distinct shape."""

    shape: CallShape
    calls: int
    """Timed calls of the sequence that moved this shape."""
    payload_bytes: int
    """The largest replica's bytes (the one a call waits for)."""
    strategies: dict[str, ShapeStrategyFigures]
    floor: FloorFigures | None


@dataclass(frozen=True)
class JobSummary:
    """Every rank's results folded into one job's figures: a call costs its slowest rank, and
    every phase's check passed (a wrong byte fails the job before a summary exists)."""

    payload_bytes: int
    """The floor's bytes per call (a varying workload: the mean over its timed calls)."""
    device: str
    strategies: dict[str, StrategyFigures]
    """Every strategy (or dispatch mode) timed, the one under test first."""
    floor: FloorFigures | None
    refused: dict[str, str] | None = None
    """A dispatch job: the modes whose strategy refused the layout, with why."""
    shapes: list[ShapeFigures] | None = None
    """A varying workload: one entry per distinct shape; None for a constant workload."""
    calls_s: dict[str, list[float]] = field(default_factory=dict)
    """Every timed call's seconds (its slowest rank), by strategy, in round order: what the
    same-job ratios' intervals pair round by round (``harness.job.stats``)."""
    blocks: list[int] = field(default_factory=list)
    """Each timed round's block (``repeats``)."""


@dataclass(frozen=True)
class Refusal:
    """A job whose strategy (or mode) under test refused the layout or batch on every rank."""

    why: str
