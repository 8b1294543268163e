"""The joined world (``JoinedWorld``, a ``harness.worlds.protocol.World``): this process is one rank
of a world a launcher started (torchrun, a submitit job of several tasks, a plain ``srun``
step, or an emulated node's torchrun); every rank runs the task and rank 0 gets every result.

Silence is watched on each rank: a rank that reports no phase for ``timeout_s`` while a task
runs says so on its stderr in the forked world's terms (``rank 1 stopped responding for 6 s
while 'timed iteration 0 of header' (job ...), outside any collective ...``). A rank that is
outside any collective is the one the others wait for: it exits with ``SILENT_EXIT``, and
the launcher (torchrun, srun) ends the rest. Ranks inside a collective only say so; gloo's
own timeout (``timeout_s`` + 5 s) ends their wait.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from harness.worlds.emulated import adopt_worker_env, link_counter
from harness.worlds.launcher import Launch, env_int
from harness.worlds.protocol import NodesFoundAtStart, RankFn, WorldError, group_by_node
from harness.worlds.rank import IN_COLLECTIVE, RankContext, device_for, where

SILENT_EXIT = 124
"""Exit status of a joined rank that stopped responding outside any collective."""
WATCH_POLL_S = 1.0
"""How often a joined rank's watchdog looks at its phase."""

log = logging.getLogger("bcastbench")


def node_of(env: Mapping[str, str], via: str) -> int:
    """This rank's node, from its launcher's environment: torchrun's GROUP_RANK (else RANK //
    LOCAL_WORLD_SIZE), Slurm's SLURM_NODEID (srun, a submitit Slurm job); a submitit local
    job runs on this machine alone."""
    if via == "torchrun":
        if "GROUP_RANK" in env:
            return env_int(env, "GROUP_RANK", 0)
        return env_int(env, "RANK", 0) // max(env_int(env, "LOCAL_WORLD_SIZE", 1), 1)
    if via == "submitit" and env.get("SUBMITIT_EXECUTOR") == "local":
        return 0
    return env_int(env, "SLURM_NODEID", 0)


def export_rendezvous(launch: Launch, env=os.environ) -> None:
    """Export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT for ``env://`` where the launcher
    did not (submitit, srun); torchrun already did."""
    if launch.via == "submitit" and "RANK" not in env:
        import submitit  # optional: the slurm extra

        # submitit draws its port from the whole 20000-60000 range, mostly the kernel's
        # ephemeral ports, where any outgoing connection on the node may hold it. It reads a
        # MASTER_PORT already set, and exports while one is set only when told to overwrite.
        port = env.setdefault("MASTER_PORT", str(job_port(env)))
        if not (port.isdigit() and 0 < int(port) < 65536):
            raise RuntimeError(
                f"MASTER_PORT={port!r}: expected a TCP port (an integer 1-65535), or leave it "
                "unset and every task derives one from the Slurm job id"
            )
        # One rank per task: every task already is a process of the world, nothing to spawn.
        submitit.helpers.TorchDistributedEnvironment().export(
            set_cuda_visible_devices=False, overwrite=True
        )
    elif launch.via == "srun" and "RANK" not in env:
        env.update(srun_rendezvous(env, launch.world_size or 1))


def srun_rendezvous(env, tasks: int) -> dict[str, str]:
    """The step's first node as MASTER_ADDR and a port every task derives alike from the job
    and step ids (jobs and steps sharing a node get different ones)."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False
    ).stdout.split()
    if not hosts:
        raise RuntimeError(
            f"srun step of {tasks} tasks: cannot expand SLURM_STEP_NODELIST={nodelist!r} with "
            "`scontrol show hostnames`; set MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE yourself "
            "or launch through torchrun"
        )
    per_node = re.match(r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    return dict(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=str(tasks),
        LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
        LOCAL_WORLD_SIZE=per_node.group(0) if per_node else str(tasks),
        MASTER_ADDR=hosts[0],
        MASTER_PORT=str(job_port(env)),
    )


PORT_BASE, PORT_SPAN = 20000, 12000
"""Where a Slurm job's rendezvous port lies: below 32768, where Linux's ephemeral ports (the
local ports of outgoing connections) begin by default, so only another listener can hold it."""


def job_port(env) -> int:
    """The rendezvous port every task of a Slurm job step derives alike from the job and step
    ids (``SLURM_JOB_ID`` is an array task's own): jobs whose ids differ by less than 750, and
    their steps, get different ports. A job of submitit's local executor has no Slurm ids but
    its controller's pid (``SUBMITIT_LOCAL_JOB_ID``): two such jobs at once on one host (two
    test sessions' sweeps) met on one port and joined each other's world."""
    if env.get("SUBMITIT_EXECUTOR") == "local":
        key = env_int(env, "SUBMITIT_LOCAL_JOB_ID", 0)
    else:
        key = env_int(env, "SLURM_JOB_ID", 0) * 16 + env_int(env, "SLURM_STEP_ID", 0)
    return PORT_BASE + key % PORT_SPAN


class _Watchdog:
    """A joined rank's phase board (``RankContext.board``) and the thread that reads it."""

    def __init__(self, rank: int) -> None:
        self.rank, self.main = rank, threading.get_ident()
        self.phase, self.since = "idle", time.monotonic()
        self.task: tuple[str, float] | None = None  # (what, limit) while a task runs
        self.said = False
        threading.Thread(target=self._watch, daemon=True, name="bcastbench-watchdog").start()

    def write(self, rank: int, job: int, step: int, phase: str) -> None:
        self.phase, self.since = phase, time.monotonic()

    def arm(self, what: str, limit_s: float) -> None:
        self.write(self.rank, 0, 0, what)
        self.task, self.said = (what, limit_s), False

    def disarm(self) -> None:
        self.task = None

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_POLL_S)
            task = self.task
            if task is None or self.said or time.monotonic() - self.since < task[1]:
                continue
            at = where(sys._current_frames().get(self.main))
            print(
                f"bcastbench: rank {self.rank} stopped responding for {task[1]:.0f} s while "
                f"{self.phase!r} ({task[0]}), {at}",
                file=sys.stderr,
                flush=True,
            )
            self.said = True
            # Only a torch.distributed call is bounded by the world's own timeout: a rank stuck
            # anywhere else, a wait on shm's node channel included (its bound is the replica
            # group's timeout, which can be far longer), ends itself and the launcher the rest.
            if not at.startswith(IN_COLLECTIVE):
                os._exit(SILENT_EXIT)


