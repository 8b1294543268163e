"""One job on one rank: build groups, make the payload, warm up, time interleaved calls,
count collectives, measure peak memory and verify every rank bit for bit.

``run_job_on_rank`` runs identically in a forked world (``harness.run.forked``) and in a joined one
(``harness.run.launch``): prepare, timed rounds, measurements, verification. ``summarize`` turns
all ranks' results into one record's measured fields (latency per iteration = max over ranks).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

import strategies
from harness.run import payloads
from harness.run.rounds import interleaved, p50_us, timing_stats, verdict
from harness.run.verify import compare, digest, tensor_digest
from harness.run.workload import CallShape, Workload, constant
from strategies.core.layout import Layout
from strategies.core.trace import Recorder
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
    """payload=file | schema: the most bytes a leader's batch may take (None: the default)."""
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
    through the rank context's ``link_counter`` hook (``harness.cluster.emulated``); 0, or a
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
    """The shapes the calls cycle through (``harness.run.workload``); None: every call moves
    ``batch_size`` rows on every replica leader."""
    steady_iters: int = 0
    """A varying workload: after the sequence, this many interleaved rounds of each distinct
    shape alone (after one untimed round of it), for each shape's steady-state p50."""

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


def _fault(spec: JobSpec, rank: int, it: int) -> None:
    if rank == spec.fault_rank and it == spec.fault_at_iter:
        if spec.fault_kind == "crash":
            os._exit(17)
        while True:  # hang: never return, never answer
            time.sleep(3600)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_peak_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) for this process
        return True
    except OSError:
        return False


def _release_free_heap(full: bool = True) -> bool:
    """Hand the heap's free pages back to the kernel (glibc ``malloc_trim``), so that what the
    next call allocates has to fault in fresh pages and shows up in VmHWM. Without it the
    earlier rounds' freed buffers stay resident, the call reuses them and its high-water growth
    reads 0 whatever it allocates. False where there is no glibc to ask.

    Objects in reference cycles hold memory until the collector runs: ``full`` collects every
    generation (a tenth of a second or more in a rank that imported torch and megatron-core,
    so once per job); otherwise only the young ones, where one call's cycles are."""
    import ctypes
    import gc

    gc.collect(2 if full else 1)
    try:
        # The process's own symbols: glibc's malloc_trim where the C library is glibc.
        ctypes.CDLL(None).malloc_trim(0)  # 0: keep no padding at the top of the heap
        return True
    except (OSError, AttributeError):
        return False


