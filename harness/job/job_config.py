"""A job's composed config, checked and typed at the door (a ``bcastbench run`` job's
``JobConfig.of``, a ``run target=dispatch`` job's ``DispatchConfig.of``):
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

from harness.job.build import from_dispatch_config, from_run_config
from harness.job.config import Checked, check, dispatch_ray_conf
from harness.job.spec import JobSpec
from harness.worlds import launcher
from harness.worlds.emulated_network import EmulateConf
from harness.worlds.launcher import EMULATED, RAY, Launch, WorldSpec
from harness.worlds.ray_cluster import RayConf


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
        checked = check(cfg, launch.world_size)
        spec = from_run_config(cfg, checked)
        return cls(launch, spec, world_spec(cfg, checked, launch, out_dir))


@dataclass(frozen=True)
class DispatchConfig:
    """A ``run target=dispatch`` job, typed at its door as ``JobConfig`` types a run job: the
    spec, the Ray world it runs on, where else its records go and the fields every record
    takes as they are."""

    spec: JobSpec
    ray: RayConf
    out: str | None
    record: dict

    @classmethod
    def of(cls, cfg) -> DispatchConfig:
        """The job ``cfg`` (``harness.commands.ray_dispatch.RayDispatchConf``, checked by
        ``harness.job.config.validate_dispatch`` before any job ran) asks for."""
        ray = dispatch_ray_conf(cfg)
        record = OmegaConf.to_container(cfg.record, resolve=True)
        return cls(from_dispatch_config(cfg, ray), ray, cfg.out, record)


def world_spec(cfg, checked: Checked, launch: Launch, out_dir: Path | None = None) -> WorldSpec:
    """The ``WorldSpec`` of a checked job config on ``launch``'s world
    (``harness.worlds.opening.open_world`` opens it)."""
    extra: dict[str, Any] = {}
    if launch.kind == RAY:
        extra["ray"] = checked.ray
    if launch.kind == EMULATED:
        conf = OmegaConf.to_object(cfg.emulate) if OmegaConf.is_config(cfg.emulate) else cfg.emulate
        if not isinstance(conf, EmulateConf):  # a job config composed without the schema
            conf = EmulateConf(**conf)
        extra.update(emulate=conf, log_dir=out_dir)
    return WorldSpec(
        launch, checked.layout.world_size, cfg.backend.name, cfg.backend.device, float(cfg.timeout_s),
        **extra,
    )  # fmt: skip
