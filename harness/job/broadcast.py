"""What a job runs (``JobSpec``, for both scopes), a broadcast job on one rank, and every job's
summary. A broadcast job's rank prepares (groups, every shape's batch, the strategies built:
``Prepared``, its ``harness.job.phases.Job``) and runs the measured phases
(``harness.job.phases.run_phases``); a dispatch job runs the same phases on its driver
(``harness.job.dispatch``).

``run_job_on_rank`` runs identically in every world (``harness.worlds.protocol``). ``summarize``
turns the answers (every rank's, or a dispatch driver's one) into one record's measured
fields (a call costs its slowest rank), and a varying workload's per-shape figures
(``per_shape``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist

import strategies
from harness.job.dispatch_modes import FLOORS, Mode, under_test, with_floors
from harness.job.phases import PHASES, run_phases, start_line, sync, verify_broadcast
from harness.job.rounds import Scope, p50_us
from harness.job.verification import digest
from harness.payload import source
from harness.payload.workload import CallShape, Workload, constant
from strategies.core.layout import Layout
from strategies.floor import Floor, raw_parts


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
    references: tuple[str, ...] = ("floor", "pickled")
    options: dict = field(default_factory=dict)
    fault_rank: int = -1
    fault_at_iter: int = -1
    fault_kind: str = "crash"
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
    modes: tuple[str, ...] = ()
    """A dispatch job: the modes it compares, the one under test first (``bcastbench
    ray-dispatch``); empty: the mode ``dispatch`` and ``strategy`` name (``under_test``). Each
    family's floor is added (``harness.job.dispatch_modes.with_floors``)."""

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
            return Mode.parse(self.modes[0]).name  # as the job's results name it
        return under_test(self.dispatch, self.strategy)

    @property
    def baseline(self) -> str:
        """What ``vs_baseline`` divides by, when the job timed it: the seed's pickled."""
        return "pickled" if self.scope is Scope.BROADCAST else "leader:pickled"

    def dispatch_modes(self) -> list[Mode]:
        """A dispatch job's modes, parsed, with each family's floor."""
        return with_floors(self.modes or (self.under_test,))

    def floors(self, names) -> list[str]:
        """Which of ``names`` are this job's floors: every raw method (``floor``,
        ``floor:<method>``) of a broadcast job; a dispatch job's mode's own family floor."""
        if self.scope is Scope.BROADCAST:
            return [n for n in names if n.split(":")[0] == "floor"]
        own = FLOORS[Mode.parse(self.under_test).kind]
        return [own] if own in names else []

    def period(self) -> tuple[CallShape, ...]:
        """The shapes call c of the job moves, ``period()[c % len(period())]``."""
        if self.workload is not None:
            return self.workload.period
        return constant(self.batch_size, self.seq_len, self.layout.dp).period

    def distinct_shapes(self) -> list[CallShape]:
        """The period's shapes, each once, in the order they first appear."""
        return list(dict.fromkeys(self.period()))

    def shape_of_call(self, call: int) -> CallShape:
        """What the job's call ``call`` moves (warm-up calls count first)."""
        period = self.period()
        return period[call % len(period)]


def leader_batch(
    spec: JobSpec, groups, layout: Layout, shape: CallShape | None = None
) -> strategies.DataProto | None:
    """The replica leader's DataProto for one shape (the period's first by default): different,
    seeded data per replica and per draw, on the device."""
    if not groups.is_leader:
        return None
    shape = shape or spec.period()[0]
    replica = layout.coords(groups.rank)["dp"]
    dp = source.make(
        spec.payload,
        shape.rows[replica],
        shape.seq_len if shape.seq_len is not None else spec.seq_len,
        spec.seed + replica + layout.dp * shape.draw,  # draw 0: seed + replica, as ever
        spec.broadcast_non_tensor,
        spec.payload_path,
        spec.payload_trust,
        spec.payload_max_bytes,
    )
    if groups.device.type != "cpu":
        dp.batch = dp.batch.to(groups.device)
    return dp