class JoinedWorld(NodesFoundAtStart):
    """This process as one rank of a launched world; ``run`` is collective over every rank."""

    def __init__(
        self, launch: Launch, backend: str = "gloo", device: str = "cpu", timeout_s: float = 120.0
    ) -> None:
        self.launch = launch
        self.world_size = launch.world_size or 1
        self.backend, self.device, self.timeout_s = backend, device, timeout_s
        self.ctx: RankContext | None = None
        self.start_s = 0.0

    def start(self) -> JoinedWorld:
        t0 = time.perf_counter()
        export_rendezvous(self.launch)
        adopt_worker_env()  # no-op unless started by the emulated-cluster driver
        if not dist.is_initialized():
            # gloo's own timeout sits past ours, so the silent rank names itself first.
            timeout = datetime.timedelta(seconds=self.timeout_s + 5)
            dist.init_process_group(self.backend, timeout=timeout)
        rank, self.world_size = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = device_for(self.backend, self.device, local)
        self.ctx = RankContext(
            rank, self.world_size, self.backend, device, link_counter=link_counter()
        )
        self.ctx.board = _Watchdog(rank)
        node_of_rank: list[Any] = [None] * self.world_size
        dist.all_gather_object(node_of_rank, node_of(os.environ, self.launch.via))
        self._nodes = group_by_node(node_of_rank)
        self.start_s = time.perf_counter() - t0
        return self

    def run(
        self, fn: RankFn, *args: Any, what: str = "", timeout_s: float | None = None
    ) -> list[Any] | None:
        """``fn(ctx, *args)`` on this rank; rank 0 gets every rank's result, the others None.
        An error raises WorldError naming this rank (the launcher sees the rank fail)."""
        ctx = self.ctx
        if ctx is None:
            raise WorldError("the joined world is not running (it was closed)")
        what = what or getattr(fn, "__name__", "task")
        ctx.board.arm(what, timeout_s or self.timeout_s)
        try:
            mine = fn(ctx, *args)
        except Exception as exc:
            first = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
            raise WorldError(
                f"rank {ctx.rank} failed in {what}: {first}\n--- traceback of rank "
                f"{ctx.rank} ---\n{traceback.format_exc()}"
            ) from exc
        finally:
            ctx.board.disarm()
        gathered = [None] * self.world_size if ctx.rank == 0 else None
        group = dist.new_group(backend="gloo") if self.backend != "gloo" else None
        dist.gather_object(mine, gathered, dst=0, group=group)
        if group is not None:  # one per job: a sweep would otherwise pile up transport threads
            dist.destroy_process_group(group)
        return gathered

    @property
    def alive(self) -> bool:
        return self.ctx is not None and dist.is_initialized()

    def close(self, kill: bool = False) -> None:
        """Destroy this rank's process groups (collective, like making them). Left to the
        interpreter's teardown, a gloo group can be destroyed while one of its threads is
        still joinable, and the rank aborts with ``terminate called without an active
        exception`` after a job that succeeded; torchrun then reports the whole run failed."""
        ctx, self.ctx = self.ctx, None
        try:
            if ctx is not None:
                ctx.release_groups()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the job's record is written; say, do not raise
            log.warning("leaving the joined world: %s", exc)
