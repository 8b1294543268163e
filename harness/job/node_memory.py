"""How much of a node's memory each way of moving a batch keeps alive at its peak: this
process's resident set read from ``/proc`` (the high-water mark, ``smaps_rollup``'s
proportional set), a sampler that follows it during a call, the ``Watch`` that reads each
strategy's calls apart from the others', and the ``NodeMemory`` phase that measures every
strategy as if alone and folds the ranks of each node into the node's figures.

Why proportional (PSS): a shared segment mapped by four ranks is one copy on the node, but each
rank's resident set counts it whole; PSS splits a shared page among its mappers, so the sum over
a node's ranks counts it once. Why sampled: no counter keeps a PSS high-water mark, so a thread
reads ``smaps_rollup`` every ``SAMPLE_S`` and a peak shorter than that can be missed; each rank's
exact resident high-water mark (VmHWM, shared pages counted whole) is kept beside it.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from harness.job.label import Label
from harness.job.phase_base import Job, Phase, checks_in_rounds
from harness.job.results import NodeMemoryFigures, RankResult
from strategies.core.segment_ring import REUSE_MIN_BYTES

SAMPLE_S = 0.002
"""The shortest pause between two reads of ``smaps_rollup`` while a call runs."""

READ_SHARE = 0.2
"""At most this share of a core goes to the reads: one read walks every mapping of the process
(several milliseconds in a rank that imported torch), so the pause is at least four reads'
time; the record's ``memory_sample_ms`` says the interval the reads kept."""


def calls_for(payload_bytes: int | None) -> int:
    """The most calls per strategy while the sampler runs: the first allocates what the
    strategy keeps between calls; from ``REUSE_MIN_BYTES`` on a second, steady call beside it
    where the first left something behind (``KEPT_SHARE``: a node channel's slot taken in turn
    instead of reused shows there as a second segment). Below it one: a node channel's small
    slots are taken in turn by design, and the rank's base, not the batch, is most of the
    node's memory there."""
    return 1 if payload_bytes is not None and payload_bytes < REUSE_MIN_BYTES else 2


KEPT_SHARE = 16
"""A strategy gets its second sampled call (``calls_for``) only where its first left at least
this fraction of the payload resident on some rank: one that keeps nothing between calls starts
its second call where it started its first, so that call could only repeat the first's peak,
at a gigabyte's price. An unknown payload size always gets it."""


@dataclass(frozen=True)
class Resident:
    """This process's resident memory at one instant, in bytes (``/proc/self/smaps_rollup``)."""

    pss: int
    """Proportional set: every page, a shared one split among the processes mapping it."""
    rss: int
    """Resident set: shared pages counted whole."""
    pss_shmem: int
    """The part of ``pss`` in shared memory (segments in /dev/shm, shared anonymous maps)."""


_KEYS = {"Pss:": "pss", "Rss:": "rss", "Pss_Shmem:": "pss_shmem"}


def resident() -> Resident | None:
    """This process's ``Resident`` now; None where the kernel has no ``smaps_rollup``."""
    found = dict.fromkeys(_KEYS.values(), 0)
    try:
        with open("/proc/self/smaps_rollup", "rb") as f:
            for line in f.read().decode().splitlines():
                key, _, rest = line.partition(" ")
                if key in _KEYS:
                    found[_KEYS[key]] = int(rest.split()[0]) * 1024
    except OSError:
        return None
    return Resident(**found)


class Sampler:
    """A thread reading ``resident()`` while a ``with`` block runs, every ``interval_s`` or
    every ``1 / READ_SHARE`` reads' time if longer; ``peak`` is the sample with the largest PSS
    (any ``take`` the block makes included: a block takes one where it knows a peak)."""

    def __init__(self, interval_s: float = SAMPLE_S) -> None:
        self.interval_s = interval_s
        self.peak: Resident | None = None
        self.samples = 0
        self.taken = 0
        """Reads the block asked for (``take``)."""
        self.waited_s = 0.0
        """The pauses between the thread's reads, added up (``mean_interval_s``)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bcastbench-memory", daemon=True)

    def take(self) -> None:
        """One read now (a block's own, where it knows a peak: a call's result still held)."""
        self.taken += 1
        self._read()

    def _read(self) -> None:
        now = resident()
        if now is None:
            return
        self.samples += 1
        if self.peak is None or now.pss > self.peak.pss:
            self.peak = now

    def _run(self) -> None:
        pause = self.interval_s
        while not self._stop.wait(pause):
            t0 = time.perf_counter()
            self._read()
            pause = max(self.interval_s, (time.perf_counter() - t0) / READ_SHARE)
            self.waited_s += pause

    @property
    def mean_interval_s(self) -> float:
        """The mean pause between the thread's reads (the shortest if it made none)."""
        reads = self.samples - self.taken
        return self.waited_s / reads if reads > 0 else self.interval_s

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class _Own:
    """One strategy's memory on this rank over its watched calls, in bytes above what the rank
    held before them: its peaks, and what it keeps between calls."""

    peak_pss: int = 0
    peak_shm: int = 0
    hwm: int = 0
    """Resident high-water mark (shared pages whole)."""
    cuda: int = 0
    kept_pss: int = 0
    kept_shm: int = 0
    kept_rss: int = 0
    kept_cuda: int = 0
    honest: bool = True
    """Whether every call's VmHWM was reset and the free heap handed back before it."""
    interval_s: float = SAMPLE_S


