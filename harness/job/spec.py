"""What a job is: its ``JobSpec``, built once from the validated config (``harness.job.build``)
and sent to every rank, and its ``Scope`` (where its clock runs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from numbers import Integral, Real

from harness.errors import ConfigError
from harness.job.dispatch_modes import FLOORS, DispatchMode, under_test, with_floors
from harness.job.fault import Fault
from harness.job.label import Label
from harness.payload import sizes
from harness.payload.source import RECORDED, PayloadSource, open_payload
from harness.payload.workload import CallShape, Workload, constant
from strategies.core.layout import Layout


class Scope(str, Enum):
    """What a job's clock covers (the record's ``scope``)."""

    BROADCAST = "broadcast"
    """From the start line on the ranks, the leader holding its batch, to every rank holding
    it (each rank times itself; a call costs the slowest rank's time)."""
    DISPATCH = "dispatch+broadcast"
    """From the driver holding the global batch to the last rank holding its chunk (the
    driver's clock: chunking, Ray's object store and the strategy's broadcast)."""


@dataclass(frozen=True)
class JobSpec:
    """Everything a rank needs to run one job (picklable; sent to every rank)."""

    strategy: str
    layout: Layout
    payload: str = "rl_rollout"
    payload_path: str | None = None
    """payload=file | schema: the recording or schema every replica leader reads."""
    payload_trust: bool = False
    """payload=file: arbitrary unpickling allowed (payload.trust=true)."""
    payload_max_bytes: int | None = None
    """The most bytes a leader's batches may take (None: the default; ``PayloadConf.max_bytes``
    says what each payload kind counts)."""
    batch_size: int = 8
    seq_len: int | None = 1024
    """Tokens per row; a recorded payload's own (None when it has no 2-D leaf)."""
    broadcast_non_tensor: bool | None = None
    seed: int = 0
    iters: int = 20
    warmup: int = 3
    time_budget_s: float | None = None
    """Seconds of timed calls each strategy may take (``JobConf.time_budget_s``)."""
    floor_methods: tuple[str, ...] | None = None
    """The floor's raw methods timed beside one broadcast (``JobConf.floor_methods``; None:
    every one the layout allows)."""
    repeats: int = 1
    """Blocks of ``iters`` timed rounds, one after another (``harness.job.stats`` widens each
    interval to cover the spread between them)."""
    references: tuple[str, ...] = ("floor", "pickled")
    record_each: bool = False
    """Every strategy timed in the job gets a record of its own (the others its references),
    so a sweep compares strategies inside one job (``harness.job.execute``)."""
    options: dict = field(default_factory=dict)
    fault: Fault = field(default_factory=Fault)
    """The injected fault (``harness.job.fault``; none by default)."""
    link_bytes_calls: int = 0
    """Emulated clusters only: untimed calls per strategy whose node-link bytes are counted
    through the rank context's ``link_counter`` hook (``harness.worlds.emulated``); 0, or a
    context without the hook, skips the phase."""
    backend: str = "gloo"
    """Process-group backend the world runs (recorded)."""
    device: str = "cpu"
    """cpu | cuda: where the tensors live (recorded)."""
    world: str = "forked"
    """forked | ray: who runs the ranks when the driver launches them (recorded)."""
    dispatch: str = "none"
    """Ray worlds: none (the broadcast alone) | leader | all_ranks (``RayConf.dispatch``)."""
    workload: Workload | None = None
    """The shapes the calls cycle through (``harness.payload.workload``); None: every call moves
    ``batch_size`` rows on every replica leader."""
    steady_iters: int = 0
    """A varying workload: after the sequence, this many interleaved rounds of each distinct
    shape alone (after one untimed round of it), for each shape's steady-state p50."""
    left_out: tuple[tuple[str, str], ...] = ()
    """References the driver left out before the job started, with why (they would not fit
    this host's memory beside the others: ``harness.job.fits``); recorded as refused."""
    node_memory: bool = True
    """Measure each strategy's memory on the node from nothing (``NodeMemory``: two more
    calls per strategy, every strategy built anew)."""
    timeout_s: float = 120.0
    """No progress on a rank for this long fails the job (every world; ``harness.worlds``)."""
    source: PayloadSource | None = field(default=None, compare=False, repr=False)
    """The payload as the driver opened it (a recording's batch, a schema's checked form, read
    once: ``harness.payload.source``); None: opened where it is first needed
    (``payload_source``)."""
    modes: tuple[str, ...] = ()
    """A dispatch job: the modes it compares, the one under test first (``bcastbench
    ray-dispatch``); empty: the mode ``dispatch`` and ``strategy`` name (``under_test``). Each
    family's floor is added (``harness.job.dispatch_modes.with_floors``)."""

    def __post_init__(self) -> None:
        """The counts every entry point (the CLI's config check, the pytest plugin, a script)
        must give sensibly, refused here in one line (a ``ConfigError``) before any rank
        starts. A recording's own tokens per row may be 0 (its only 2-D leaf is empty)."""
        counts = {"batch_size": (self.batch_size, 1), "iters": (self.iters, 1),
                  "repeats": (self.repeats, 1), "warmup": (self.warmup, 0)}  # fmt: skip
        if self.seq_len is not None:
            counts["seq_len"] = (self.seq_len, 0 if self.payload in RECORDED else 1)
        for name, (value, least) in counts.items():
            if not isinstance(value, Integral) or isinstance(value, bool) or value < least:
                raise ConfigError(f"job: {name} must be an int >= {least}, got {value!r}")
        for name in ("timeout_s", "time_budget_s"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, Real) or not value > 0:
                raise ConfigError(f"job: {name} must be positive seconds, got {value!r}")

    @property
    def scope(self) -> Scope:
        """Where the clock runs: on the ranks (broadcast) or on the driver (dispatch)."""
        return Scope.BROADCAST if self.dispatch == "none" else Scope.DISPATCH

    @property
    def under_test(self) -> str:
        """The name the job's record is about: the strategy, or a dispatch job's mode."""
        if self.scope is Scope.BROADCAST:
            return self.strategy
        if self.modes:
            return DispatchMode.parse(self.modes[0]).name  # as the job's results name it
        return under_test(self.dispatch, self.strategy)

    @property
    def baseline(self) -> str:
        """What ``vs_baseline`` divides by, when the job timed it: the seed's pickled."""
        return "pickled" if self.scope is Scope.BROADCAST else "leader:pickled"

    def dispatch_modes(self) -> list[DispatchMode]:
        """A dispatch job's modes, parsed, with each family's floor."""
        return with_floors(self.modes or (self.under_test,))

    def floors(self, names) -> list[str]:
        """Which of ``names`` are this job's floors: every raw method (``floor``,
        ``floor:<method>``) of a broadcast job; a dispatch job's mode's own family floor."""
        if self.scope is Scope.BROADCAST:
            return [n for n in names if Label.parse(n).is_floor]
        own = FLOORS[DispatchMode.parse(self.under_test).kind]
        return [own] if own in names else []

    def payload_source(self) -> PayloadSource:
        """Where this job's batches come from: the spec's own ``source``, or the payload its
        fields name opened here (for the most rows one leader holds in one call)."""
        if self.source is not None:
            return self.source
        rows = max(s.batch_size for s in self.period())
        return open_payload(
            self.payload, self.payload_path, self.payload_trust, self.payload_max_bytes, rows
        )

    @property
    def timed_rounds(self) -> int:
        """Every timed round of the job: ``iters`` per block, ``repeats`` blocks."""
        return self.iters * self.repeats

    def block_of_round(self) -> list[int]:
        """Each timed round's block (repeat), in order."""
        return [it // self.iters for it in range(self.timed_rounds)]

    def period(self) -> tuple[CallShape, ...]:
        """The shapes call c of the job moves, ``period()[c % len(period())]``."""
        if self.workload is not None:
            return self.workload.period
        return constant(self.batch_size, self.seq_len, self.layout.dp).period

    def largest_generated_bytes(self) -> int | None:
        """The bytes of the largest batch a leader builds, from its shapes alone (nothing
        allocated; the same on every rank); None for a payload that is not generated."""
        if self.payload not in sizes.GENERATED:
            return None
        return max(
            sizes.payload_bytes(self.payload, max(shape.rows), shape.seq_len or self.seq_len)
            for shape in self.distinct_shapes()
        )

    def distinct_shapes(self) -> list[CallShape]:
        """The period's shapes, each once, in the order they first appear."""
        return list(dict.fromkeys(self.period()))

    def shape_of_call(self, call: int) -> CallShape:
        """What the job's call ``call`` moves (warm-up calls count first)."""
        period = self.period()
        return period[call % len(period)]
