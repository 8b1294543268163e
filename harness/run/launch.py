"""Who runs a job's ranks, decided once per process, and how each launcher runs one job.

Three launchers, one question each answers: *where are the ranks?*

* ``forked``: nobody launched us as a rank, so this process forks a local world
  (``harness.run.world``) and the ranks serve the job; the driver gets every rank's result.
* ``joined``: a launcher already started this process as one rank of a world (``torchrun``, a
  submitit job of several tasks, or a plain ``srun`` step of several tasks); every rank runs the
  job and global rank 0 gets every rank's result.
* ``ray`` (``world=ray``): like ``forked``, but the ranks are Ray actors in a placement group
  (``harness.ray.world``); with ``ray.dispatch`` set, the job times Ray dispatch plus the
  broadcast instead (``harness.ray.dispatch``) and hands back a finished record.
* ``emulated``: ``emulate.enabled=true`` and not already a rank: the driver builds an emulated
  multi-node cluster and runs the job there as a joined world one level down
  (``harness.cluster.launch``); its rank 0 summarizes, and the driver returns that record with
  the cluster's shape added.

``detect`` is a pure function of the environment (tested from plain dicts); ``current`` calls
it once per process, before anything here exports the variables ``env://`` needs.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
import os
import re
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

FORKED, JOINED, EMULATED, RAY = "forked", "joined", "emulated", "ray"

_SUBMITIT_TASKS = {"slurm": "SLURM_NTASKS", "local": "SUBMITIT_LOCAL_NTASKS"}
_SUBMITIT_RANK = {"slurm": "SLURM_PROCID", "local": "SUBMITIT_LOCAL_GLOBALID"}


@dataclass(frozen=True)
class Launch:
    """Where this job's ranks come from."""

    kind: str
    """forked | joined | emulated."""
    via: str
    """local (forked), torchrun | submitit | srun (joined), emulated."""
    rank: int = 0
    """This process's global rank (0 for the drivers of forked and emulated jobs)."""
    world_size: int | None = None
    """The world a joined launcher started; None where the layout decides the world."""

    @property
    def writes_records(self) -> bool:
        """Only global rank 0 owns the job's directory, its log and its record."""
        return self.rank == 0


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key, "")
    return int(value) if value.isdigit() else default


def detect(env: Mapping[str, str], emulate: bool = False) -> Launch:
    """The launcher, from environment variables alone (nothing is exported or imported).

    torchrun's variables win (a torchrun inside an allocation is still torchrun), then a
    submitit job of two or more tasks, then a plain ``srun`` step of two or more tasks; a
    one-task job of either runs a local world like a plain run."""
    if "TORCHELASTIC_RUN_ID" in env or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= env.keys():
        return Launch(JOINED, "torchrun", _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1))
    executor = env.get("SUBMITIT_EXECUTOR", "")
    if executor:
        tasks = _int(env, _SUBMITIT_TASKS.get(executor, ""), 1)
        if tasks >= 2:
            return Launch(JOINED, "submitit", _int(env, _SUBMITIT_RANK.get(executor, ""), 0), tasks)
    elif "SLURM_STEP_ID" in env:
        tasks = _int(env, "SLURM_STEP_NUM_TASKS", 1)
        if tasks >= 2:
            return Launch(JOINED, "srun", _int(env, "SLURM_PROCID", 0), tasks)
    if emulate:
        return Launch(EMULATED, "emulated")
    return Launch(FORKED, "local")


@functools.cache
def _this_process() -> Launch:
    return detect(dict(os.environ))


def current(emulate: bool = False) -> Launch:
    """This process's launcher: the environment is read on the first call only (later calls,
    a sweep's next job included, see the same answer); ``emulate`` turns a would-be forked
    world into an emulated one, and leaves a rank that already is one alone."""
    here = _this_process()
    return replace(here, kind=EMULATED, via="emulated") if emulate and here.kind == FORKED else here


