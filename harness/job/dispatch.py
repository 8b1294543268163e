"""Dispatch inside the measured path: from "the driver holds the global batch" to "every rank of
every replica holds its chunk", on a Ray world (``harness.worlds.ray_world``).

Modes (``scope = "dispatch+broadcast"``; the forked world's jobs are ``"broadcast"``):

- ``leader:<strategy>`` (ROLL, NeMo-RL's leader-broadcast): the driver chunks the global batch by
  DP, ``ray.put``s each chunk and passes the ref to that replica's leader actor; every other rank
  gets ``DataProto(batch=None, meta_info)``; then all ranks run the broadcast strategy.
- ``leader:floor``, the raw floor of that path: the same bytes as one flat uint8 array put to the
  leader, then the ``floor`` strategy's one raw broadcast.
- ``all_ranks`` (verl, NeMo-RL by default, OpenRLHF): one ``ray.put`` per DP chunk; every rank of
  the replica gets the same ObjectRef and deserializes it. No collective.
- ``all_ranks:raw``, its floor: one put of the flat array per replica, every rank gets it.
- ``rdt`` (Ray Direct Transport, Ray 2.60): the chunk's ref to the replica leader's actor, which
  lends it (``RayWorld.lend``: ``@ray.method(tensor_transport="gloo")``); every rank of the
  replica gets the lent ref, its tensors sent to it over the ranks' gloo group point to point,
  out of the object store, the rest of the DataProto through it. ``rdt:raw``, its floor: the
  flat array lent as one tensor.
- ``cgraph`` (a Ray Compiled Graph, Ray 2.60's ``experimental_compile``): compiled once per job,
  the global batch's chunks go in through the graph's input channel to each replica leader's
  actor, whose output channel every rank of its replica reads (shared memory on one node); no
  task is submitted per call. ``cgraph:raw``, its floor: the same graph with the flat arrays.
- ``edge_stages`` (a verl fork): the chunk's ref to TP×CP rank 0 of the first and of the last
  pipeline stage, each broadcasting it over its stage's TP×CP group; the middle stages hold
  nothing. ``chain`` (TensorRT-LLM): the ref to the replica leader, a broadcast on the first
  stage's TP×CP group, then stage k -> k + 1 point to point down the pipeline. Their floors
  ``edge_stages:raw`` and ``chain:raw`` run the same hops with the flat array
  (``harness.job.dispatch_hops``; who gets and who holds what: ``harness.model.dispatch_ranks``).

Chunking and the put are inside the time. The job is a ``harness.job.spec.JobSpec`` of scope
``dispatch+broadcast``; its driver runs the same measured phases as a broadcast job's ranks
(``harness.job.phases.run_phases``: interleaved rounds, link bytes, verification) through a
``DispatchJob``, whose call is one whole dispatch, into the driver's ``RankResult``, which
``harness.job.execute.run_job`` summarizes and records as it does every other. Each rank's
result is checked bit for bit (``harness.job.verification``) against the chunk the driver cut
for its replica.

``bcastbench ray-dispatch`` (``harness.commands.ray_dispatch``) times several modes side by side;
``bcastbench run`` with ``ray.dispatch=`` runs one of them as a job.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

import strategies
from harness.job.dispatch_hops import hops_call, on_device
from harness.job.dispatch_modes import DispatchMode
from harness.job.phase_base import Timing
from harness.job.phases import run_phases
from harness.job.results import RankResult
from harness.job.spec import JobSpec, Scope
from harness.job.verification import batch_problems, bytes_problems, digest, tensor_digest
from harness.model.dispatch_ranks import (
    ALL_RANKS,
    CGRAPH,
    EDGE_STAGES,
    HOPS,
    LEADER,
    RDT,
    holding_ranks,
    ray_ranks,
)
from harness.payload import generated
from harness.worlds.emulated import link_counter
from harness.worlds.protocol import WorldError
from strategies import DataProto
from strategies.floor import raw_parts

# rdt hands the leader its own lent ref too (Ray serves it from the leader's store), and Ray warns,
# from the thread that starts the transfers, that a tensor written there would change what it
# lends next: no rank writes what it received.
warnings.filterwarnings("ignore", message=r"RDT ObjectRef.*passed back to the actor")


# -- the driver's data -----------------------------------------------------------------------
def chunk(batch: DataProto, rows: int | Sequence[int]) -> list[DataProto]:
    """Split the global batch into one row block per replica, each owning its bytes: ``rows``
    equal blocks for an int, else ``rows[d]`` rows for replica d (an uneven DP split).

    A row slice is a view, and pickling a view ships its whole storage (every replica would
    receive the global batch), so each chunk is copied out once, as verl consolidates before
    pickling."""
    total = int(batch.batch.batch_size[0])
    if isinstance(rows, int):
        if total % rows:
            raise ValueError(f"global batch of {total} rows does not split into dp={rows} chunks")
        rows = [total // rows] * rows
    if sum(rows) != total:
        raise ValueError(f"global batch of {total} rows cannot be split as {list(rows)}")
    starts = np.cumsum([0, *rows[:-1]]).tolist()
    return [
        DataProto(
            batch.batch[a : a + n].clone(),
            {k: v[a : a + n].copy() for k, v in batch.non_tensor_batch.items()},
            batch.meta_info,
        )
        for a, n in zip(starts, rows)
    ]


def flat_bytes(chunk_: DataProto) -> np.ndarray:
    """The floor's bytes of one chunk as one array (``strategies.floor.raw_parts``: exactly
    what the floor's receivers are sized for)."""
    parts = raw_parts(chunk_)
    return torch.cat(parts).numpy() if parts else np.empty(0, dtype=np.uint8)