@dataclass
class Prepared:
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
    scope = Scope.BROADCAST

    def call(self, name: str):
        """One call of ``name`` from the entry state ROLL's dispatcher leaves, its device work
        done."""
        out = self.built[name].get_data_input(self.full.entry_state(self.groups.is_leader))
        sync(self.groups.device)
        return out

    def timed(self, name: str) -> float:
        """One call of ``name`` timed on this rank from ``start_line`` until the rank holds
        the batch, in seconds. What the call returned is let go after the clock stopped (a
        caller keeps its batch for the step; freeing it is not the call's cost), the floor's
        received bytes alike."""
        strategy = self.built[name]
        entry = self.full.entry_state(self.groups.is_leader)
        start_line(self.groups)
        t0 = time.perf_counter()
        out = strategy.get_data_input(entry)
        sync(self.groups.device)
        elapsed = time.perf_counter() - t0
        del out, entry
        if getattr(strategy, "raw_bytes", False):
            strategy.let_go()
        return elapsed

    def fence(self) -> None:
        """A barrier over the world."""
        dist.barrier()

    def verify(self, name: str) -> list[str]:
        """One call of ``name``, this rank's result compared with the leader's batch."""
        if self.groups.is_leader and self.leader_digest is None:
            self.leader_digest = digest(self.full, True)
        out = self.call(name)
        return verify_broadcast(
            name, self.built[name], out, self.leader_digest, self.groups, self.full
        )

    def use(self, shape: CallShape) -> None:
        """Make ``shape``'s batch the one calls move. A raw-bytes strategy (the floor) moves
        an already packed buffer, so it packs the new one here, untimed, on every rank; every
        other strategy sees only the batch it is handed, as in a real step."""
        if shape == self.current:
            return
        self.full, self.current, self.leader_digest = self.batches[shape], shape, None
        for name in self.order:
            if getattr(self.built[name], "raw_bytes", False):
                self.built[name].prepare(self.full.entry_state(self.groups.is_leader))


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


def prepare(ctx, spec: JobSpec) -> Prepared | dict:
    """Groups, the payload on each replica leader, meta_info on every rank, every strategy
    built; a refusal (raised on every rank before any collective) returns its record instead."""
    ctx.report("building groups")
    groups = ctx.groups_for(spec.layout)
    ctx.report("generating the payload")
    batches = _batches(spec, groups)
    first = spec.period()[0]
    full = batches[first]
    order, options = _order(spec)
    built = {}
    for name in order:
        try:
            built[name] = strategies.get(name.split(":")[0], groups, **options[name])
        except strategies.Unsupported as exc:
            return {
                "rank": ctx.rank,
                "unsupported": f"{name}: {exc}",
                "is_leader": groups.is_leader,
            }
        built[name].prepare(full.entry_state(groups.is_leader))
    return Prepared(groups, full, order, built, batches, first)


def _order(spec: JobSpec) -> tuple[list[str], dict[str, dict]]:
    """The strategy under test, then its references; a ``floor`` reference stands for every
    raw method the layout allows (``Floor.variants``: ``floor`` is one broadcast, the others
    are labelled ``floor:<method>``), all timed in the same rounds so the fastest is the floor."""
    options = {spec.strategy: dict(spec.options)}
    for name in spec.references:
        if name == "floor" and spec.strategy != "floor":
            options.update(Floor.variants(spec.layout, spec.device))
        elif name != spec.strategy:
            options[name] = {}
    return list(options), options


def run_job_on_rank(ctx, spec: JobSpec) -> dict:
    """A broadcast job's rank: prepare, then every measured phase of its scope that applies
    (``harness.job.phases.run_phases``), each but the rounds on the period's first shape."""
    job = prepare(ctx, spec)
    if isinstance(job, dict):
        return job
    leader = job.groups.is_leader
    out = {
        "rank": ctx.rank,
        "is_leader": leader,
        "payload_bytes": _payload_bytes(job.batches[spec.period()[0]]) if leader else None,
        "shape_bytes": [_payload_bytes(job.batches[s]) for s in spec.distinct_shapes()]
        if leader
        else None,
        "device": str(job.groups.device),
    }
    return {**out, **run_phases(ctx, spec, job)}


def _payload_bytes(full) -> int:
    """What the floor sends (``strategies.floor.raw_parts``)."""
    return sum(p.numel() for p in raw_parts(full))


