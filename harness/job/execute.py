"""How a job runs on a world: the ``WorldSpec`` its validated config asks for, and
``run_job``, which runs the job on a world and hands back what it measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from harness.job.broadcast import run_job_on_rank
from harness.job.config import ray_conf
from harness.job.dispatch import run_dispatch
from harness.job.records import layout_name
from harness.worlds.emulated_network import EmulateConf
from harness.worlds.launcher import EMULATED, RAY, Launch, WorldSpec
from harness.worlds.protocol import World


def world_spec(cfg, layout, launch: Launch, out_dir: Path | None = None) -> WorldSpec:
    """The ``WorldSpec`` of a validated job config on ``launch``'s world."""
    extra: dict[str, Any] = {}
    if launch.kind == RAY:
        extra["ray"] = ray_conf(cfg)
    if launch.kind == EMULATED:
        conf = OmegaConf.to_object(cfg.emulate) if OmegaConf.is_config(cfg.emulate) else cfg.emulate
        if not isinstance(conf, EmulateConf):  # a job config composed without the schema
            conf = EmulateConf(**conf)
        extra.update(emulate=conf, log_dir=out_dir)
    return WorldSpec(
        launch, layout.world_size, cfg.backend.name, cfg.backend.device, float(cfg.timeout_s),
        **extra,
    )  # fmt: skip


@dataclass
class JobOutcome:
    """What a world hands back on the process that writes the record."""

    results: list[dict] | None = None
    """Every rank's result of ``runner.run_job_on_rank``, in rank order."""
    world_start_s: float = 0.0
    """Seconds spent starting (or joining) the world for this job; 0 for a reused world."""
    summary: dict | None = None
    """A dispatch job's summary instead of results (its driver ran the phases)."""
    fields: dict = field(default_factory=dict)
    """What the record takes from the world (``World.record_fields``)."""


def run_job(world: World, spec, timeout_s: float) -> JobOutcome | None:
    """Run the job ``spec`` (a ``runner.JobSpec``) on ``world``: a broadcast job's phases on
    every rank, or (``ray.dispatch``) a dispatch job's on the driver. None on a joined world's
    ranks other than 0."""
    start_s, world.start_s = world.start_s, 0.0  # paid once; later jobs on it started nothing
    if spec.dispatch != "none":
        return JobOutcome(
            None, start_s, run_dispatch(world, spec, timeout_s), world.record_fields()
        )
    what = f"job {spec.strategy} on {layout_name(spec.layout)}"
    results = world.run(run_job_on_rank, spec, what=what, timeout_s=timeout_s)
    return None if results is None else JobOutcome(results, start_s, fields=world.record_fields())