@dataclass
class _Driver:
    """What the driver holds for one shape of a job: the global batch, how it splits by
    replica, who leads which replica, and what each replica must end with."""

    spec: JobSpec
    global_batch: DataProto
    rows: tuple[int, ...]
    """Rows of each replica's chunk (``CallShape.rows``)."""
    replica_of: list[int]
    leaders: list[int]
    flats: list[np.ndarray]
    expected: list[dict]
    expected_raw: list[str]
    sources: dict[str, frozenset[int]]
    """Per hop family (``edge_stages``, ``chain``): the ranks Ray hands the chunk to."""
    holders: dict[str, frozenset[int]]
    """Per hop family: the ranks that must hold their replica's chunk when a call ends."""

    @classmethod
    def build(cls, spec: JobSpec, shape=None) -> _Driver:
        """The driver's data for ``shape`` (a ``CallShape``; the period's first by default):
        one seeded global batch of every replica's rows together, each draw its own data."""
        lay = spec.layout
        shape = shape or spec.period()[0]
        batch = generated.make(
            spec.payload,
            sum(shape.rows),
            shape.seq_len if shape.seq_len is not None else spec.seq_len,
            spec.seed + shape.draw,
            spec.broadcast_non_tensor,
        )
        chunks = chunk(batch, shape.rows)
        flats = [flat_bytes(c) for c in chunks]
        replica_of = [lay.coords(r)["dp"] for r in range(lay.world_size)]
        leaders = [0] * lay.dp
        for g in lay.replica_groups():
            leaders[replica_of[g[0]]] = g[0]
        return cls(
            spec,
            batch,
            tuple(shape.rows),
            replica_of,
            leaders,
            flats,
            [digest(c, True) for c in chunks],
            [tensor_digest(torch.from_numpy(f)) for f in flats],
            {k: frozenset(r for rep in ray_ranks(k, lay) for r in rep) for k in HOPS},
            {k: frozenset(holding_ranks(k, lay)) for k in HOPS},
        )

    def is_leader(self, rank: int) -> bool:
        return self.leaders[self.replica_of[rank]] == rank

    @property
    def payload_bytes(self) -> int:
        """The floor's bytes of the largest chunk (the replica a call waits for)."""
        return max(int(f.nbytes) for f in self.flats)

    def hand_out(self) -> list:
        """Per rank, what set-up hands it: its replica's chunk (an ObjectRef) to a leader, the
        meta_info alone to every other rank."""
        import ray

        meta = self.global_batch.meta_info
        refs = [ray.put(c) for c in chunk(self.global_batch, self.rows)]
        return [
            refs[d] if self.is_leader(r) else DataProto(None, {}, meta)
            for r, d in enumerate(self.replica_of)
        ]