def summarize(spec: JobSpec, rank_results: list[dict]) -> dict:
    """Fold all ranks' results (a dispatch job: its driver's one) into one record's measured
    fields: every phase checks the job (a wrong byte fails it) and folds each strategy's
    fields (a call costs its slowest rank)."""
    refused = [r["unsupported"] for r in rank_results if "unsupported" in r]
    if refused:
        return {"unsupported": refused[0]}
    ran = [phase for phase in PHASES if spec.scope in phase.scopes]
    for phase in ran:
        phase.check(spec, rank_results)
    per_strategy = {}
    for name in rank_results[0]["times_s"]:
        per_strategy[name] = {}
        for phase in ran:  # a phase that did not apply folds nothing
            per_strategy[name].update(phase.fold(spec, name, rank_results))
    leaders = [r for r in rank_results if r["is_leader"]]
    out = {
        "payload_bytes": leaders[0]["payload_bytes"],
        "strategies": per_strategy,
        **best_floor(per_strategy, spec.floors(per_strategy)),
        "device": rank_results[0]["device"],
        **({"refused": rank_results[0]["refused"]} if "refused" in rank_results[0] else {}),
    }
    if spec.workload is not None and spec.workload.varying:
        out["shapes"] = per_shape(spec, rank_results)
        out["payload_bytes"] = _sequence_bytes(spec, out["shapes"])
    return out


def _call_shapes(spec: JobSpec) -> list[int]:
    """Per timed iteration, the index (in ``distinct_shapes``) of the shape it moved."""
    index = {shape: k for k, shape in enumerate(spec.distinct_shapes())}
    return [index[spec.shape_of_call(spec.warmup + it)] for it in range(spec.iters)]


def per_shape(spec: JobSpec, rank_results: list[dict]) -> list[dict]:
    """A varying workload's figures per distinct shape: the timed calls of the sequence that
    moved it (max over ranks per call, as for the whole job), every strategy's p50 and its
    floor, and each strategy's steady-state p50 where steady rounds ran."""
    which = np.array(_call_shapes(spec))
    leaders = [r for r in rank_results if r["is_leader"]]
    out = []
    for k, shape in enumerate(spec.distinct_shapes()):
        figures = {}
        for name in rank_results[0]["times_s"]:
            per_iter = np.array([r["times_s"][name] for r in rank_results]).max(axis=0)
            mine = {"p50_us": p50_us(per_iter[which == k]) if (which == k).any() else None}
            if "steady_s" in rank_results[0]:
                steady = np.array([r["steady_s"][name][k] for r in rank_results]).max(axis=0)
                mine["steady_p50_us"] = p50_us(steady)
            figures[name] = mine
        timed = {n: f for n, f in figures.items() if f["p50_us"] is not None}
        out.append(
            {
                "shape": shape,
                "calls": int((which == k).sum()),
                # The largest replica's: with uneven replicas it is the one a call waits for.
                "payload_bytes": max(r["shape_bytes"][k] for r in leaders),
                "strategies": figures,
                **best_floor(timed, spec.floors(timed)),
            }
        )
    return out


def _sequence_bytes(spec: JobSpec, shapes: list[dict]) -> int:
    """Bytes per call over the timed sequence (mean of each call's largest replica)."""
    bytes_of = [s["payload_bytes"] for s in shapes]
    calls = _call_shapes(spec)
    return int(round(sum(bytes_of[k] for k in calls) / len(calls)))


NODE_FLOORS = frozenset({"floor:shm"})
"""Floor methods that move no byte through the collective library (node-local shared memory):
the network floor (``floor_network_p50_us``) is the fastest of the others."""


def best_floor(per_strategy: dict[str, dict], names: list[str]) -> dict:
    """The honest floor: the fastest of the floors ``names`` timed in the job
    (``floor_method``: a broadcast job's raw method, one | chunks2 | ... | shm; a dispatch job's
    floor mode), beside the single broadcast (``floor_single_p50_us``) and the fastest method
    through the collective library (``floor_network_p50_us``); empty when none was timed."""
    floors = {n: per_strategy[n]["p50_us"] for n in names}
    if not floors:
        return {}
    method = min(floors, key=floors.get)
    broadcast = method.split(":")[0] == "floor"
    network = [p50 for n, p50 in floors.items() if n not in NODE_FLOORS]
    return {
        "floor_p50_us": floors[method],
        "floor_method": (method.partition(":")[2] or "one") if broadcast else method,
        "floor_single_p50_us": floors.get("floor"),
        "floor_network_p50_us": min(network) if network else None,
    }
