"""The broadcast job, on one rank: prepare (groups, every shape's batch, the strategies built:
a ``BroadcastJob``, this scope's ``harness.job.phase_base.Job``), then run the measured phases
(``harness.job.phases.run_phases``) into this rank's ``RankResult``. ``run_job_on_rank`` runs
identically in every world (``harness.worlds.protocol``); the dispatch job beside it
(``harness.job.dispatch``) runs the same phases on a Ray driver.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch.distributed as dist

import strategies
from harness.job.label import Label
from harness.job.node_memory import release_free_heap, resident, rss_now
from harness.job.phase_base import Timing
from harness.job.phases import run_phases, start_line, sync
from harness.job.probes import build_probe, is_probe
from harness.job.results import RankResult
from harness.job.spec import JobSpec, Scope
from harness.job.verification import (
    batch_problems,
    bytes_problems,
    delivered,
    digest,
    tensor_digest,
)
from harness.payload.workload import CallShape
from strategies.core.layout import Layout
from strategies.core.phase_clock import CLOCK
from strategies.floor import Floor, raw_parts


def leader_batch(
    spec: JobSpec, groups, layout: Layout, shape: CallShape | None = None
) -> strategies.DataProto | None:
    """The replica leader's DataProto for one shape (the period's first by default): different,
    seeded data per replica and per draw, on the device."""
    if not groups.is_leader:
        return None
    shape = shape or spec.period()[0]
    replica = layout.coords(groups.rank)["dp"]
    dp = spec.payload_source().batch(
        shape.rows[replica],
        shape.seq_len if shape.seq_len is not None else spec.seq_len,
        spec.seed + replica + layout.dp * shape.draw,  # draw 0: seed + replica, as ever
        spec.broadcast_non_tensor,
    )
    if groups.device.type != "cpu":
        dp.batch = dp.batch.to(groups.device)
    return dp


@dataclass
class BroadcastJob:
    """A rank's job after preparation: its groups, the batch of every shape it moves, the one
    calls move now and the built strategies."""

    groups: object
    full: strategies.DataProto
    """The leader's whole batch of the current shape; on other ranks its entry state
    (meta_info only)."""
    order: list[str]
    """The strategy under test first, then the references."""
    built: dict
    batches: dict = field(default_factory=dict)
    """CallShape -> that shape's ``full``, built before anything is timed."""
    current: CallShape | None = None
    leader_digest: dict | None = None
    """The leader's digest of the current shape's batch, once verification asked for it."""
    delay_s: float = 0.0
    """Seconds this rank adds to each timed call of the strategy under test (fault.kind=delay
    on this rank)."""
    refused: dict = field(default_factory=dict)
    """References that refused the layout or batch (on every rank), with why."""
    build: Callable[[str], object] | None = None
    """Builds strategy ``name`` anew on this rank (``rebuild``)."""
    base_pss: int | None = None
    """This rank's PSS before any batch of the job existed (``harness.job.node_memory``)."""
    idle: tuple = (None, 0)
    """This rank's memory holding the job's batches and nothing of any strategy: its
    ``Resident`` (None where unread) and resident bytes (``harness.job.node_memory.Watch``)."""
    scope = Scope.BROADCAST

    def release(self, full: bool = True) -> bool:
        """Drop every built strategy, and with it whatever it keeps between calls (buffers,
        segments, received bytes), then hand the free heap back: what stays is the job's
        batches and the harness. ``full``: collect every generation too (slow in a rank that
        imported torch: once per job; a strategy only a full collection frees then stays in
        the next one's idle figure and peak alike, which its copies subtract). False where the
        free heap could not be handed back (``release_free_heap``)."""
        self.built = {}
        return release_free_heap(full=full)

    def drop(self, name: str) -> None:
        """Strategy ``name`` dropped, and with it what it holds (``rebuild`` makes it again;
        every rank drops it at the same point: dropping may close a channel)."""
        del self.built[name]

    def rebuild(self, name: str) -> None:
        """Strategy ``name`` built anew and prepared for the current batch (every rank calls
        it in the same order: building may set up a channel)."""
        self.built[name] = self.build(name)
        prepare_all(self.built, [name], self.full, self.groups.is_leader)

    def call(self, name: str):
        """One call of ``name`` from the entry state ROLL's dispatcher leaves, its device work
        done. Whatever a raw method received in an earlier untimed call is let go first: a
        receiver would otherwise keep one batch per floor method between warm-up calls."""
        self.let_go_all()
        out = self.built[name].get_data_input(self.full.entry_state(self.groups.is_leader))
        sync(self.groups.device)
        return out

    def timed(
        self, name: str, check: bool = False, during: AbstractContextManager | None = None
    ) -> Timing:
        """One call of ``name`` timed on this rank from ``start_line`` until the rank holds
        the batch: its seconds, and the CPU seconds this process spent inside them (every
        thread's: gloo moves the bytes on threads of its own, not the caller's). What the call
        returned is let go after the clock stopped (a caller keeps its batch for the step;
        freeing it is not the call's cost), the floor's received bytes alike. The fault rank
        of a ``fault.kind=delay`` job spends its delay inside the call of the strategy under
        test. ``during``: a context the call alone runs in (a recorder of its collectives: the
        start line and the check are outside it)."""
        strategy = self.built[name]
        entry = self.full.entry_state(self.groups.is_leader)
        delay_s = self.delay_s if name == self.order[0] else 0.0
        split = self.groups.is_leader and getattr(strategy, "phased", False)
        if split:
            CLOCK.calibrated()  # once per process, before any clock runs
        start_line(self.groups)
        c0, t0 = time.process_time(), time.perf_counter()
        if split:
            CLOCK.begin()
        try:
            with during or nullcontext():
                out = strategy.get_data_input(entry)
                sync(self.groups.device)
        finally:  # a call that raised leaves no clock running into the next untimed one
            phases = CLOCK.end()
        if delay_s:
            time.sleep(delay_s)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        problems = self.compare(name, out) if check else None
        del out, entry
        self.let_go(name)
        return Timing(elapsed, cpu, phases, problems)

    def let_go_all(self) -> None:
        """``let_go`` of every built strategy."""
        for name in self.order:
            if name in self.built:
                self.let_go(name)

    def let_go(self, name: str) -> None:
        """Drop what a raw method (the floor) received in its last call: a caller keeps the
        batch it got, the floor keeps its bytes for verification until told."""
        strategy = self.built[name]
        if getattr(strategy, "raw_bytes", False):
            strategy.let_go()

    def fence(self) -> None:
        """A barrier over the world."""
        dist.barrier()

    def verify(self, name: str, during: AbstractContextManager | None = None) -> list[str]:
        """One call of ``name`` (in ``during``, when given), this rank's result compared with
        the leader's batch (a raw method's received bytes with the leader's sent ones), its
        fingerprint sent over the replica's host group."""
        with during or nullcontext():
            out = self.call(name)
        return self.compare(name, out)

    def compare(self, name: str, out) -> list[str]:
        """What ``name``'s last call returned on this rank (``out``) against the leader's batch
        (a raw method's received bytes against the leader's sent ones): every problem, naming
        this rank and the key. Every rank of the replica calls it at the same point (the
        leader's fingerprint goes over the replica's host group)."""
        groups, strategy = self.groups, self.built[name]
        if groups.is_leader and self.leader_digest is None:
            self.leader_digest = digest(self.full, True)
        if hasattr(strategy, "expected_received"):  # a probe knows what each rank must hold
            expected = tensor_digest(strategy.expected_received())
            return bytes_problems(name, groups.rank, expected, tensor_digest(strategy.received))
        if Label.parse(name).is_floor:
            sent = self._from_leader(tensor_digest(strategy.sent) if groups.is_leader else None)
            return bytes_problems(name, groups.rank, sent, tensor_digest(strategy.received))
        expected = self._from_leader(self.leader_digest)
        if not groups.is_leader:
            expected = delivered(expected, strategy.delivers)
        return batch_problems(
            name, groups.rank, expected, digest(out, True),
            meta_changed=out.meta_info != self.full.meta_info,
            non_tensor_sent=bool(self.full.broadcast_non_tensor),
            receiver=not groups.is_leader,
        )  # fmt: skip

    def _from_leader(self, value):
        """``value`` as the replica leader has it, on every rank of the replica."""
        box = [value]
        dist.broadcast_object_list(box, src=self.groups.leader, group=self.groups.cpu_replica_group)
        return box[0]

    def use(self, shape: CallShape) -> None:
        """Make ``shape``'s batch the one calls move. A raw-bytes strategy (the floor) moves
        an already packed buffer, so it packs the new one here, untimed, on every rank; every
        other strategy sees only the batch it is handed, as in a real step."""
        if shape == self.current:
            return
        self.full, self.current, self.leader_digest = self.batches[shape], shape, None
        prepare_all(self.built, self.order, self.full, self.groups.is_leader, raw_only=True)