# -- on the ranks --------------------------------------------------------------------------
def _tensor(arr: np.ndarray) -> torch.Tensor:
    """A tensor over an array Ray handed out read-only (zero-copy from the object store);
    nothing here writes to it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(arr)


def _setup_on_rank(ctx, spec: JobSpec, entry: DataProto) -> dict:
    """Build the groups and every leader mode's strategy, prepared on this rank's entry state
    (the floor packs its buffer here). A refusal is raised on every rank before any collective,
    so refused strategies are reported, not fatal."""
    groups = ctx.groups_for(spec.layout)
    built, refused = {}, {}
    names = sorted({m.strategy for m in spec.dispatch_modes() if m.kind == LEADER})
    for name in names:
        try:
            built[name] = strategies.get(name, groups, **({} if name == "floor" else spec.options))
        except strategies.Unsupported as exc:
            refused[name] = str(exc)
            continue
        built[name].prepare(on_device(entry, groups.device))
    ctx.cache["dispatch"] = built
    ctx.cache["dispatch_groups"] = groups  # the hop modes' groups (harness.job.dispatch_hops)
    stage = {"pp": groups.pp_rank, "tp_cp": groups.tp_cp_rank}
    return {"is_leader": groups.is_leader, "refused": refused, "stage": stage}


def _prepare_raw_on_rank(ctx, entry: DataProto) -> None:
    """A new shape: every raw-bytes strategy (the floor) packs and sizes its buffer for it, as
    a broadcast job's ranks do between rounds (``harness.job.broadcast.BroadcastJob.use``)."""
    for strategy in ctx.cache["dispatch"].values():
        if getattr(strategy, "raw_bytes", False):
            strategy.prepare(on_device(entry, strategy.groups.device))


def _leader_call(ctx, name: str, data, verify: bool):
    """The leader got its chunk (or the flat array) through Ray, the others only meta_info;
    then all run the strategy. Returns (end time in ns, what verification needs)."""
    strategy = ctx.cache["dispatch"][name]
    device = strategy.groups.device
    if name == "floor":
        if isinstance(data, np.ndarray):
            strategy.sent = _tensor(data).to(device)
        strategy.get_data_input(DataProto(None, {}, {}))
        end = time.time_ns()
        return end, (tensor_digest(strategy.received) if verify else None)
    entry = on_device(data, device) if isinstance(data, DataProto) else DataProto(None, {}, data)
    out = strategy.get_data_input(entry)
    end = time.time_ns()
    return end, ((digest(out, True), out.meta_info) if verify else None)


def _all_ranks_call(ctx, data, verify: bool):
    """Every rank got the replica's object through Ray itself (the object store, a lent ref,
    a compiled graph's channel): nothing left to do but keep it. The floor's flat bytes come
    as an array, or as a tensor where they were lent."""
    if isinstance(data, (np.ndarray, torch.Tensor)):
        end = time.time_ns()
        flat = _tensor(data) if isinstance(data, np.ndarray) else data
        return end, (tensor_digest(flat) if verify else None)
    data = on_device(data, ctx.device)
    end = time.time_ns()
    return end, ((digest(data, True), data.meta_info) if verify else None)


def rdt_lend(ctx, data):
    """The replica leader's answer to lend (``rdt``): the chunk as Ray handed it, the floor's
    flat array as one tensor (Ray Direct Transport moves torch tensors only)."""
    return _tensor(data) if isinstance(data, np.ndarray) else data


def cgraph_give(ctx, data):
    """The replica leader's node of the compiled graph: its chunk, as the input channel handed
    it, on to its replica's ranks through its output channel."""
    return data