# -- joining a world a launcher started ------------------------------------------------------
def export_rendezvous(launch: Launch, env=os.environ) -> None:
    """Export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT for ``env://`` where the launcher
    did not (submitit, srun); torchrun already did."""
    if launch.via == "submitit" and "RANK" not in env:
        import submitit

        # One rank per task: every task already is a process of the world, nothing to spawn.
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    elif launch.via == "srun" and "RANK" not in env:
        env.update(_srun_rendezvous(env, launch.world_size or 1))


def _srun_rendezvous(env, tasks: int) -> dict[str, str]:
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
    step = _int(env, "SLURM_STEP_ID", 0)
    return dict(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=str(tasks),
        LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
        LOCAL_WORLD_SIZE=per_node.group(0) if per_node else str(tasks),
        MASTER_ADDR=hosts[0],
        MASTER_PORT=str(20000 + (_int(env, "SLURM_JOB_ID", 0) * 16 + step) % 20000),
    )


def quiet_other_ranks(launch: Launch) -> None:
    """Every task of a submitit job shares the job's directory, and Hydra pointed each task's
    root logger at the same ``bcastbench.log``, which must hold rank 0's lines only."""
    if launch.kind != JOINED or launch.writes_records:
        return
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()


def prompt_slurm_failures() -> None:
    """submitit polls sacct with a back-off of up to 10 min (SlurmJob.watcher), so a job whose
    rank crashed can sit unnoticed for minutes; poll at least every BCASTBENCH_SLURM_POLL_S
    (default 10 s) instead, so a failed sweep fails within seconds."""
    try:
        from submitit.slurm import slurm
    except ImportError:
        return
    slurm.SlurmJob.watcher._delay_s = float(os.environ.get("BCASTBENCH_SLURM_POLL_S", "10"))


# -- the three launchers ---------------------------------------------------------------------
@dataclass
class Ran:
    """What a launcher hands back on the process that writes the record."""

    results: list[dict] | None = None
    """Every rank's result of ``runner.run_job_on_rank``, in rank order."""
    world_start_s: float = 0.0
    """Seconds spent starting (or joining) the world for this job; 0 for a reused world."""
    record: dict | None = None
    """A finished record instead of results (the emulated launcher's rank 0 made it)."""


def run_forked(cfg, spec) -> Ran:
    """Start (or reuse, within one sweep) a forked world of the layout's size; run the job."""
    from harness.run.records import layout_name
    from harness.run.runner import run_job_on_rank
    from harness.run.world import get_world

    world = get_world(spec.layout.world_size, spec.backend, spec.device, float(cfg.timeout_s))
    start_s, world.start_s = world.start_s, 0.0  # paid once; later jobs on it started nothing
    what = f"job {spec.strategy} on {layout_name(spec.layout)}"
    return Ran(world.run(run_job_on_rank, spec, what=what), start_s)


_RAY: dict = {}
"""The Ray world of this process (one at most: a process holds one Ray session), kept across a
sweep's jobs while its size and settings match, closed at exit."""


def ray_world(world_size: int, conf):
    """Start (or reuse) this process's Ray world of ``world_size`` ranks and ``conf``
    (``RayConf``; its ``dispatch`` is ignored: the world serves every mode); a world of another
    shape, or one a failed job tore down, is closed and replaced."""
    import atexit

    from harness.ray.world import RayWorld

    key = (world_size, replace(conf, dispatch="none"))
    world = _RAY.get("world")
    if world is not None and world.alive and _RAY.get("key") == key:
        return world
    close_ray()
    world = _RAY["world"] = RayWorld(world_size, key[1]).start()
    _RAY["key"] = key
    atexit.register(close_ray)
    return world


def close_ray(kill: bool = False) -> None:
    """Close this process's Ray world, if any: Ray shut down, every process it started gone
    (``kill``: at once, for an interrupted command, without waiting for ranks to leave)."""
    world = _RAY.pop("world", None)
    _RAY.pop("key", None)
    if world is not None:
        world.close(kill=kill)


