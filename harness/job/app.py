"""The Hydra task of ``bcastbench run``: one job, read straight through.

    JobConfig.of (the launch, detected once per process; the config checked once; the job
    spec and the world spec: nothing after reads the config) → fitted to the host → run_job
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
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from harness.errors import VerificationError
from harness.job import records
from harness.job.config import validate  # noqa: F401 -- what run.py checks every job with
from harness.job.execute import RESULT_FILE, run_job
from harness.job.fits import fitted
from harness.job.job_config import JobConfig
from harness.job.records import job_line
from harness.job.results import Refusal
from harness.job.verdict import records_beside
from harness.machine import host_cores
from harness.worlds import launcher as launchers
from harness.worlds.protocol import JOB_FAILURES

log = logging.getLogger("bcastbench")
"""Hydra points it at the terminal and at the job's ``bcastbench.log`` (conf/config.yaml)."""


_WARNED: set[int] = set()


def _warn_oversubscribed(layout) -> None:
    """Once per world size: more than two ranks per CPU time the CPUs' sharing as much as the
    transport (at up to two, ranks mostly wait on each other's messages in turn)."""
    cpus = host_cores()
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


def _recorded_failures(launch: launchers.Launch, multirun: bool) -> tuple[type[BaseException], ...]:
    """Which failures a job records instead of raising: a sweep's job leaves a record saying
    it failed and the next job runs; a single run ends the command with the error. A joined
    rank cannot tell its own failure from a peer's (a crashed peer reaches it as a collective
    error), so it records only wrong data; the launcher (torchrun, srun) reports which rank
    exited and fails the job."""
    if not multirun or not launch.writes_records:
        return ()
    return (VerificationError,) if launch.kind == launchers.JOINED else JOB_FAILURES


def _refused(spec, why: str, out_dir: Path, multirun: bool) -> dict:
    """A job refused before any rank started (it would not fit this host's memory): its one
    line on the terminal and in the log, and a record saying so (``status: unsupported``)."""
    record = records.complete(records.build(spec, Refusal(why)))
    records.write_atomic(out_dir / RESULT_FILE, record)
    line = job_line(record, records_beside(out_dir))
    if multirun:
        _to_job_log(line)  # the sweep prints its own line for it
    else:
        log.info(f"{line}\nrecord: {out_dir / RESULT_FILE}")
    return record


def run(cfg) -> dict | None:
    """Run one job; returns its record (None on ranks other than a joined world's rank 0)."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    out_dir = Path(hydra_cfg.runtime.output_dir)
    job = JobConfig.of(cfg, out_dir)  # nothing below reads cfg
    launch, spec = job.launch, job.spec
    launchers.quiet_other_ranks(launch)
    if launch.kind != launchers.JOINED:
        _warn_oversubscribed(spec.layout)
    fits = fitted(spec, on_this_host=launch.kind in (launchers.FORKED, launchers.EMULATED))
    if isinstance(fits, str):
        return _refused(spec, fits, out_dir, multirun)
    record = run_job(job.world, fits, out_dir, _recorded_failures(launch, multirun))
    if record is None:
        return None
    line = job_line(record, records_beside(out_dir))
    if multirun:
        _to_job_log(line)  # a failed one is a row of the sweep's table, counted
    else:
        log.info(f"{line}\nrecord: {out_dir / 'result.json'}")
    return record
