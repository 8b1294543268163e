"""A ``bcastbench run`` job's composed config, checked and typed at the door (``JobConfig.of``):
which world the job runs on, the ``JobSpec`` every rank gets and the ``WorldSpec`` the world is
opened from. The composed DictConfig is read here and in what this calls (``harness.job.config``
checks it, ``harness.job.build`` reads the spec from it) and nowhere after: the rest of a job
(fitting it to the host, running it, writing its record) reads this value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from harness.job.build import from_run_config
from harness.job.config import ray_conf, validate
from harness.job.spec import JobSpec
from harness.worlds import launcher
from harness.worlds.emulated_network import EmulateConf
from harness.worlds.launcher import EMULATED, RAY, Launch, WorldSpec


@dataclass(frozen=True)
class JobConfig:
    """One job, typed: where it runs (``launch``), what every rank does (``spec``, its layout
    included) and the world it needs (``world``)."""

    launch: Launch
    spec: JobSpec
    world: WorldSpec

    @classmethod
    def of(cls, cfg, out_dir: Path | None = None) -> JobConfig:
        """The job ``cfg`` asks for on this process's launch (a forked world, a joined one
        under torchrun, Ray, the emulated cluster), checked first (``ConfigError`` names what
        is wrong); ``out_dir``: where an emulated cluster keeps its logs."""
        launch = launcher.current(emulate=bool(cfg.emulate.enabled), world=str(cfg.world))
        layout = validate(cfg, launch.world_size)
        spec = from_run_config(cfg, layout)
        return cls(launch, spec, world_spec(cfg, layout, launch, out_dir))


def world_spec(cfg, layout, launch: Launch, out_dir: Path | None = None) -> WorldSpec:
    """The ``WorldSpec`` of a validated job config on ``launch``'s world
    (``harness.worlds.opening.open_world`` opens it)."""
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
