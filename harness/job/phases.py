"""The measured phases of every job: one class each, in one list (``PHASES``), run by one
function (``run_phases``) for both scopes.

A job's *scope* (``harness.job.rounds.Scope``) says where its clock runs. A broadcast job runs
the phases on every rank (``harness.job.broadcast.Prepared`` is its ``Job``); a dispatch job runs
them on the driver (``harness.job.dispatch.DispatchJob``), where one call is the whole hand-out
from the driver's global batch to every rank. A phase only ever talks to its ``Job``: what it
moves (``use``), one untimed call (``call``), one timed call (``timed``), the fence between its
windows (``fence``) and one checked call (``verify``), so a phase written once measures both.

A phase says which scopes it runs in (``scopes``), what it measures there (``measure``: the
``harness.job.results.RankResult`` fields it fills on that process), how all answers become its
part of one strategy's figures (``fold`` returns the ``StrategyFigures`` part it names in
``part``; a dispatch job has one answer, the driver's), and which of those figures a record
carries (``record_fields``, documented in ``harness.job.record_fields.FIELDS``).
``harness.job.summary.summarize`` folds the list; ``harness.job.records`` copies every phase's
``record_fields``. Adding a measured phase is one class here, its entry in ``PHASES``, its
fields in ``harness.job.results`` and their documentation.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from harness.job.interval import Interval, interval_fields, interval_keys
from harness.job.leader_phases import PHASE_FIELDS, cpu_figures, phase_figures
from harness.job.node_memory import (
    NodeMemory,
    Watch,
    calls_for,
    release_free_heap,
    rss_now,
    rss_peak,
    rss_peak_reset,
    run_out_of_memory,
    sampled_call,
)
from harness.job.phase_base import BOTH, Job, Phase, checks_in_rounds
from harness.job.results import (
    ChoiceFigures,
    CollectiveFigures,
    LinkFigures,
    MemoryFigures,
    RankResult,
    TimingFigures,
)
from harness.job.rounds import TIMING_FIELDS, budget_rounds, interleaved, timing_stats
from harness.job.spec import Scope
from harness.job.stats import MIN_SAMPLES, p50_interval
from harness.job.verification import verdict
from strategies.core.trace import Recorder


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_line(groups) -> None:
    """Where every timed call starts: a barrier over the world (replicas start together),
    then one over the replica's own group (the ranks the call moves data between). Where the
    replica is the whole world its barrier alone starts every rank together: a world barrier
    before it adds a collective per call on a group the calls do not use, and the calls timed
    after both barriers ran slower, floor included, on a host whose cores the ranks share.

    On gloo the group used last answers its next collective faster than a group that sat idle
    while another one worked: with only the world barrier, the floor's broadcast over the
    replica group was slower than the same broadcast in a bare world (which barriers and
    broadcasts on one group), and not once a replica-group barrier came last
    (``tests/benchmarks/test_bench_bare.py`` holds the harness to the bare world). A call that
    starts on a smaller group (header's TPxCP hop) still starts on a group the barrier did not
    touch, as it would in a real step."""
    replicas = len(groups.replica_ranks) < dist.get_world_size()
    if replicas:
        dist.barrier()
    if len(groups.replica_ranks) > 1:
        dist.barrier(group=groups.cpu_replica_group)


def _untimed_call(ctx, job: Job, name: str, what: str) -> None:
    ctx.report(f"{what} of {name}")
    job.fence()
    job.call(name)


def _fault(spec, job: Job, rank: int, it: int) -> None:
    """The configured fault (``fault.*``), on its rank of a broadcast job (never a driver); a
    delay is the job's own business (``BroadcastJob.timed``: inside the clock, every call)."""
    fault = spec.fault
    if job.scope is Scope.BROADCAST and fault.strikes(rank, it):
        if fault.kind == "crash":
            os._exit(17)
        if fault.kind == "raise":
            raise RuntimeError(f"fault.kind=raise: rank {rank} at timed iteration {it}")
        if fault.kind == "oom":
            run_out_of_memory()  # raises: the rank fails allocating at this call
        while True:  # hang: never return, never answer
            time.sleep(3600)


# -- timing ---------------------------------------------------------------------------------
class TimedRounds(Phase):
    """Warm-up rounds, then timed rounds that interleave every strategy, each round in its
    own order (``harness.job.rounds.interleaved``); each call is timed where the scope says
    (``Job.timed``: on each rank from ``start_line``, or on the driver from its global batch),
    in seconds per call (``times_s``), with the CPU seconds each process spent inside the call
    (``cpu_s``). Round c moves the workload's call c (warm-up rounds count first), the same
    shape for every strategy of the round, so the floor and pickled are timed shape by shape
    beside it; ``repeats`` blocks of ``iters`` rounds follow one another. A call costs the
    slowest rank; its CPU is the replica's, every rank's together. Where the rounds check
    their own calls (``checks_in_rounds``) they also give ``Verification``'s answers."""

    scopes = BOTH
    part = "timing"
    record_fields = (*TIMING_FIELDS, "rank_skew_us", *interval_keys("p50_us"),
                     "cpu_us_per_call", "cpu_us_leader", *PHASE_FIELDS)  # fmt: skip

    def measure(self, ctx, spec, job: Job) -> dict[str, Any]:
        cpu: dict[str, list[float | None]] = {name: [] for name in job.order}
        split: dict[str, list[dict | None]] = {name: [] for name in job.order}
        checks = checks_in_rounds(spec)
        checked: dict[str, dict] = {"collectives": {}, "collectives_unavailable": {}, "work": {}}
        problems: dict[str, list[str]] = {name: [] for name in job.order}
        rounds = dict.fromkeys(job.order, spec.timed_rounds)
        settled: set[str] = set()
        """Strategies whose first call bought their whole budget: one warm-up call each."""
        memory = _WarmUpMemory(spec, job) if NodeMemory.in_rounds(spec) else None

        def call(name: str, it: int, timed: bool) -> float | None:
            if not timed:
                record = checks and it == -1
                watched = memory is not None and memory.watches(name, it + spec.warmup)
                if not (record or watched):
                    return _untimed_call(ctx, job, name, f"warm-up {it + spec.warmup}")
                said = ("its collectives recorded", "its memory read")
                what = ", ".join(w for w, on in zip(said, (record, watched)) if on)
                ctx.report(f"warm-up {it + spec.warmup} of {name}, {what}")
                job.fence()
                rec = Recorder() if record else None
                if watched:
                    memory.call(name, it + spec.warmup, rec)
                else:
                    with rec or nullcontext():
                        job.call(name)
                if rec is not None:
                    _counted(checked, name, rec)
                return None
            ctx.report(f"timed iteration {it} of {name}")
            if name == spec.strategy:
                _fault(spec, job, ctx.rank, it)
            last = it == rounds[name] - 1
            # A settled strategy had no steady untimed call: its collectives are recorded in
            # its last timed call, the recorder's wrappers a vanishing share of a call that
            # costs the whole budget.
            rec = Recorder() if checks and last and name in settled else None
            timing = job.timed(name, check=checks and last, during=rec)
            if rec is not None:
                _counted(checked, name, rec)
            cpu[name].append(timing.cpu_s)
            split[name].append(timing.phases)
            problems[name] += timing.problems or []
            return timing.wall_s

        def round_start(c: int, timed: bool) -> None:
            job.use(spec.shape_of_call(c))

        budget = settle = None
        if spec.time_budget_s is not None:

            def budget(warm: dict[str, float]) -> dict[str, int]:
                rounds.update(_agreed_rounds(spec, job, warm))
                return rounds

            def settle(warm: dict[str, float]) -> set[str]:
                # One whose memory needs its second call read keeps its second warm-up.
                keep = memory.second if memory is not None else set()
                settled.update(_settled(spec, job, warm) - keep)
                return settled

        times = interleaved(
            job.order, spec.warmup, spec.timed_rounds, call, round_start, budget, settle
        )
        phased = {name: calls for name, calls in split.items() if any(calls)}
        out = {"times_s": times, "cpu_s": cpu, "phases_s": phased or None}
        if memory is not None:
            out.update(memory.watch.results())
        return {**out, "problems": problems, **checked} if checks else out

    def fold(self, spec, name: str, results: list[RankResult]) -> TimingFigures:
        t = np.array([r.times_s[name] for r in results])  # ranks × rounds
        per_call = t.max(axis=0)  # the slowest rank of each call
        skew = per_call - t.min(axis=0)
        # A dispatch job's one answer is the driver's clock: it has no ranks to spread over.
        spread = float(np.median(skew)) * 1e6 if spec.scope is Scope.BROADCAST else None
        interval = Interval.of(p50_interval(per_call, spec.block_of_round()))
        return TimingFigures(
            **timing_stats(per_call),
            rank_skew_us=spread,
            **interval_fields("p50_us", None if interval is None else interval.scaled(1e6)),
            **cpu_figures(name, results),
            **phase_figures(name, results),
        )


class _WarmUpMemory:
    """The node's memory read in the warm-up rounds (``NodeMemory.in_rounds``): each measured
    strategy's first call (``NodeMemory.measured``), and its second where the first left
    something of the batch behind (``Watch.kept_anywhere``), read as ``NodeMemory`` would
    read them with every other strategy dropped. The strategy is built anew just before its
    first call, so what its build and preparation allocate is its own; a raw method, which
    the harness hands the job's one packed buffer instead of packing its own, is credited that
    buffer instead. One set of warm-up calls then answers both the memory and the warm-up."""

    def __init__(self, spec, job: Job) -> None:
        self.job = job
        self.watch = Watch(job.groups.device, *job.idle)
        self.measured = set(NodeMemory.measured(spec, job))
        self.payload = spec.largest_generated_bytes()
        self.second: set[str] = set()
        """Measured strategies whose second call is read too."""

    def watches(self, name: str, warm_up: int) -> bool:
        """Whether warm-up call ``warm_up`` (0 first) of ``name`` is read."""
        return name in self.measured and (warm_up == 0 or (warm_up == 1 and name in self.second))

    def call(self, name: str, warm_up: int, rec: Recorder | None) -> None:
        """Warm-up call ``warm_up`` of ``name``, read (every rank, past a fence)."""
        job = self.job
        # What another raw method received in its last call goes before the reads, not
        # inside the call, where its freeing would hide as much of this call's growth.
        job.let_go_all()
        if warm_up == 0:
            strategy = job.built[name]
            if getattr(strategy, "raw_bytes", False):
                sent = getattr(strategy, "sent", None)
                credit = 0 if sent is None else sent.nbytes
                self.watch.begin(name, credit=credit)
            else:
                job.drop(name)
                del strategy
                self.watch.begin(name)
                job.rebuild(name)
        else:
            self.watch.begin(name)

        def one():
            with rec or nullcontext():
                return job.call(name)

        sampled_call(self.watch, job, name, one)
        if (
            warm_up == 0
            and calls_for(self.payload) > 1
            and self.watch.kept_anywhere(job, name, self.payload)
        ):
            self.second.add(name)


def _agreed(job: Job, warm: dict[str, float]) -> dict[str, float]:
    """Each strategy's warm-up seconds per call as its slowest rank has them, the same on every
    rank (a driver's own where the clock is a driver's)."""
    seconds = torch.tensor([warm[name] for name in job.order], dtype=torch.float64)
    if job.scope is Scope.BROADCAST:
        seconds = seconds.to(job.groups.device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return dict(zip(job.order, seconds.cpu().tolist()))


def _agreed_rounds(spec, job: Job, warm: dict[str, float]) -> dict[str, int]:
    """Each strategy's timed rounds under ``time_budget_s``, the same on every rank: from its
    slowest rank's warm-up seconds per call."""
    least = min(spec.timed_rounds, MIN_SAMPLES)
    return {
        name: budget_rounds(spec.time_budget_s, s, spec.timed_rounds, least)
        for name, s in _agreed(job, warm).items()
    }


def _settled(spec, job: Job, warm: dict[str, float]) -> set[str]:
    """The strategies whose first warm-up call (its slowest rank's) cost at least
    ``time_budget_s``: a second untimed call would cost more than all their timed calls may,
    so they take no more warm-up, and their rounds are priced by that call (the fewest an
    interval needs where it was a set-up call slower than the steady ones). What a steady call
    sets up (a large message's second slot) then falls in their first timed call, which their
    interval shows."""
    return {name for name, s in _agreed(job, warm).items() if s >= spec.time_budget_s}


class SteadyRounds(Phase):
    """A varying workload's steady state: each distinct shape alone, one untimed round (the
    call after a change of shape is the sequence's cost, not the steady one) then
    ``steady_iters`` timed rounds; seconds per call by strategy then shape (``steady_s``,
    folded per shape by ``harness.job.summary.per_shape``)."""

    scopes = BOTH

    def applies(self, ctx, spec) -> bool:
        return spec.workload is not None and spec.workload.varying and spec.steady_iters >= 1

    def measure(self, ctx, spec, job: Job) -> dict[str, Any]:
        out: dict[str, list[list[float]]] = {name: [] for name in job.order}
        for k, shape in enumerate(spec.distinct_shapes()):
            job.use(shape)

            def call(name: str, it: int, timed: bool, k: int = k) -> float | None:
                if not timed:
                    return _untimed_call(ctx, job, name, f"steady warm-up of shape {k}")
                ctx.report(f"steady iteration {it} of shape {k} of {name}")
                return job.timed(name).wall_s

            for name, seconds in interleaved(job.order, 1, spec.steady_iters, call).items():
                out[name].append(seconds)
        return {"steady_s": out}


# -- what a call moves and costs besides time -------------------------------------------------
class LinkBytes(Phase):
    """Node-link bytes per call of each strategy, on an emulated cluster: rank 0 (or the
    driver) reads the links' counters (the context's ``link_counter`` hook) around
    ``link_bytes_calls`` back-to-back calls of one strategy. Fences close the window so only
    that strategy's traffic (and a barrier's few hundred bytes) is counted."""

    scopes = BOTH
    part = "link"
    record_fields = ("cross_node_bytes_per_call",)

    def applies(self, ctx, spec) -> bool:
        # A hook only contexts on an emulated cluster carry (other contexts may lack the field).
        return getattr(ctx, "link_counter", None) is not None and spec.link_bytes_calls > 0

    def measure(self, ctx, spec, job: Job) -> dict[str, Any]:
        read = ctx.link_counter if ctx.rank == 0 else None
        out: dict[str, float] = {}
        for name in job.order:
            ctx.report(f"counting link bytes of {name}")
            job.fence()
            before = read() if read is not None else 0
            job.fence()
            for _ in range(spec.link_bytes_calls):
                job.call(name)
            job.fence()
            if read is not None:
                out[name] = (read() - before) / spec.link_bytes_calls
        return {"link_bytes_per_call": out} if out else {}

    def fold(self, spec, name: str, results: list[RankResult]) -> LinkFigures | None:
        counted = next((r.link_bytes_per_call for r in results if r.link_bytes_per_call), {})
        return LinkFigures(counted[name]) if name in counted else None


def _collective_counts(name: str, results: list[RankResult], leader: RankResult) -> dict:
    """Collectives per call (max over ranks) and the leader's count and bytes; None with the
    reason where a rank's count could not be established."""
    if any(r.collectives[name] is None for r in results):
        why = next(
            (r.collectives_unavailable.get(name) for r in results if r.collectives[name] is None),
            None,
        )
        return dict.fromkeys(
            ("collectives_per_call", "collectives_leader", "comm_bytes_leader")
        ) | {"collectives_unavailable": why or "not recorded"}
    return {
        "collectives_per_call": max(len(r.collectives[name]) for r in results),
        "collectives_leader": len(leader.collectives[name]),
        "comm_bytes_leader": sum(c[3] for c in leader.collectives[name]),
        "collectives_unavailable": None,
    }


class PeakMemory(Phase):
    """One untimed call per strategy between a reset of the process's peak RSS (VmHWM) and a
    read of it, after the free heap is handed back, so the growth is this call's; CUDA's peak
    allocation beside it on a GPU. Where ``NodeMemory`` runs, its calls give these figures
    (each strategy rebuilt alone) and this phase spends none of its own."""

    part = "memory"
    record_fields = (
        "peak_rss_bytes", "peak_rss_delta_bytes", "peak_cuda_bytes", "peak_rss_heap_released"
    )  # fmt: skip

    def applies(self, ctx, spec) -> bool:
        return not NodeMemory.runs(spec)

    def measure(self, ctx, spec, job: Job) -> dict[str, Any]:
        device = job.groups.device
        out: dict[str, dict] = {
            k: {} for k in ("peak_rss_bytes", "peak_rss_delta_bytes", "peak_cuda_bytes")
        }
        for name in job.order:
            ctx.report(f"measuring peak memory of {name}")
            job.fence()
            released = release_free_heap(full=name == job.order[0])
            base = rss_now()
            honest = rss_peak_reset() and released
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                cuda_base = torch.cuda.memory_allocated(device)
            job.call(name)
            peak = rss_peak()  # VmHWM since the reset: this call's high-water mark
            out["peak_rss_bytes"][name] = peak
            # None where VmHWM could not be reset or the free heap not released: the growth
            # would then be the process's lifetime peak or the reused pages' 0, neither this
            # call's.
            out["peak_rss_delta_bytes"][name] = max(0, peak - base) if honest else None
            out["peak_cuda_bytes"][name] = (
                torch.cuda.max_memory_allocated(device) - cuda_base if device.type == "cuda" else 0
            )
        return out

    def fold(self, spec, name: str, results: list[RankResult]) -> MemoryFigures | None:
        if any(name not in (r.peak_rss_bytes or {}) for r in results):
            return None  # not measured: a floor's raw method where the node's memory ran
        deltas = [r.peak_rss_delta_bytes[name] for r in results]
        return MemoryFigures(
            peak_rss_bytes=max(r.peak_rss_bytes[name] for r in results),
            peak_rss_delta_bytes=None if None in deltas else max(deltas),
            # Says a reader that this growth was measured on fresh pages (records before the
            # free heap was released read 0 whenever a call reused freed pages).
            peak_rss_heap_released=None not in deltas,
            peak_cuda_bytes=max(r.peak_cuda_bytes[name] for r in results),
        )


class AutoChoice(Phase):
    """Which strategy a choosing strategy (``auto``) serves its next call with, on each rank."""

    part = "choice"

    def measure(self, ctx, spec, job: Job) -> dict[str, Any]:
        return {"choices": {n: s.choice for n, s in job.built.items() if hasattr(s, "choice")}}

    def fold(self, spec, name: str, results: list[RankResult]) -> ChoiceFigures | None:
        chosen = results[0].choices or {}
        return ChoiceFigures(chosen[name]) if name in chosen else None


# -- correctness ------------------------------------------------------------------------------
class Verification(Phase):
    """Calls of every strategy compared bit for bit with what the leader (or the driver)
    holds: one per shape of the period, in the workload's order (so a small call after a large
    one is checked too); any difference fails the job naming the rank and the key. On the
    ranks the first checked call of each strategy is also recorded (``strategies.core.trace``):
    the collectives it made (kind, ranks, root, bytes) and its local work (bytes packed,
    pickled, copied), the call alone (not the fingerprints' exchange), so no call is spent on
    counting alone. Its own calls are made only where the rounds do not check theirs
    (``checks_in_rounds``); it judges and folds their answers either way."""

    scopes = BOTH
    part = "collectives"
    record_fields = (
        "collectives_per_call", "collectives_leader", "comm_bytes_leader", "collectives_unavailable"
    )  # fmt: skip

    def applies(self, ctx, spec) -> bool:
        # Where the rounds check their own calls, their answers are this phase's to judge.
        return not checks_in_rounds(spec)

    def measure(self, ctx, spec, job: Job) -> dict[str, Any]:
        problems: dict[str, list[str]] = {name: [] for name in job.order}
        counted = job.scope is Scope.BROADCAST
        out: dict[str, dict] = {"collectives": {}, "collectives_unavailable": {}, "work": {}}
        for k, shape in enumerate(spec.period()):
            job.use(shape)
            for name in job.order:
                ctx.report(f"verifying {name}" + (f" on call {k} of the period" if k else ""))
                job.fence()
                if k or not counted:
                    found = job.verify(name)
                else:
                    rec = Recorder()
                    found = job.verify(name, during=rec)
                    _counted(out, name, rec)
                problems[name] += [f"{p} (call {k} of the period)" if k else p for p in found]
        return {"problems": problems, **(out if counted else {})}

    def check(self, spec, results: list[RankResult]) -> None:
        verdict([p for r in results for found in r.problems.values() for p in found])

    def fold(self, spec, name: str, results: list[RankResult]) -> CollectiveFigures | None:
        if results[0].collectives is None:  # a driver's job: no rank recorded its calls
            return None
        leader = next(r for r in results if r.is_leader)
        receivers = [r.work[name] for r in results if not r.is_leader]
        return CollectiveFigures(
            **_collective_counts(name, results, leader),
            work_leader=leader.work[name],
            work_receiver_max={
                k: max(w.get(k, 0) for w in receivers)
                for k in dict.fromkeys(k for w in receivers for k in w)  # first-seen order
            },
        )


def _counted(out: dict[str, dict], name: str, rec: Recorder) -> None:
    """What ``rec`` saw of one call of ``name``, into ``out``. None where the recorder could
    not see every path to a collective (``rec.unavailable`` says why): no count rather than a
    short one."""
    out["collectives"][name] = (
        None if rec.unavailable else [(c.kind, c.ranks, c.root, c.nbytes) for c in rec.comms]
    )
    out["collectives_unavailable"][name] = rec.unavailable
    out["work"][name] = dict(rec.work)


PHASES: tuple[Phase, ...] = (
    TimedRounds(),
    SteadyRounds(),
    LinkBytes(),
    PeakMemory(),
    Verification(),
    AutoChoice(),
    NodeMemory(),
)
"""Every measured phase, in the order a job runs them; every phase but the rounds starts on
the period's first shape (auto's choice is read after the calls; the node's memory last, since
where it makes calls of its own it drops every strategy)."""


def run_phases(ctx, spec, job: Job, result: RankResult) -> RankResult:
    """Every phase of ``PHASES`` that runs in ``job``'s scope and applies, in order, on this
    rank (a broadcast job) or on the driver (a dispatch job); ``result`` with their answers."""
    for phase in PHASES:
        if job.scope in phase.scopes and phase.applies(ctx, spec):
            if not isinstance(phase, TimedRounds):
                job.use(spec.period()[0])
            result = result.taking(phase.measure(ctx, spec, job))
    return result