# -- on the driver -------------------------------------------------------------------------
class CompiledDispatch:
    """``cgraph``'s Ray Compiled Graph over a world's ranks, for one layout: the input is every
    replica's chunk, then whether to check; each replica leader's actor passes its chunk on and
    every rank of the replica (the leader too) takes it. Compiled once per job, torn down when
    the job ends (``close``), so the actors' other tasks (every other mode) run beside it."""

    def __init__(self, world, drv: _Driver) -> None:
        from ray.dag import InputNode, MultiOutputNode

        dp = len(drv.flats)
        with InputNode() as inp:
            lent = [world.actors[drv.leaders[d]].call.bind(cgraph_give, inp[d]) for d in range(dp)]
            takes = [
                actor.call.bind(_all_ranks_call, lent[drv.replica_of[r]], inp[dp])
                for r, actor in enumerate(world.actors)
            ]
            dag = MultiOutputNode(takes)
        self.graph = dag.experimental_compile()

    def __call__(self, chunks: list, verify: bool, what: str, timeout_s: float) -> list:
        """Every rank's answer to one execution, in rank order."""
        import ray

        try:
            return ray.get(self.graph.execute(*chunks, verify), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorldError(
                f"{what}: the compiled graph gave no answer within {timeout_s:.0f} s"
            ) from None

    def close(self) -> None:
        try:
            self.graph.teardown()
        except Exception:  # a failed job's ranks are gone, and the graph's loops with them
            pass
        # Now, while the world is up: collected later, the graph's own teardown would call
        # Ray after the world closed.
        self.graph = None
        gc.collect()


def _call(world, drv: _Driver, mode: DispatchMode, verify: bool, what: str, timeout_s: float,
          graph: CompiledDispatch | None = None):  # fmt: skip
    """One timed dispatch: chunk, put, hand out, wait for every rank's end time; (seconds, every
    rank's answer). ``cgraph``'s chunks go into ``graph``'s input instead of a put."""
    import ray

    meta = drv.global_batch.meta_info
    t0 = time.time_ns()
    objs = drv.flats if mode.raw else chunk(drv.global_batch, drv.rows)
    if mode.kind == CGRAPH:
        out = graph(objs, verify, what, timeout_s)
        return (max(end for end, _ in out) - t0) / 1e9, out
    refs = [ray.put(o) for o in objs]
    if mode.kind == LEADER:
        fn = _leader_call
        args = [
            (mode.strategy, refs[d] if drv.is_leader(r) else meta, verify)
            for r, d in enumerate(drv.replica_of)
        ]
    elif mode.kind == ALL_RANKS:
        fn = _all_ranks_call
        args = [(refs[d], verify) for d in drv.replica_of]
    elif mode.kind == RDT:
        fn = _all_ranks_call
        lent = [world.lend(drv.leaders[d], rdt_lend, ref) for d, ref in enumerate(refs)]
        args = [(lent[d], verify) for d in drv.replica_of]
    else:
        fn, sources = hops_call, drv.sources[mode.kind]
        args = [
            (mode.kind, refs[d] if r in sources else None, mode.raw, drv.flats[d].nbytes, verify)
            for r, d in enumerate(drv.replica_of)
        ]
    out = world.collect(world.submit(fn, args), what, timeout_s)
    # The ranks' end times and the driver's start read one clock: actors on one machine, and
    # ranks in network namespaces of one kernel, share CLOCK_REALTIME. Ranks on separate
    # machines would need synchronized clocks for this subtraction to mean anything.
    return (max(end for end, _ in out) - t0) / 1e9, out


def _setup(world, drv: _Driver) -> tuple[list[DispatchMode], dict[str, str]]:
    args = [(drv.spec, entry) for entry in drv.hand_out()]
    out = world.collect(world.submit(_setup_on_rank, args), "setting up dispatch")
    for r, answer in enumerate(out):
        if answer["is_leader"] != drv.is_leader(r):
            raise WorldError(
                f"rank {r}: megatron-core's groups make it {'a' if answer['is_leader'] else 'no'} "
                f"replica leader, but the layout maths ({drv.spec.layout.describe()}) does not"
            )
    _check_stages(drv, [answer["stage"] for answer in out])
    refused = out[0]["refused"]
    modes = [m for m in drv.spec.dispatch_modes() if m.strategy not in refused]
    return modes, refused


def _check_stages(drv: _Driver, stages: list[dict]) -> None:
    """The ranks the driver hands an ``edge_stages`` chunk to (layout maths) are the ones whose
    megatron-core groups make them TP×CP rank 0 of the first or last stage, so the hops run
    from the ranks that hold the chunk."""
    last = drv.spec.layout.pp - 1
    for r, stage in enumerate(stages):
        source = stage["pp"] in (0, last) and stage["tp_cp"] == 0
        if source != (r in drv.sources[EDGE_STAGES]):
            raise WorldError(
                f"rank {r}: megatron-core's groups put it on stage {stage['pp']} at TP×CP index "
                f"{stage['tp_cp']}, but the layout maths ({drv.spec.layout.describe()}) "
                f"{'does not hand' if source else 'hands'} it the edge_stages chunk"
            )


def _verify(drv: _Driver, mode: DispatchMode, out: list) -> list[str]:
    """Every rank's result against its replica's chunk, bit for bit, naming rank and key (the
    comparison every job makes: ``harness.job.verification``). Unflagged non-tensor data stays
    with a leader dispatch's leader; every rank of an all_ranks dispatch gets the chunk, and the
    hop modes pickle the whole chunk. A rank that must hold nothing (an ``edge_stages`` middle
    stage) is checked to hold nothing."""
    problems = []
    flagged = bool(drv.global_batch.broadcast_non_tensor)
    holders = drv.holders.get(mode.kind)
    for rank, (_, got) in enumerate(out):
        d = drv.replica_of[rank]
        if holders is not None and (rank in holders) != (got is not None):
            problems.append(
                f"{mode.name}: rank {rank}: holds no chunk, expected chunk {d}"
                if rank in holders
                else f"{mode.name}: rank {rank}: holds data, but a middle pipeline stage gets none"
            )
            continue
        if got is None:
            continue  # a middle stage, rightly empty
        if mode.raw:
            problems += bytes_problems(mode.name, rank, drv.expected_raw[d], got, f"chunk {d}")
            continue
        got_digest, meta = got
        problems += batch_problems(
            mode.name, rank, drv.expected[d], got_digest,
            meta_changed=meta != drv.global_batch.meta_info,
            non_tensor_sent=flagged or mode.kind != LEADER,
            receiver=mode.kind == LEADER and not drv.is_leader(rank),
        )  # fmt: skip
    return problems


@dataclass
class DriverContext:
    """The driver's side of a rank context, for the phases it runs: it is rank 0 of the job
    (it reads the links), and the phase it last reported names what a call that never ends
    was doing."""

    link_counter: object = None
    """The emulated cluster's link counter (``harness.worlds.emulated.link_counter``), or None."""
    phase: str = "dispatch"
    rank: int = 0

    def report(self, phase: str) -> None:
        self.phase = phase


@dataclass
class DispatchJob:
    """The dispatch scope's ``harness.job.phase_base.Job``: one call is one dispatch of the global
    batch to every rank of every replica, timed on the driver."""

    world: object
    drivers: dict
    """CallShape -> its ``_Driver``, every one built before anything is timed."""
    modes: dict[str, DispatchMode]
    ctx: DriverContext
    timeout_s: float
    current: object = None
    graph: CompiledDispatch | None = None
    """``cgraph``'s compiled graph, where the job times it."""
    scope = Scope.DISPATCH

    @property
    def order(self) -> list[str]:
        return list(self.modes)

    @property
    def drv(self) -> _Driver:
        return self.drivers[self.current]

    def use(self, shape) -> None:
        """Make ``shape``'s global batch the one calls dispatch; the ranks' floor sizes its
        buffer for it (untimed, between rounds)."""
        if shape == self.current:
            return
        self.current = shape
        if any(m.raw and m.kind == LEADER for m in self.modes.values()):
            what = f"{self.ctx.phase} (preparing the floor for a new shape)"
            handles = self.world.submit(_prepare_raw_on_rank, [(e,) for e in self.drv.hand_out()])
            self.world.collect(handles, what, self.timeout_s)

    def _dispatch(self, name: str, verify: bool):
        what = f"{self.ctx.phase} (dispatch {name})"
        return _call(
            self.world, self.drv, self.modes[name], verify, what, self.timeout_s, self.graph
        )

    def call(self, name: str):
        return self._dispatch(name, False)[1]

    def timed(
        self, name: str, check: bool = False, during: AbstractContextManager | None = None
    ) -> Timing:
        """One dispatch on the driver's clock (the ranks' CPU is not the driver's to read). A
        dispatch's check travels inside the call (each rank's fingerprint comes back with its
        chunk), so a dispatch job checks in calls of its own (``Verification``), never here."""
        if check:
            raise ValueError("a dispatch job checks its calls in the Verification phase")
        with during or nullcontext():
            return Timing(self._dispatch(name, False)[0])

    def fence(self) -> None:
        """Nothing: a dispatch returns when every rank has its chunk."""

    def verify(self, name: str, during: AbstractContextManager | None = None) -> list[str]:
        with during or nullcontext():
            out = self._dispatch(name, True)[1]
        return _verify(self.drv, self.modes[name], out)


def run_dispatch(world, spec: JobSpec) -> RankResult:
    """A dispatch job on ``world`` (a started RayWorld): every phase of its scope on the driver,
    the modes interleaved, each round in its own order, each rank verified; the driver's result
    (``unsupported`` set when the mode under test's strategy refused the layout).
    ``spec.timeout_s`` bounds one dispatch call."""
    timeout_s = spec.timeout_s
    spec.layout.check_world(world.world_size)
    shapes = spec.distinct_shapes()
    drivers = {shape: _Driver.build(spec, shape) for shape in shapes}
    modes, refused = _setup(world, drivers[shapes[0]])
    mine = DispatchMode.parse(spec.under_test)
    if mine.strategy in refused:
        return RankResult(0, True, unsupported=f"{spec.under_test}: {refused[mine.strategy]}")
    ctx = DriverContext(link_counter=link_counter())
    job = DispatchJob(world, drivers, {m.name: m for m in modes}, ctx, timeout_s, shapes[0])
    if any(m.kind == CGRAPH for m in modes):
        job.graph = CompiledDispatch(world, drivers[shapes[0]])
    result = RankResult(
        rank=0,
        is_leader=True,
        device=spec.device,
        payload_bytes=drivers[shapes[0]].payload_bytes,
        shape_bytes=[drivers[s].payload_bytes for s in shapes],
        refused=refused,
    )
    try:
        return run_phases(ctx, spec, job, result)
    finally:
        if job.graph is not None:
            job.graph.close()
