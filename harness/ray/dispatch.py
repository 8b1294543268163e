"""Dispatch inside the measured path: from "the driver holds the global batch" to "every rank of
every replica holds its chunk", on a Ray world (``harness.ray.actors``).

Modes (``scope = "dispatch+broadcast"``; the forked world's jobs are ``"broadcast"``):

- ``leader:<strategy>`` (ROLL, NeMo-RL's leader-broadcast): the driver chunks the global batch by
  DP, ``ray.put``s each chunk and passes the ref to that replica's leader actor; every other rank
  gets ``DataProto(batch=None, meta_info)``; then all ranks run the broadcast strategy.
- ``leader:floor``, the raw floor of that path: the same bytes as one flat uint8 array put to the
  leader, then the ``floor`` strategy's one raw broadcast.
- ``all_ranks`` (verl, NeMo-RL by default, OpenRLHF): one ``ray.put`` per DP chunk; every rank of
  the replica gets the same ObjectRef and deserializes it. No collective.
- ``all_ranks:raw``, its floor: one put of the flat array per replica, every rank gets it.

Chunking and the put are inside the time. Every iteration ends at the latest rank-side end
time; each rank's result is checked bit for bit (``harness.run.verify``) after the timed calls.

``bcastbench ray-dispatch`` (``harness.commands.ray_dispatch``) times these modes side by side;
``bcastbench run`` with ``ray.dispatch=`` runs one of them as a job (``harness.run.launch``).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

import strategies
from harness.cluster.emulated import link_counter
from harness.ray.modes import ALL_RANKS, FLOORS, LEADER, Mode
from harness.run import payloads
from harness.run.forked import WorldError
from harness.run.records import vs_floor
from harness.run.rounds import Scope, interleaved, timing_stats, verdict
from harness.run.verify import compare, digest, tensor_digest
from strategies import DataProto
from strategies.core.layout import Layout
from strategies.floor import raw_parts


@dataclass(frozen=True)
class DispatchSpec:
    """One dispatch job: which modes, on which layout, with which batch (picklable)."""

    layout: Layout
    modes: tuple[str, ...] = ("leader:header", ALL_RANKS)
    """Modes to compare; each family's floor is added when missing."""
    payload: str = "rl_rollout"
    batch_size: int = 8
    """Rows per DP replica; the driver's global batch has ``batch_size * dp`` rows."""
    seq_len: int = 1024
    broadcast_non_tensor: bool | None = None
    seed: int = 0
    iters: int = 10
    warmup: int = 2
    timeout_s: float = 120.0
    link_bytes_calls: int = 0
    """Emulated clusters: untimed calls per mode whose node-link bytes are counted; 0 skips."""
    options: dict = field(default_factory=dict)
    """Options of every leader mode's strategy (as ``strategies.get(name, groups, **options)``)."""

    def parsed_modes(self) -> list[Mode]:
        modes = [Mode.parse(m) for m in self.modes]
        for kind in (LEADER, ALL_RANKS):
            if any(m.kind == kind for m in modes) and FLOORS[kind] not in [m.name for m in modes]:
                modes.append(Mode.parse(FLOORS[kind]))
        names = [m.name for m in modes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"dispatch modes {dupes} named more than once")
        return modes


# -- the driver's data -----------------------------------------------------------------------
def chunk(batch: DataProto, dp: int) -> list[DataProto]:
    """Split the global batch into ``dp`` equal row blocks, each owning its bytes.

    A row slice is a view, and pickling a view ships its whole storage (every replica would
    receive the global batch), so each chunk is copied out once, as verl consolidates before
    pickling."""
    rows = int(batch.batch.batch_size[0])
    if rows % dp:
        raise ValueError(f"global batch of {rows} rows does not split into dp={dp} chunks")
    b = rows // dp
    return [
        DataProto(
            batch.batch[i * b : (i + 1) * b].clone(),
            {k: v[i * b : (i + 1) * b].copy() for k, v in batch.non_tensor_batch.items()},
            batch.meta_info,
        )
        for i in range(dp)
    ]


def flat_bytes(chunk_: DataProto) -> np.ndarray:
    """The floor's bytes of one chunk as one array (``strategies.floor.raw_parts``: exactly
    what the floor's receivers are sized for)."""
    parts = raw_parts(chunk_)
    return torch.cat(parts).numpy() if parts else np.empty(0, dtype=np.uint8)