def run_ray(cfg, spec) -> Ran:
    """The job on a Ray world: the forked world's rank-side job, or (``ray.dispatch``) dispatch
    from the driver's global batch through ``harness.ray.dispatch.run_dispatch``."""
    from harness.run.config import ray_conf
    from harness.run.records import build_dispatch, layout_name
    from harness.run.runner import run_job_on_rank

    world = ray_world(spec.layout.world_size, ray_conf(cfg))
    start_s, world.start_s = world.start_s, 0.0  # paid once; later jobs on it started nothing
    if spec.dispatch == "none":
        what = f"job {spec.strategy} on {layout_name(spec.layout)}"
        return Ran(world.run(run_job_on_rank, spec, what=what), start_s)
    from harness.ray.dispatch import DispatchSpec, run_dispatch

    mode = f"leader:{spec.strategy}" if spec.dispatch == "leader" else "all_ranks"
    fields = ("payload", "batch_size", "seq_len", "broadcast_non_tensor", "seed", "iters")
    dispatch = DispatchSpec(
        spec.layout,
        (mode,),
        **{name: getattr(spec, name) for name in fields},
        warmup=spec.warmup,
        timeout_s=float(cfg.timeout_s),
        options=dict(spec.options),
    )
    return Ran(record=build_dispatch(spec, run_dispatch(world, dispatch), start_s))


def run_joined(cfg, spec, launch: Launch) -> Ran | None:
    """Every rank of a launched world runs this; rank 0 gets all ranks' results, the others
    None. The emulated cluster's link counter, when this rank runs on one, rides along as the
    context's hook."""
    import torch.distributed as dist

    from harness.cluster.launch import adopt_worker_env, link_counter
    from harness.run.runner import run_job_on_rank
    from harness.run.world import RankContext, _device_for

    t0 = time.perf_counter()
    export_rendezvous(launch)
    adopt_worker_env()  # no-op unless started by the emulated-cluster driver
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(cfg.timeout_s) + 5)
        dist.init_process_group(spec.backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = _JOINED.get("ctx")
    if ctx is None or ctx.world_size != world:
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = _device_for(spec.backend, spec.device, local)
        ctx = _JOINED["ctx"] = RankContext(
            rank, world, spec.backend, device, link_counter=link_counter()
        )
        if not _JOINED.get("leaves"):
            atexit.register(leave_joined)
            _JOINED["leaves"] = True
    start_s = time.perf_counter() - t0
    mine = run_job_on_rank(ctx, spec)
    gathered = [None] * world if rank == 0 else None
    group = dist.new_group(backend="gloo") if spec.backend != "gloo" else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    if group is not None:  # one per job: a sweep would otherwise pile up transport threads
        dist.destroy_process_group(group)
    return Ran(gathered, start_s) if rank == 0 else None


_JOINED: dict = {}
"""The joined world's RankContext, kept across a sweep's jobs in one process."""


def leave_joined() -> None:
    """Destroy this rank's process groups before the interpreter ends (registered at exit by
    the first joined job). Left to the interpreter's teardown, a gloo group can be destroyed
    while one of its threads is still joinable, and the rank aborts with ``terminate called
    without an active exception`` after a job that succeeded; torchrun then reports the whole
    run failed."""
    import torch.distributed as dist

    ctx = _JOINED.pop("ctx", None)
    try:
        if ctx is not None:
            ctx.release_groups()
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the job's record is written; say, do not raise
        logging.getLogger("bcastbench").warning("leaving the joined world: %s", exc)


def run_emulated(cfg, spec, overrides: list[str], out_dir: Path) -> Ran:
    """The whole job on an emulated multi-node cluster (``harness.cluster.launch``)."""
    from harness.cluster.launch import run_emulated as launch_on_cluster

    return Ran(record=launch_on_cluster(cfg, spec.layout, overrides, out_dir))
