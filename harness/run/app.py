"""The Hydra task: validate a job, run it on a world (started here, or joined under torchrun or
a Slurm/submitit launcher), summarize, and write its record atomically into the job's output
directory. With ``emulate.enabled=true`` the driver runs the job on an emulated multi-node
cluster instead (``harness.cluster.launch``).

Under the submitit launcher (``hydra/launcher=slurm|local``) every task of a job runs this
whole Hydra job with one shared output directory: ``submitit.helpers.TorchDistributedEnvironment
().export()`` turns the task into a torch ``env://`` rank, and only global rank 0 writes the
record and the job's log file. A plain ``srun -n N python -m harness ...`` step (N ≥ 2) works
the same way from the step's Slurm variables (``launched_by_srun``).
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from harness.run import records
from harness.run.config import ConfigError, validate
from harness.run.runner import JobSpec, run_job_on_rank, summarize
from harness.run.world import RankContext, WorldError, _device_for, get_world


def under_torchrun() -> bool:
    """torchrun (elastic agent) sets TORCHELASTIC_RUN_ID; a bare RANK/WORLD_SIZE also counts."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def launched_by_submitit() -> bool:
    """True in a task of a submitit job with several tasks (Slurm, or submitit's local
    executor); exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT for env:// as a side
    effect. A one-task job runs a local world like a plain run."""
    if "SUBMITIT_EXECUTOR" not in os.environ or "RANK" in os.environ:
        return False
    import submitit

    if submitit.JobEnvironment().num_tasks < 2:
        return False
    # One rank per task: every task already is a process of the world, nothing to spawn.
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True


def launched_by_srun() -> bool:
    """True in one task of a plain ``srun`` step of two or more tasks (no submitit, no
    torchrun): exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and MASTER_ADDR/PORT
    (the step's first node; a port derived from the job and step ids) for env://."""
    env = os.environ
    if "RANK" in env or "SLURM_STEP_ID" not in env:
        return False
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1"))
    if tasks < 2:
        return False
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
    step = int(env["SLURM_STEP_ID"]) if env["SLURM_STEP_ID"].isdigit() else 0
    env.update(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=str(tasks),
        LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
        LOCAL_WORLD_SIZE=per_node.group(0) if per_node else str(tasks),
        MASTER_ADDR=hosts[0],
        # Every task derives the same port; jobs and steps on one node get different ones.
        MASTER_PORT=str(20000 + (int(env.get("SLURM_JOB_ID", "0")) * 16 + step) % 20000),
    )
    return True


def _quiet_non_zero_rank() -> None:
    # Every task of a submitit job shares the job's directory; Hydra has pointed each task's
    # root logger at the same <job>.log, which must hold rank 0's lines only.
    if int(os.environ.get("RANK", 0)) == 0:
        return
    import logging

    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()


def spec_of(cfg, layout) -> JobSpec:
    return JobSpec(
        strategy=cfg.strategy.name,
        layout=layout,
        payload=cfg.payload.name,
        batch_size=int(cfg.payload.batch_size),
        seq_len=int(cfg.payload.seq_len),
        broadcast_non_tensor=cfg.payload.broadcast_non_tensor,
        seed=int(cfg.payload.seed),
        iters=int(cfg.iters),
        warmup=int(cfg.warmup),
        references=tuple(cfg.references),
        options=OmegaConf.to_container(cfg.strategy.options, resolve=True) or {},
        fault_rank=int(cfg.fault.rank),
        fault_at_iter=int(cfg.fault.at_iter),
        fault_kind=str(cfg.fault.kind),
        link_bytes_calls=_link_bytes_calls(cfg),
    )


def _link_bytes_calls(cfg) -> int:
    # Only workers started by the emulated-cluster driver can read the node links' counters.
    from harness.cluster.launch import LINKS_ENV

    if "emulate" not in cfg or not os.environ.get(LINKS_ENV):
        return 0
    return int(cfg.emulate.bytes_calls)


def _run_torchrun(cfg, spec: JobSpec) -> tuple[list[dict] | None, float]:
    """Every torchrun process runs this; rank 0 gets all ranks' results."""
    t0 = time.perf_counter()
    from harness.cluster.launch import adopt_worker_env

    adopt_worker_env()  # no-op unless started by the emulated-cluster driver
    if not dist.is_initialized():
        dist.init_process_group(
            cfg.backend.name, timeout=datetime.timedelta(seconds=float(cfg.timeout_s) + 5)
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    validate(cfg, world)
    device = _device_for(cfg.backend.name, cfg.backend.device, int(os.environ.get("LOCAL_RANK", 0)))
    ctx = _TORCHRUN_CTX.get("ctx")
    if ctx is None or ctx.world_size != world:
        ctx = RankContext(rank, world, cfg.backend.name, device)
        _TORCHRUN_CTX["ctx"] = ctx
    start_s = time.perf_counter() - t0
    mine = run_job_on_rank(ctx, spec)
    gathered = [None] * world if rank == 0 else None
    group = dist.new_group(backend="gloo") if cfg.backend.name != "gloo" else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    if group is not None:  # one per job: a sweep would otherwise pile up transport threads
        dist.destroy_process_group(group)
    return gathered, start_s


_TORCHRUN_CTX: dict = {}


def run(cfg) -> dict | None:
    """Run one job; returns its record (None on torchrun ranks other than 0)."""
    layout_name = HydraConfig.get().runtime.choices.get("layout", "custom")
    if launched_by_submitit() or launched_by_srun() or under_torchrun():
        _quiet_non_zero_rank()
        layout = validate(cfg, int(os.environ["WORLD_SIZE"]))
        spec = spec_of(cfg, layout)
        results, start_s = _run_torchrun(cfg, spec)
        if results is None:
            return None
    elif "emulate" in cfg and cfg.emulate.enabled:
        from harness.cluster.launch import run_emulated

        layout = validate(cfg)
        hydra_cfg = HydraConfig.get()
        out_dir = Path(hydra_cfg.runtime.output_dir)
        record = run_emulated(cfg, layout, list(hydra_cfg.overrides.task), out_dir)
        record["command"] = records.environment()["command"]
        records.write_atomic(out_dir / "result.json", record)
        return record
    else:
        layout = validate(cfg)
        spec = spec_of(cfg, layout)
        world = get_world(
            layout.world_size, cfg.backend.name, cfg.backend.device, float(cfg.timeout_s)
        )
        start_s = world.start_s
        world.start_s = 0.0  # paid once; later jobs on this world started nothing
        results = world.run(run_job_on_rank, spec, what=f"job {spec.strategy} on {layout_name}")
    summary = summarize(spec, results)
    record = records.build(cfg, layout, spec, summary, layout_name, start_s)
    mine = summary.get("strategies", {}).get(spec.strategy, {})
    if "cross_node_bytes_per_call" in mine:  # emulated-cluster workers (harness.cluster.launch)
        record["cross_node_bytes_per_call"] = mine["cross_node_bytes_per_call"]
    out = Path(HydraConfig.get().runtime.output_dir) / "result.json"
    records.write_atomic(out, record)
    return record


__all__ = ["ConfigError", "WorldError", "run", "torch"]