@dataclass
class _Driver:
    """What the driver holds for a job: the global batch, who leads which replica, and what
    each replica must end with."""

    spec: DispatchSpec
    global_batch: DataProto
    replica_of: list[int]
    leaders: list[int]
    flats: list[np.ndarray]
    expected: list[dict]
    expected_raw: list[str]

    @classmethod
    def build(cls, spec: DispatchSpec) -> _Driver:
        lay = spec.layout
        batch = payloads.make(
            spec.payload,
            spec.batch_size * lay.dp,
            spec.seq_len,
            spec.seed,
            spec.broadcast_non_tensor,
        )
        chunks = chunk(batch, lay.dp)
        flats = [flat_bytes(c) for c in chunks]
        replica_of = [lay.coords(r)["dp"] for r in range(lay.world_size)]
        leaders = [0] * lay.dp
        for g in lay.replica_groups():
            leaders[replica_of[g[0]]] = g[0]
        return cls(
            spec,
            batch,
            replica_of,
            leaders,
            flats,
            [digest(c, True) for c in chunks],
            [tensor_digest(torch.from_numpy(f)) for f in flats],
        )

    def is_leader(self, rank: int) -> bool:
        return self.leaders[self.replica_of[rank]] == rank


# -- on the ranks --------------------------------------------------------------------------
def _tensor(arr: np.ndarray) -> torch.Tensor:
    """A tensor over an array Ray handed out read-only (zero-copy from the object store);
    nothing here writes to it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(arr)


def _on_device(dp: DataProto, device: torch.device) -> DataProto:
    if device.type != "cpu" and dp.batch is not None:
        dp.batch = dp.batch.to(device)
    return dp


def _setup_on_rank(ctx, spec: DispatchSpec, entry: DataProto) -> dict:
    """Build the groups and every leader mode's strategy, prepared on this rank's entry state
    (the floor packs its buffer here). A refusal is raised on every rank before any collective,
    so refused strategies are reported, not fatal."""
    groups = ctx.groups_for(spec.layout)
    built, refused = {}, {}
    names = sorted({m.strategy for m in spec.parsed_modes() if m.kind == LEADER})
    for name in names:
        try:
            built[name] = strategies.get(name, groups, **({} if name == "floor" else spec.options))
        except strategies.Unsupported as exc:
            refused[name] = str(exc)
            continue
        built[name].prepare(_on_device(entry, groups.device))
    ctx.cache["dispatch"] = built
    return {"is_leader": groups.is_leader, "refused": refused}


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
    entry = _on_device(data, device) if isinstance(data, DataProto) else DataProto(None, {}, data)
    out = strategy.get_data_input(entry)
    end = time.time_ns()
    return end, ((digest(out, True), out.meta_info) if verify else None)


def _all_ranks_call(ctx, data, verify: bool):
    """Every rank got the replica's object through Ray itself: nothing left to do but keep it."""
    if isinstance(data, np.ndarray):
        end = time.time_ns()
        return end, (tensor_digest(_tensor(data)) if verify else None)
    data = _on_device(data, ctx.device)
    end = time.time_ns()
    return end, ((digest(data, True), data.meta_info) if verify else None)


# -- on the driver -------------------------------------------------------------------------
def _call(world, drv: _Driver, mode: Mode, verify: bool) -> tuple[float, list]:
    """One timed dispatch: chunk, put, hand out, wait for every rank's end time."""
    import ray

    lay = drv.spec.layout
    meta = drv.global_batch.meta_info
    t0 = time.time_ns()
    objs = drv.flats if mode.raw else chunk(drv.global_batch, lay.dp)
    refs = [ray.put(o) for o in objs]
    if mode.kind == LEADER:
        fn = _leader_call
        args = [
            (mode.strategy, refs[d] if drv.is_leader(r) else meta, verify)
            for r, d in enumerate(drv.replica_of)
        ]
    else:
        fn = _all_ranks_call
        args = [(refs[d], verify) for d in drv.replica_of]
    out = world.collect(world.submit(fn, args), f"dispatch {mode.name}", drv.spec.timeout_s)
    # The ranks' end times and the driver's start read one clock: actors on one machine, and
    # ranks in network namespaces of one kernel, share CLOCK_REALTIME. Ranks on separate
    # machines would need synchronized clocks for this subtraction to mean anything.
    return (max(end for end, _ in out) - t0) / 1e9, out