def _batches(spec: JobSpec, groups) -> dict:
    """Every distinct shape's batch on the leader, and its meta_info on every rank (already
    there before get_data_input: ROLL's dispatcher put it there)."""
    out = {}
    for shape in spec.distinct_shapes():
        full = leader_batch(spec, groups, spec.layout, shape)
        meta = [full.meta_info if full is not None else None]
        dist.broadcast_object_list(meta, src=groups.leader, group=groups.cpu_replica_group)
        out[shape] = full if full is not None else strategies.DataProto(None, {}, meta[0])
    return out


def prepare(ctx, spec: JobSpec) -> BroadcastJob | RankResult:
    """Groups, the payload on each replica leader, meta_info on every rank, every strategy
    built. A refusal is raised on every rank before any collective: the strategy under test's
    returns the job's result instead; a reference's drops it from the job, said in the
    result's ``refused``."""
    ctx.report("building groups")
    groups = ctx.groups_for(spec.layout)
    release_free_heap(full=False)
    before = resident()
    ctx.report("generating the payload")
    batches = _batches(spec, groups)
    release_free_heap(full=False)  # what generating left free is not the batches'
    idle = (resident(), rss_now())
    first = spec.period()[0]
    full = batches[first]
    order, options = job_order(spec)
    built, refused = {}, dict(spec.left_out)
    for name in order:
        try:
            built[name] = _build(ctx, groups, name, options[name])
        except strategies.Unsupported as exc:
            if name == spec.strategy:
                return RankResult(ctx.rank, groups.is_leader, unsupported=f"{name}: {exc}")
            refused[name] = str(exc)
    prepare_all(built, list(built), full, groups.is_leader)
    delay_s = spec.fault.delay_us / 1e6 if spec.fault.delays(ctx.rank) else 0.0
    order = [name for name in order if name in built]
    return BroadcastJob(
        groups, full, order, built, batches, first, delay_s=delay_s, refused=refused,
        build=lambda name: _build(ctx, groups, name, options[name]),
        base_pss=before.pss if before is not None else None, idle=idle,
    )  # fmt: skip


