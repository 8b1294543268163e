"""How much of the machine other work takes while we measure, from /proc/stat.

The 1-minute load average does not say that on every machine: a VM can report a load in the
hundreds while idle. Instead: the machine's busy CPU-seconds (user + nice + system) minus those of this
process and of the children it has reaped, over the wall time between two snapshots, is how many
cores other work used meanwhile. irq/softirq time (a shaped link's packets, charged to no task)
and steal are left out.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from strategies.core.node_signals import usable_cores


@dataclass(frozen=True)
class CpuSnapshot:
    busy_s: float
    """Busy CPU-seconds of the whole machine since boot."""
    own_s: float
    """CPU-seconds of this process and every child it has reaped."""
    wall_s: float
    """time.monotonic() when taken."""


def snapshot() -> CpuSnapshot | None:
    """Now; None where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:4]]
    except (OSError, ValueError):
        return None
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    return CpuSnapshot(sum(fields) / os.sysconf("SC_CLK_TCK"), own, time.monotonic())


def other_cores(since: CpuSnapshot | None, until: CpuSnapshot | None = None) -> float | None:
    """Cores' worth of CPU that other work used between two snapshots (``until``: now).
    Children still running at ``until`` count as other work until they are reaped."""
    until = until or snapshot()
    if since is None or until is None or until.wall_s <= since.wall_s:
        return None
    other = (until.busy_s - since.busy_s) - (until.own_s - since.own_s)
    return max(0.0, other / (until.wall_s - since.wall_s))


def other_cores_now(sample_s: float = 1.0) -> float | None:
    """Cores other work uses, sampled over ``sample_s`` seconds of this process sleeping."""
    start = snapshot()
    time.sleep(sample_s)
    return other_cores(start)


@dataclass(frozen=True)
class HostBeforeJob:
    """What the host offered a job, read as it starts: the cores this process may use and the
    load average of the minute before."""

    cores: int
    load_avg_1m: float | None

    def fields(self, nodes: tuple[tuple[int, ...], ...]) -> dict:
        """The record's host fields for a world whose nodes hold ``nodes`` (rank tuples):
        oversubscribed when one node holds more ranks than there are cores."""
        ranks = max((len(n) for n in nodes), default=0) or None
        return {
            "host_cores": self.cores,
            "ranks_on_node": ranks,
            "oversubscribed": None if ranks is None else ranks > self.cores,
            "load_avg_1m": self.load_avg_1m,
        }


def host_cores() -> int:
    """The whole cores this process may run on: ``usable_cores`` (its affinity, capped by its
    cgroup's CPU quota), rounded down, at least one."""
    return max(1, math.floor(usable_cores()))


def host_before_job() -> HostBeforeJob:
    """The whole cores this process may run on (``usable_cores``: a container's or a taskset's
    share, capped by its CPU quota, not the machine's count; the same count decides whether shm
    readers poll) and the 1-minute load average (None where the platform has none). A VM's load
    average can mislead; the record keeps it beside the cores so a reader can judge."""
    cores = host_cores()
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return HostBeforeJob(cores, load)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def mem_available() -> int:
    """Bytes this host can still give the job: the kernel's MemAvailable, or less where this
    process's memory cgroup (v2, else v1) allows less (its limit minus its usage); read, never
    changed. 0 where /proc has no meminfo."""
    available = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 2**60:
            available = min(available, max(0, limit - usage))
            break
    return available