class Watch:
    """One rank's reads of each strategy's memory, call by call: a call's peak is read above
    what the rank held when it began, less what the strategy kept from its own earlier calls
    (and, credited, what a raw method would have packed alone). What the job's other strategies
    keep between calls (their segments, buffers, the shared packed bytes) is then in no
    strategy's figure, so a strategy need not be measured alone to be measured apart: calls run
    one at a time and the others sit idle meanwhile. ``entry`` states the figures above
    ``idle``, the rank's memory holding the job's batches and the harness, as a strategy
    measured alone from nothing would read."""

    def __init__(self, device, idle: Resident | None = None, idle_rss: int = 0) -> None:
        self.device = device
        self.idle, self.idle_rss = idle, idle_rss
        """The reads a figure is stated above: given, or the first ``begin``'s."""
        self.own: dict[str, _Own] = {}
        self._open: tuple | None = None

    def begin(self, name: str, released: bool | None = None, credit: int = 0) -> None:
        """Before a call of ``name`` (no collective: the caller fences): the free heap handed
        back (unless ``released`` says whether the caller did), the reads the call's figures
        start from, VmHWM reset. ``credit``: bytes the strategy holds already that it would
        have allocated alone (a raw method's packed buffer, which the harness shares)."""
        if released is None:
            released = release_free_heap(full=False)
        now, rss = resident(), rss_now()
        honest = rss_peak_reset() and released
        cuda = _cuda_reset(self.device)
        if self.idle is None:
            self.idle, self.idle_rss = now, rss
        own = self.own.get(name)
        if own is None:
            own = self.own[name] = _Own(kept_pss=credit, kept_rss=credit)
        own.honest = own.honest and honest
        self._open = (name, now, rss, cuda)

    def end(self, sampler: Sampler) -> None:
        """After the call ``begin`` opened, every rank past a fence: its peaks and what it kept
        added to its strategy's."""
        name, base, rss, cuda = self._open
        self._open = None
        # Kept is what the strategy holds, not the free heap its call left (a trim hands that
        # back; left in, a second call would be read on top of a copy nobody holds).
        release_free_heap(full=False)
        now = resident()
        own = self.own[name]
        peak = sampler.peak if sampler.peak is not None else now
        own.peak_pss = max(own.peak_pss, own.kept_pss + peak.pss - base.pss)
        own.peak_shm = max(own.peak_shm, own.kept_shm + peak.pss_shmem - base.pss_shmem)
        own.hwm = max(own.hwm, own.kept_rss + rss_peak() - rss)
        own.cuda = max(own.cuda, own.kept_cuda + _cuda_peak(self.device, cuda))
        own.kept_pss += now.pss - base.pss
        own.kept_shm += now.pss_shmem - base.pss_shmem
        own.kept_rss += rss_now() - rss
        own.kept_cuda += _cuda_now(self.device) - cuda
        own.interval_s = max(own.interval_s, sampler.mean_interval_s)

    def kept_anywhere(self, job: Job, name: str, payload: int | None) -> bool:
        """Whether ``name``'s calls so far left ``1 / KEPT_SHARE`` of ``payload`` (or
        anything, for an unknown payload) resident on some rank: every rank asks, every rank
        gets the same answer."""
        least = 1 if payload is None else max(1, payload // KEPT_SHARE)
        kept = self.own[name].kept_pss if name in self.own else 0
        flag = torch.tensor([1 if kept >= least else 0], dtype=torch.int64)
        flag = flag.to(job.groups.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def entry(self, name: str, host: str) -> dict:
        """``name``'s figures on this rank as ``NodeMemory.fold`` reads them."""
        own, idle = self.own[name], self.idle
        return {
            "host": host, "idle_pss": idle.pss, "peak_pss": idle.pss + max(0, own.peak_pss),
            "peak_shm": idle.pss_shmem + max(0, own.peak_shm),
            "hwm": self.idle_rss + max(0, own.hwm), "kept_pss": idle.pss + max(0, own.kept_pss),
            "interval_s": own.interval_s,
        }  # fmt: skip

    def results(self) -> dict[str, Any]:
        """Every watched strategy's ``RankResult`` fields: ``node_memory`` and ``PeakMemory``'s
        figures of the same calls."""
        host = socket.gethostname()
        return {
            "node_memory": {name: self.entry(name, host) for name in self.own},
            "peak_rss_bytes": {n: self.idle_rss + max(0, o.hwm) for n, o in self.own.items()},
            # None where VmHWM could not be reset or the free heap not released: the growth
            # would then be the process's lifetime peak or the reused pages' 0, neither the
            # strategy's.
            "peak_rss_delta_bytes": {
                n: max(0, o.hwm) if o.honest else None for n, o in self.own.items()
            },
            "peak_cuda_bytes": {n: max(0, o.cuda) for n, o in self.own.items()},
        }


def sampled_call(watch: Watch, job: Job, name: str, call: Callable[[], Any]) -> None:
    """The call ``watch.begin`` opened: ``call()`` (which returns what it received) sampled
    with its result still held, the result dropped, a fence, ``watch.end``. Every rank calls it
    at the same point."""
    with Sampler() as sampler:
        received = call()
        sampler.take()  # the result still held: a receiver's peak
        del received  # the next call starts clean
        job.let_go(name)
    job.fence()
    watch.end(sampler)


class NodeMemory(Phase):
    """Each strategy's memory on its node, as if measured alone from nothing: a ``Watch``
    reads each rank around the strategy's first call (and its second, ``calls_for``) while a
    ``Sampler`` follows it, the strategy built anew just before (``measured`` says which
    strategies: a raw method of the floor's whose footprint another shares is not). Where the
    rounds check their own calls (``in_rounds``) those are their warm-up calls, the job's other
    strategies built beside it and subtracted (``harness.job.phases``), and this phase makes no
    call; elsewhere it makes its own, every strategy dropped first. A node's peak is the sum
    of its ranks' sampled peaks (an upper bound on their sum at one instant: the ranks of a
    broadcast peak together, when the batch has arrived). The same calls give ``PeakMemory``'s
    figures (each rank's VmHWM reset before each): one set of calls answers both. Last in
    ``PHASES``: its own calls leave the job's strategies dropped."""

    part = "node_memory"
    record_fields = (
        "rank_peak_bytes", "node_peak_bytes", "node_idle_bytes", "node_kept_bytes",
        "node_shm_bytes", "node_copies", "harness_copies", "node_ranks", "memory_sample_ms",
    )  # fmt: skip

    def applies(self, ctx, spec) -> bool:
        return self.runs(spec) and not self.in_rounds(spec)

    @staticmethod
    def runs(spec) -> bool:
        """Whether a job of ``spec`` measures the node's memory (``PeakMemory`` runs where it
        does not)."""
        # Ray's ranks are actors whose strategies may own actors of their own (a store):
        # rebuilding those per strategy is not measured yet.
        return spec.node_memory and spec.world != "ray" and resident() is not None

    @classmethod
    def in_rounds(cls, spec) -> bool:
        """Whether the warm-up rounds read the node's memory (``harness.job.phases``'s
        ``TimedRounds``), so this phase makes no call of its own: where the rounds check their
        own calls (``checks_in_rounds``: two warm-up rounds of one constant shape)."""
        return cls.runs(spec) and checks_in_rounds(spec)

    def measure(self, ctx, spec, job: Job) -> dict[str, Any]:
        payload = spec.largest_generated_bytes()
        # Figures stated above what the rank held with the job's batches alone, before any
        # strategy was built (``BroadcastJob.idle``): by now the rounds' freed heap has
        # fragments no trim hands back, which are no strategy's and not the harness's.
        watch = Watch(job.groups.device, *getattr(job, "idle", (None, 0)))
        for k, name in enumerate(self.measured(spec, job)):
            ctx.report(f"measuring the node's memory of {name}")
            for c in range(calls_for(payload)):
                if c and not watch.kept_anywhere(job, name, payload):
                    break
                # Every rank holds what the last call sent before anything is dropped: a
                # sender whose socket closes with a message still queued loses it
                # (vllm_shm_broadcast).
                job.fence()
                released = job.release(full=k == 0) if c == 0 else None
                job.fence()
                watch.begin(name, released)
                if c == 0:
                    job.rebuild(name)
                sampled_call(watch, job, name, lambda name=name: job.call(name))
        job.fence()
        job.release(full=False)
        return watch.results()

    @staticmethod
    def measured(spec, job: Job) -> list[str]:
        """The strategies whose memory a job measures: every one, but of the floor's raw
        methods only the first of each declared footprint (the chunked and hop-ordered
        broadcasts hold what one broadcast holds: the shared packed buffer and the bytes
        received), since each costs its own calls at a gigabyte's price and no record is a
        raw method's; the strategy under test always."""
        out, footprints = [], []
        for name in job.order:
            if name != spec.strategy and Label.parse(name).is_floor:
                strategy = job.built[name]
                footprint = type(strategy).footprint_for(**asdict(strategy.options))
                if footprint in footprints:
                    continue
                footprints.append(footprint)
            out.append(name)
        return out

    def fold(self, spec, name: str, results: list[RankResult]) -> NodeMemoryFigures | None:
        measured = [r for r in results if r.node_memory and name in r.node_memory]
        leaders = [r for r in results if r.is_leader]
        if len(measured) != len(results) or not leaders[0].payload_bytes:
            return None
        payload = leaders[0].payload_bytes
        by_host: dict[str, list[RankResult]] = {}
        for r in results:
            by_host.setdefault(r.node_memory[name]["host"], []).append(r)

        def total(ranks, key) -> int:
            return sum(r.node_memory[name][key] for r in ranks)

        busiest = max(by_host.values(), key=lambda ranks: total(ranks, "peak_pss"))
        peak, idle = total(busiest, "peak_pss"), total(busiest, "idle_pss")
        base = sum(r.base_pss_bytes or 0 for r in busiest)
        on_node = sum(r.is_leader for r in busiest)
        return NodeMemoryFigures(
            rank_peak_bytes=max(r.node_memory[name]["hwm"] for r in results),
            node_peak_bytes=peak,
            node_idle_bytes=idle,
            node_kept_bytes=max(0, total(busiest, "kept_pss") - idle),
            node_shm_bytes=total(busiest, "peak_shm"),
            # The leaders' own batches are resident before any call: one copy each.
            node_copies=round(on_node + max(0, peak - idle) / payload, 3),
            harness_copies=round(max(0, idle - base) / payload, 3) if base else None,
            node_ranks=len(busiest),
            memory_sample_ms=round(
                max(r.node_memory[name].get("interval_s", SAMPLE_S) for r in busiest) * 1e3, 2
            ),
        )


def _cuda_reset(device) -> int:
    """On a CUDA device: its peak statistics reset, and what is allocated now (0 elsewhere)."""
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _cuda_now(device) -> int:
    """What is allocated on a CUDA device now (0 elsewhere)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _cuda_peak(device, base: int) -> int:
    """CUDA's peak allocation since ``_cuda_reset`` above ``base`` (0 off a CUDA device)."""
    return torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0


def rss_peak_reset() -> bool:
    """Reset this process's VmHWM (peak RSS); False where the kernel does not let it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_free_heap(full: bool = True) -> bool:
    """Hand the heap's free pages back to the kernel (glibc ``malloc_trim``), so that what the
    next call allocates has to fault in fresh pages and shows up in VmHWM. Without it the
    earlier rounds' freed buffers stay resident, the call reuses them and its high-water growth
    reads 0 whatever it allocates. False where there is no glibc to ask.

    Objects in reference cycles hold memory until the collector runs: ``full`` collects every
    generation (slow in a rank that imported torch and megatron-core, so once per job);
    otherwise only the young ones, where one call's cycles are."""
    gc.collect(2 if full else 1)
    try:
        # The process's own symbols: glibc's malloc_trim where the C library is glibc.
        ctypes.CDLL(None).malloc_trim(0)  # 0: keep no padding at the top of the heap
        return True
    except (OSError, AttributeError):
        return False


def rss_peak() -> int:
    """This process's VmHWM in bytes (the lifetime peak where /proc has none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_now() -> int:
    """This process's resident set in bytes (0 where /proc has none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


OOM_ROOM_BYTES = 2**20
"""What a rank capped by ``cap_address_space`` may still map: enough for a small object, never
for a batch."""


def cap_address_space() -> None:
    """Limit this process's address space to what it maps now plus ``OOM_ROOM_BYTES``
    (``RLIMIT_AS``): its next large allocation fails as on a host out of memory, and nothing
    else on the host is touched (``fault.kind=oom``)."""
    size = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                size = int(line.split()[1]) * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + OOM_ROOM_BYTES, hard))


def run_out_of_memory() -> None:
    """``fault.kind=oom`` at its call: cap the address space (``cap_address_space``), then map
    a fresh region larger than the room left, as a receiver maps its buffer: the allocation
    fails here, at this call (OSError, ENOMEM). Leaving it to the call's own allocations would
    make where it fails depend on what the allocator still holds from earlier calls, which
    reuses freed memory without mapping more."""
    cap_address_space()
    with mmap.mmap(-1, 2 * OOM_ROOM_BYTES):
        pass