def _rss_peak() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def leader_batch(
    spec: JobSpec, groups, layout: Layout, shape: CallShape | None = None
) -> strategies.DataProto | None:
    """The replica leader's DataProto for one shape (the period's first by default): different,
    seeded data per replica and per draw, on the device."""
    if not groups.is_leader:
        return None
    shape = shape or spec.period()[0]
    replica = layout.coords(groups.rank)["dp"]
    dp = payloads.make(
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

    def call(self, name: str):
        """One call of ``name`` from the entry state ROLL's dispatcher leaves."""
        return self.built[name].get_data_input(self.full.entry_state(self.groups.is_leader))

    def use(self, shape: CallShape) -> None:
        """Make ``shape``'s batch the one calls move. A raw-bytes strategy (the floor) moves
        an already packed buffer, so it packs the new one here, untimed, on every rank; every
        other strategy sees only the batch it is handed, as in a real step."""
        if shape == self.current:
            return
        self.full, self.current = self.batches[shape], shape
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
            options.update(Floor.variants(spec.layout))
        elif name != spec.strategy:
            options[name] = {}
    return list(options), options


def timed_rounds(ctx, spec: JobSpec, job: Prepared) -> dict[str, list[float]]:
    """Warm-up rounds, then timed rounds that interleave every strategy, who goes first
    rotating (``harness.run.rounds.interleaved``), every call starting from ``start_line``;
    each rank times itself (seconds per call). Round c moves the workload's call c (warm-up
    rounds count first), the same shape for every strategy of the round, so the floor and
    pickled are timed shape by shape beside it."""

    def call(name: str, it: int, timed: bool) -> float | None:
        if not timed:
            return _untimed_call(ctx, job, name, f"warm-up {it + spec.warmup}")
        ctx.report(f"timed iteration {it} of {name}")
        if name == spec.strategy:
            _fault(spec, ctx.rank, it)
        return _timed_call(job, name)

    def round_start(c: int, timed: bool) -> None:
        job.use(spec.shape_of_call(c))

    return interleaved(job.order, spec.warmup, spec.iters, call, round_start)


def steady_rounds(ctx, spec: JobSpec, job: Prepared) -> dict[str, list[list[float]]]:
    """A varying workload's steady state: each distinct shape alone, one untimed round (the
    call after a change of shape is the sequence's cost, not the steady one) then
    ``steady_iters`` timed rounds; seconds per call, by strategy then shape."""
    if spec.workload is None or not spec.workload.varying or spec.steady_iters < 1:
        return {}
    out: dict[str, list[list[float]]] = {name: [] for name in job.order}
    for k, shape in enumerate(spec.distinct_shapes()):
        job.use(shape)

        def call(name: str, it: int, timed: bool, k: int = k) -> float | None:
            if not timed:
                return _untimed_call(ctx, job, name, f"steady warm-up of shape {k}")
            ctx.report(f"steady iteration {it} of shape {k} of {name}")
            return _timed_call(job, name)

        for name, seconds in interleaved(job.order, 1, spec.steady_iters, call).items():
            out[name].append(seconds)
    return out


def _untimed_call(ctx, job: Prepared, name: str, what: str) -> None:
    ctx.report(f"{what} of {name}")
    dist.barrier()
    job.call(name)
    _sync(job.groups.device)


def _timed_call(job: Prepared, name: str) -> float:
    """One call of ``name`` timed on this rank from ``start_line``, in seconds."""
    entry = job.full.entry_state(job.groups.is_leader)
    start_line(job.groups)
    t0 = time.perf_counter()
    job.built[name].get_data_input(entry)
    _sync(job.groups.device)
    return time.perf_counter() - t0


def start_line(groups) -> None:
    """Where every timed call starts: a barrier over the world (replicas start together),
    then one over the replica's own group (the ranks the call moves data between).

    On gloo the group used last answers its next collective faster than a group that sat idle
    while another one worked: with only the world barrier, the floor's broadcast over the
    replica group was slower than the same broadcast in a bare world (which barriers and
    broadcasts on one group), and not once a replica-group barrier came last
    (``tests/benchmarks/test_bench_bare.py`` holds the harness to the bare world). A call that
    starts on a smaller group (header's TPxCP hop) still starts on a group the barrier did not touch, as it
    would in a real step."""
    dist.barrier()
    if len(groups.replica_ranks) > 1:
        dist.barrier(group=groups.cpu_replica_group)


def measurements(ctx, job: Prepared) -> dict[str, dict]:
    """Untimed: one recorded call per strategy (collectives, local work), one for peak memory."""
    device = job.groups.device
    out: dict[str, dict] = {
        k: {} for k in ("collectives", "work", "peak_rss_bytes", "peak_rss_delta_bytes")
    }
    out["peak_cuda_bytes"] = {}
    for name in job.order:
        ctx.report(f"counting collectives of {name}")
        dist.barrier()
        with Recorder() as rec:
            job.call(name)
        # None: the recorder could not see every path to a collective (rec.unavailable says
        # why), so no count is reported rather than a short one.
        out["collectives"][name] = (
            None if rec.unavailable else [(c.kind, c.ranks, c.root, c.nbytes) for c in rec.comms]
        )
        out.setdefault("collectives_unavailable", {})[name] = rec.unavailable
        out["work"][name] = dict(rec.work)
        ctx.report(f"measuring peak memory of {name}")
        dist.barrier()
        released = _release_free_heap(full=name == job.order[0])
        base = _rss_now()
        honest = _rss_peak_reset() and released
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            cuda_base = torch.cuda.memory_allocated(device)
        job.call(name)
        _sync(device)
        peak = _rss_peak()  # VmHWM since the reset: this call's high-water mark
        out["peak_rss_bytes"][name] = peak
        # None where VmHWM could not be reset or the free heap not released: the growth would
        # then be the process's lifetime peak or the reused pages' 0, neither this call's.
        out["peak_rss_delta_bytes"][name] = max(0, peak - base) if honest else None
        out["peak_cuda_bytes"][name] = (
            torch.cuda.max_memory_allocated(device) - cuda_base if device.type == "cuda" else 0
        )
    return out


def verification(ctx, spec: JobSpec, job: Prepared) -> dict[str, list[str]]:
    """Calls of every strategy compared bit for bit with the leader's batch: one per shape of
    the period, in the workload's order (so a small call after a large one is checked too)."""
    groups = job.groups
    problems: dict[str, list[str]] = {name: [] for name in job.order}
    for k, shape in enumerate(spec.period()):
        job.use(shape)
        leader_digest = digest(job.full, True) if groups.is_leader else None
        for name in job.order:
            ctx.report(f"verifying {name}" + (f" on call {k} of the period" if k else ""))
            dist.barrier()
            out = job.call(name)
            found = _verify(name, job.built[name], out, leader_digest, groups, job.full)
            problems[name] += [f"{p} (call {k} of the period)" if k else p for p in found]
    return problems


def run_job_on_rank(ctx, spec: JobSpec) -> dict:
    """The rank-side job: prepare, timed rounds, (steady rounds,) (link bytes,) measurements
    (on the period's first shape), verification."""
    job = prepare(ctx, spec)
    if isinstance(job, dict):
        return job
    times = timed_rounds(ctx, spec, job)
    steady = steady_rounds(ctx, spec, job)
    job.use(spec.period()[0])
    # A hook only contexts on an emulated cluster carry (other contexts may lack the field).
    counter = getattr(ctx, "link_counter", None)
    link_bytes = (
        _link_bytes_phase(ctx, spec, job, counter)
        if counter is not None and spec.link_bytes_calls > 0
        else {}
    )
    leader = job.groups.is_leader
    return {
        "rank": ctx.rank,
        "is_leader": leader,
        "times_s": times,
        **({"steady_s": steady} if steady else {}),
        **measurements(ctx, job),
        "problems": verification(ctx, spec, job),
        "choices": {n: s.choice for n, s in job.built.items() if hasattr(s, "choice")},
        "payload_bytes": _payload_bytes(job.batches[spec.period()[0]]) if leader else None,
        "shape_bytes": [_payload_bytes(job.batches[s]) for s in spec.distinct_shapes()]
        if leader
        else None,
        "device": str(job.groups.device),
        **({"link_bytes_per_call": link_bytes} if link_bytes else {}),
    }


def _link_bytes_phase(ctx, spec: JobSpec, job: Prepared, counter) -> dict[str, float]:
    """Node-link bytes per call of each strategy, on an emulated cluster: rank 0 reads the links'
    counters (``counter``, the context's hook) around ``link_bytes_calls`` back-to-back calls of
    one strategy. Barriers fence the window so only that strategy's traffic (and one barrier's
    few hundred bytes) is counted."""
    read = counter if ctx.rank == 0 else None
    out: dict[str, float] = {}
    for name in job.order:
        ctx.report(f"counting link bytes of {name}")
        dist.barrier()
        before = read() if read is not None else 0
        dist.barrier()
        for _ in range(spec.link_bytes_calls):
            job.call(name)
        dist.barrier()
        if read is not None:
            out[name] = (read() - before) / spec.link_bytes_calls
    return out


def _payload_bytes(full) -> int:
    """What the floor sends (``strategies.floor.raw_parts``)."""
    return sum(p.numel() for p in raw_parts(full))


def _rss_now() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _verify(name, strategy, out, leader_digest, groups, full) -> list[str]:
    """Compare this rank's result with the leader's; floor compares its raw buffer."""
    if name.split(":")[0] == "floor":
        sent = [tensor_digest(strategy.sent) if groups.is_leader else None]
        dist.broadcast_object_list(sent, src=groups.leader, group=groups.cpu_replica_group)
        got = tensor_digest(strategy.received)
        return [] if got == sent[0] else [f"{name}: rank {groups.rank}: received bytes differ"]
    expected = [leader_digest]
    dist.broadcast_object_list(expected, src=groups.leader, group=groups.cpu_replica_group)
    expected = expected[0]
    with_nt = bool(full.broadcast_non_tensor)
    got = digest(out, with_nt)
    if not with_nt:
        expected = dict(expected, non_tensor=None)
        got = dict(got, non_tensor=None)
        if not groups.is_leader and out.non_tensor_batch:
            return [f"{name}: rank {groups.rank}: non_tensor_batch arrived although not flagged"]
    if out.meta_info != full.meta_info:
        return [f"{name}: rank {groups.rank}: meta_info changed"]
    return compare(expected, got, groups.rank, name)


def summarize(spec: JobSpec, rank_results: list[dict]) -> dict:
    """Fold all ranks' results into one record's measured fields (max over ranks per iter)."""
    refused = [r["unsupported"] for r in rank_results if "unsupported" in r]
    if refused:
        return {"unsupported": refused[0]}
    verdict([p for r in rank_results for lst in r["problems"].values() for p in lst])
    leaders = [r for r in rank_results if r["is_leader"]]
    payload_bytes = leaders[0]["payload_bytes"]
    link_bytes = next(
        (r["link_bytes_per_call"] for r in rank_results if "link_bytes_per_call" in r), {}
    )
    per_strategy = {}
    for name in rank_results[0]["times_s"]:
        t = np.array([r["times_s"][name] for r in rank_results])  # ranks × iters
        per_iter = t.max(axis=0)
        skew = t.max(axis=0) - t.min(axis=0)
        per_strategy[name] = {
            **timing_stats(per_iter),
            "rank_skew_us": float(np.median(skew)) * 1e6,
            **_collective_counts(name, rank_results, leaders[0]),
            "peak_rss_bytes": max(r["peak_rss_bytes"][name] for r in rank_results),
            "peak_rss_delta_bytes": _max_or_none(
                r["peak_rss_delta_bytes"][name] for r in rank_results
            ),
            # Says a reader that this growth was measured on fresh pages (records before the
            # free heap was released read 0 whenever a call reused freed pages).
            "peak_rss_heap_released": all(
                r["peak_rss_delta_bytes"][name] is not None for r in rank_results
            ),
            "peak_cuda_bytes": max(r["peak_cuda_bytes"][name] for r in rank_results),
            "work_leader": leaders[0]["work"][name],
            "work_receiver_max": _max_work(
                r["work"][name] for r in rank_results if not r["is_leader"]
            ),
        }
        if name in link_bytes:
            per_strategy[name]["cross_node_bytes_per_call"] = link_bytes[name]
        if name in rank_results[0].get("choices", {}):
            per_strategy[name]["choice"] = rank_results[0]["choices"][name]
    out = {
        "payload_bytes": payload_bytes,
        "strategies": per_strategy,
        **best_floor(per_strategy),
        "device": rank_results[0]["device"],
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
                **best_floor(timed),
            }
        )
    return out