def prepare_all(built: dict, order, full, is_leader: bool, raw_only: bool = False) -> None:
    """Each strategy's untimed ``prepare`` for ``full`` (``raw_only``: the raw-bytes ones, the
    floor's methods, which move an already packed buffer). The raw methods share one packed
    buffer: they move the same bytes, and a copy of the batch per method would be the
    harness's memory, not theirs (a 1 GiB batch with five floor methods held five more)."""
    sent = None
    for name in order:
        strategy = built[name]
        raw = getattr(strategy, "raw_bytes", False)
        if raw_only and not raw:
            continue
        entry = full.entry_state(is_leader)
        if raw and "sent" in inspect.signature(strategy.prepare).parameters:
            strategy.prepare(entry, sent=sent)
            sent = strategy.sent if sent is None else sent
        else:
            strategy.prepare(entry)


def _build(ctx, groups, name: str, options: dict):
    """Strategy ``name`` on this rank: a registered strategy (``floor:<method>`` is the floor
    with that method's options), or a calibration probe (``harness.job.probes``)."""
    if is_probe(name):
        return build_probe(name, ctx)
    return strategies.get(Label.parse(name).strategy, groups, **options)


def job_order(spec: JobSpec) -> tuple[list[str], dict[str, dict]]:
    """The strategy under test, then its references; a ``floor`` reference stands for every
    raw method the layout allows (``Floor.variants``: ``floor`` is one broadcast, the others
    are labelled ``floor:<method>``), all timed in the same rounds so the fastest is the floor."""
    options = {spec.strategy: dict(spec.options)}
    for name in spec.references:
        if name == "floor" and spec.strategy != "floor":
            options.update(Floor.variants(spec.layout, spec.device, spec.floor_methods))
        elif name != spec.strategy:
            options[name] = {}
    return list(options), options


def run_job_on_rank(ctx, spec: JobSpec) -> RankResult:
    """A broadcast job's rank: prepare, then every measured phase of its scope that applies
    (``harness.job.phases.run_phases``), each but the rounds on the period's first shape."""
    job = prepare(ctx, spec)
    if isinstance(job, RankResult):
        return job
    leader = job.groups.is_leader
    result = RankResult(
        rank=ctx.rank,
        is_leader=leader,
        device=str(job.groups.device),
        payload_bytes=_payload_bytes(job.batches[spec.period()[0]]) if leader else None,
        shape_bytes=[_payload_bytes(job.batches[s]) for s in spec.distinct_shapes()]
        if leader
        else None,
        refused=job.refused,
        base_pss_bytes=job.base_pss,
    )
    return run_phases(ctx, spec, job, result)


def _payload_bytes(full) -> int:
    """What the floor sends (``strategies.floor.raw_parts``)."""
    return sum(p.numel() for p in raw_parts(full))
