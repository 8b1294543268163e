"""The Hydra task of ``bcastbench run``: one job, read straight through.

    launcher (detected once per process) → validate (once) → job spec → launch → summarize
    → record (atomically, into the job's output directory)

The worlds (``harness.worlds.launcher``, chosen once by ``launch.detect``): a forked local world, a
world a launcher started this process in (torchrun, a submitit job, a plain ``srun`` step: every
task runs this whole task with one shared output directory and only global rank 0 writes the
record and the log), or an emulated multi-node cluster (``emulate.enabled=true``), or a world of
Ray actors (``world=ray``, where ``ray.dispatch`` makes the job time dispatch from the driver
too). A job of a sweep that fails (a rank crashed, hung or ended with wrong data) leaves a
record saying so (``status: failed``, the error), the next job still runs and the failure is
counted (``harness.report.progress``); a single run that fails ends the command with the error and
leaves no record.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from harness.job import execute, records
from harness.job.broadcast import JobSpec, summarize
from harness.job.config import strategy_of, validate, workload_of
from harness.job.records import job_line
from harness.job.rounds import VerificationError
from harness.payload import source
from harness.worlds import launcher as launchers
from harness.worlds.forked import WorldError

JOB_FAILURES = (WorldError, VerificationError)
"""What a job that ran but did not succeed raises (as opposed to a bad config or a bug)."""

log = logging.getLogger("bcastbench")
"""Hydra points it at the terminal and at the job's ``bcastbench.log`` (conf/config.yaml)."""


_WARNED: set[int] = set()


def _warn_oversubscribed(layout) -> None:
    """Once per world size: more than two ranks per CPU time the CPUs' sharing as much as the
    transport (at up to two, ranks mostly wait on each other's messages in turn)."""
    cpus = os.cpu_count() or 1
    if layout.world_size <= 2 * cpus or layout.world_size in _WARNED:
        return
    _WARNED.add(layout.world_size)
    log.warning(
        f"bcastbench: warning: {layout.describe()} starts {layout.world_size} ranks on "
        f"{cpus} CPUs ({layout.world_size / cpus:.0f} ranks per CPU): the figures measure CPU "
        "contention as much as the transport; compare strategies within one job only"
    )


def _to_job_log(line: str) -> None:
    """A sweep job's line into its own ``bcastbench.log`` only: the sweep already prints one
    line per job on the terminal (``harness.report.progress``)."""
    entry = log.makeRecord(log.name, logging.INFO, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(entry)


def _seq_len(cfg) -> int | None:
    """Tokens per row as the job's batch has them: the config's for a generated payload, the
    recording's own for a recorded one (validation has read the file, so this cannot fail
    where the job would not)."""
    p = cfg.payload
    if p.name not in source.RECORDED:
        return int(p.seq_len)
    path = source.path_of(p.name, p.get("path"))
    return source.recorded_seq_len(
        p.name, path, int(p.seed), bool(p.get("trust", False)), p.get("max_bytes")
    )


def spec_of(cfg, layout) -> JobSpec:
    """Everything a rank needs, read from the validated config once."""
    return JobSpec(
        strategy=strategy_of(cfg),
        layout=layout,
        payload=cfg.payload.name,
        payload_path=source.path_of(cfg.payload.name, cfg.payload.get("path")),
        payload_trust=bool(cfg.payload.get("trust", False)),
        payload_max_bytes=cfg.payload.get("max_bytes"),
        batch_size=int(cfg.payload.batch_size),
        seq_len=(seq_len := _seq_len(cfg)),
        broadcast_non_tensor=cfg.payload.broadcast_non_tensor,
        seed=int(cfg.payload.seed),
        iters=int(cfg.iters),
        warmup=int(cfg.warmup),
        references=tuple(cfg.references),
        options=OmegaConf.to_container(cfg.strategy.options, resolve=True) or {},
        fault_rank=int(cfg.fault.rank),
        fault_at_iter=int(cfg.fault.at_iter),
        fault_kind=str(cfg.fault.kind),
        # Counted only where the rank context carries the emulated links' counter.
        link_bytes_calls=int(cfg.emulate.bytes_calls) if cfg.emulate.enabled else 0,
        backend=cfg.backend.name,
        device=cfg.backend.device,
        world=str(cfg.world),
        dispatch=str(cfg.ray.dispatch) if cfg.world == launchers.RAY else "none",
        workload=workload_of(cfg, layout, seq_len),
        steady_iters=int(cfg.steady_iters),
    )


def _launch(launch: launchers.Launch, cfg, spec: JobSpec, out_dir: Path):
    world_spec = execute.world_spec(cfg, spec.layout, launch, out_dir)
    return execute.run_job(launchers.open_world(world_spec), spec, world_spec.timeout_s)


def run(cfg) -> dict | None:
    """Run one job; returns its record (None on ranks other than a joined world's rank 0)."""
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    launch = launchers.current(emulate=bool(cfg.emulate.enabled), world=str(cfg.world))
    launchers.quiet_other_ranks(launch)
    layout = validate(cfg, launch.world_size)
    if launch.kind != launchers.JOINED:
        _warn_oversubscribed(layout)
    spec = spec_of(cfg, layout)
    try:
        ran = _launch(launch, cfg, spec, out_dir)
        if ran is None:
            return None
        summary = ran.summary if ran.summary is not None else summarize(spec, ran.results)
        record = {**records.build(spec, summary, ran.world_start_s), **ran.fields}
    except JOB_FAILURES as exc:
        if hydra_cfg.mode != RunMode.MULTIRUN or not launch.writes_records:
            raise  # a single run: the command's error says what failed; no record
        if launch.kind == launchers.JOINED and isinstance(exc, WorldError):
            # A joined rank cannot tell its own failure from a peer's (a crashed peer reaches
            # it as a collective error), so it writes no record blaming itself; the launcher
            # (torchrun, srun) reports which rank exited and fails the job.
            raise
        record = records.complete(records.failed(spec, exc))
        records.write_atomic(out_dir / "result.json", record)
        _to_job_log(job_line(record))
        return record  # a row of the sweep's table, counted as failed; the next job runs
    record = records.complete(record)
    path = records.write_atomic(out_dir / "result.json", record)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        _to_job_log(job_line(record))
    else:
        log.info(f"{job_line(record)}\nrecord: {path}")
    return record