def _sequence_bytes(spec: JobSpec, shapes: list[dict]) -> int:
    """Bytes per call over the timed sequence (mean of each call's largest replica)."""
    bytes_of = [s["payload_bytes"] for s in shapes]
    calls = _call_shapes(spec)
    return int(round(sum(bytes_of[k] for k in calls) / len(calls)))


def best_floor(per_strategy: dict[str, dict]) -> dict:
    """The honest floor: the fastest raw method timed in the job (``floor_method``), beside
    the single broadcast (``floor_single_p50_us``); empty when no floor was timed."""
    floors = {n: s["p50_us"] for n, s in per_strategy.items() if n.split(":")[0] == "floor"}
    if not floors:
        return {}
    method = min(floors, key=floors.get)
    return {
        "floor_p50_us": floors[method],
        "floor_method": method.partition(":")[2] or "one",
        "floor_single_p50_us": floors.get("floor"),
    }


def _collective_counts(name: str, rank_results: list[dict], leader: dict) -> dict:
    """Collectives per call (max over ranks) and the leader's count and bytes; None with the
    reason where a rank's count could not be established."""
    why = next(
        (r.get("collectives_unavailable", {}).get(name) for r in rank_results
         if r["collectives"][name] is None),
        None,
    )  # fmt: skip
    if any(r["collectives"][name] is None for r in rank_results):
        return dict.fromkeys(
            ("collectives_per_call", "collectives_leader", "comm_bytes_leader")
        ) | {"collectives_unavailable": why or "not recorded"}
    return {
        "collectives_per_call": max(len(r["collectives"][name]) for r in rank_results),
        "collectives_leader": len(leader["collectives"][name]),
        "comm_bytes_leader": sum(c[3] for c in leader["collectives"][name]),
    }


def _max_work(works) -> dict:
    out: dict = {}
    for w in works:
        for k, v in w.items():
            out[k] = max(out.get(k, 0), v)
    return out


def _max_or_none(values) -> int | None:
    """The max over ranks of a peak-memory figure; None when any rank could not measure it."""
    values = list(values)
    return None if any(v is None for v in values) else max(values)