def _setup(world, drv: _Driver) -> tuple[list[Mode], dict[str, str]]:
    import ray

    meta = drv.global_batch.meta_info
    chunks = chunk(drv.global_batch, drv.spec.layout.dp)
    args = [
        (drv.spec, ray.put(chunks[d]) if drv.is_leader(r) else DataProto(None, {}, meta))
        for r, d in enumerate(drv.replica_of)
    ]
    out = world.collect(world.submit(_setup_on_rank, args), "setting up dispatch")
    for r, answer in enumerate(out):
        if answer["is_leader"] != drv.is_leader(r):
            raise WorldError(
                f"rank {r}: megatron-core's groups make it {'a' if answer['is_leader'] else 'no'} "
                f"replica leader, but the layout maths ({drv.spec.layout.describe()}) does not"
            )
    refused = out[0]["refused"]
    modes = [m for m in drv.spec.parsed_modes() if m.strategy not in refused]
    return modes, refused


def _verify(drv: _Driver, mode: Mode, out: list) -> list[str]:
    """Every rank's result against its replica's chunk, bit for bit, naming rank and key."""
    problems = []
    flagged = drv.global_batch.broadcast_non_tensor
    for rank, (_, got) in enumerate(out):
        d = drv.replica_of[rank]
        if mode.raw:
            if got != drv.expected_raw[d]:
                problems.append(f"{mode.name}: rank {rank}: received bytes differ from chunk {d}")
            continue
        got_digest, meta = got
        expected = drv.expected[d]
        if mode.kind == LEADER and not flagged and not drv.is_leader(rank):
            expected = dict(expected, non_tensor={})  # unflagged non-tensor data stays put
        if meta != drv.global_batch.meta_info:
            problems.append(f"{mode.name}: rank {rank}: meta_info changed")
        problems += compare(expected, got_digest, rank, mode.name)
    return problems


def _link_bytes(world, drv: _Driver, modes: list[Mode]) -> dict[str, float]:
    """Node-link bytes per call of each mode on an emulated cluster (untimed back-to-back
    calls between two reads of the links' counters); {} elsewhere."""
    read = link_counter()
    if read is None or drv.spec.link_bytes_calls <= 0:
        return {}
    out = {}
    for mode in modes:
        before = read()
        for _ in range(drv.spec.link_bytes_calls):
            _call(world, drv, mode, False)
        out[mode.name] = (read() - before) / drv.spec.link_bytes_calls
    return out


def run_dispatch(world, spec: DispatchSpec) -> dict:
    """Time every mode of ``spec`` on ``world`` (a started RayWorld), interleaved A, B, A, B
    with the first mode rotating; verify each rank; return the job's record."""
    spec.layout.check_world(world.world_size)
    drv = _Driver.build(spec)
    modes, refused = _setup(world, drv)
    by_name = {m.name: m for m in modes}

    def call(name: str, it: int, timed: bool) -> float | None:
        seconds = _call(world, drv, by_name[name], False)[0]
        return seconds if timed else None

    times = interleaved(list(by_name), spec.warmup, spec.iters, call)
    link = _link_bytes(world, drv, modes)
    problems = []
    for mode in modes:
        problems += _verify(drv, mode, _call(world, drv, mode, True)[1])
    verdict(problems)
    return _record(spec, drv, modes, times, link, refused)


def _record(spec, drv, modes, times, link, refused) -> dict:
    rows = {}
    for mode in modes:
        rows[mode.name] = {
            "mode": mode.name,
            "kind": mode.kind,
            "strategy": mode.strategy,
            "raw": mode.raw,
            "floor_mode": FLOORS[mode.kind],
            **timing_stats(times[mode.name]),
            "times_s": times[mode.name],
        }
        if mode.name in link:
            rows[mode.name]["cross_node_bytes_per_call"] = link[mode.name]
    floors = {f: rows[f]["p50_us"] for f in FLOORS.values() if f in rows}
    for row in rows.values():
        row["vs_floor"] = vs_floor(row["p50_us"], floors[row["floor_mode"]])
        row["vs_floors"] = {f: row["p50_us"] / p50 for f, p50 in floors.items()}
    lay = spec.layout
    return {
        "scope": Scope.DISPATCH.value,
        "world": "ray",
        "layout": lay.describe(),
        **{axis: getattr(lay, axis) for axis in ("dp", "pp", "tp", "cp", "order")},
        "world_size": lay.world_size,
        "payload": spec.payload,
        "batch_size": spec.batch_size,
        "seq_len": spec.seq_len,
        "payload_bytes": int(drv.flats[0].nbytes),
        "iters": spec.iters,
        "warmup": spec.warmup,
        "modes": rows,
        "unsupported": refused,
        "correct": True,
    }
