"""Which world runs a job's ranks, decided in one place (``detect``), and the live world of
each kind (``open_world``).

Four worlds, one question each answers: *where are the ranks?* (each a
``harness.worlds.protocol.World``):

* ``forked``: nobody launched us as a rank, so this process forks a local world
  (``harness.worlds.forked.ForkedWorld``) and the ranks serve the job; the driver gets every
  rank's result.
* ``joined``: a launcher already started this process as one rank of a world (``torchrun``, a
  submitit job of several tasks, or a plain ``srun`` step of several tasks); every rank runs the
  job and global rank 0 gets every rank's result (``harness.worlds.joined.JoinedWorld``).
* ``ray`` (``world=ray``): like ``forked``, but the ranks are Ray actors in a placement group
  (``harness.worlds.ray_world.RayWorld``); with ``ray.dispatch`` set, the job times Ray dispatch plus
  the broadcast instead: the same phases run on the driver (``harness.job.dispatch``), which
  hands back the job's summary.
* ``emulated``: ``emulate.enabled=true`` and not already a rank: the driver builds an emulated
  multi-node cluster and runs the job there as a joined world one level down
  (``harness.worlds.emulated.EmulatedWorld``); the record gets the cluster's shape added.

``detect`` is a pure function of the environment and the two config choices (``world``,
``emulate.enabled``), tested from plain dicts; ``current`` reads the environment once per
process, before anything here exports the variables ``env://`` needs. A ``WorldSpec`` is what a
world is made from (``harness.job.job_config.world_spec`` reads it from a job's config);
``open_world`` reuses the live world of that spec or starts one
(``harness.worlds.protocol.REGISTRY``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from harness.errors import ConfigError
from harness.worlds.emulated_network import EmulateConf
from harness.worlds.protocol import REGISTRY

if TYPE_CHECKING:  # an annotation only; the Ray world is imported when one is opened
    from harness.worlds.ray_cluster import RayConf

FORKED, JOINED, EMULATED, RAY = "forked", "joined", "emulated", "ray"

_SUBMITIT_TASKS = {"slurm": "SLURM_NTASKS", "local": "SUBMITIT_LOCAL_NTASKS"}
_SUBMITIT_RANK = {"slurm": "SLURM_PROCID", "local": "SUBMITIT_LOCAL_GLOBALID"}


@dataclass(frozen=True)
class Launch:
    """Where this job's ranks come from."""

    kind: str
    """forked | joined | emulated | ray."""
    via: str
    """local (forked), torchrun | submitit | srun (joined), emulated, ray."""
    rank: int = 0
    """This process's global rank (0 for the drivers of forked, emulated and Ray jobs)."""
    world_size: int | None = None
    """The world a joined launcher started; None where the layout decides the world."""

    @property
    def writes_records(self) -> bool:
        """Only global rank 0 owns the job's directory, its log and its record."""
        return self.rank == 0


def env_int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key, "")
    return int(value) if value.isdigit() else default


def _launched(env: Mapping[str, str]) -> Launch | None:
    """The world a launcher started this process in, or None. torchrun's variables win (a
    torchrun inside an allocation is still torchrun), then a submitit job of two or more tasks,
    then a plain ``srun`` step of two or more tasks; a one-task job of either is no world."""
    if "TORCHELASTIC_RUN_ID" in env or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= env.keys():
        return Launch(JOINED, "torchrun", env_int(env, "RANK", 0), env_int(env, "WORLD_SIZE", 1))
    executor = env.get("SUBMITIT_EXECUTOR", "")
    if executor:
        tasks = env_int(env, _SUBMITIT_TASKS.get(executor, ""), 1)
        if tasks >= 2:
            rank = env_int(env, _SUBMITIT_RANK.get(executor, ""), 0)
            return Launch(JOINED, "submitit", rank, tasks)
    elif "SLURM_STEP_ID" in env:
        tasks = env_int(env, "SLURM_STEP_NUM_TASKS", 1)
        if tasks >= 2:
            return Launch(JOINED, "srun", env_int(env, "SLURM_PROCID", 0), tasks)
    return None


def detect(env: Mapping[str, str], emulate: bool = False, world: str = FORKED) -> Launch:
    """The one choice of world, from environment variables (nothing is exported or imported)
    and the config's ``emulate.enabled`` and ``world``: a launched world first (its ranks run
    the job whatever the config asks; validation refuses ``world=ray`` there), then the
    emulated cluster, then Ray, then a forked local world."""
    launched = _launched(env)
    if launched is not None:
        return launched
    if emulate:
        return Launch(EMULATED, "emulated")
    if world == RAY:
        return Launch(RAY, "ray")
    return Launch(FORKED, "local")


@functools.cache
def _environment() -> tuple[tuple[str, str], ...]:
    return tuple(os.environ.items())


def current(emulate: bool = False, world: str = FORKED) -> Launch:
    """This process's world (``detect``): the environment is read on the first call only
    (later calls, a sweep's next job included, see the same environment, whatever a joined
    rank exported since)."""
    return detect(dict(_environment()), emulate=emulate, world=world)


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
    (default 10 s) instead, so a failed sweep fails within seconds. A job that ended without a
    result is then waited on for BCASTBENCH_SLURM_RESULT_WAIT_S (default: submitit's own 15 s,
    its margin for a shared filesystem that shows a result file late)."""
    try:
        from submitit.slurm import slurm
    except ImportError:
        return
    slurm.SlurmJob.watcher._delay_s = _seconds_from_env("BCASTBENCH_SLURM_POLL_S", "10")
    if "BCASTBENCH_SLURM_RESULT_WAIT_S" in os.environ:
        slurm.SlurmJob._results_timeout_s = _seconds_from_env("BCASTBENCH_SLURM_RESULT_WAIT_S")


def _seconds_from_env(name: str, default: str = "") -> float:
    """The number of seconds the environment variable ``name`` gives (else ``default``)."""
    text = os.environ.get(name, default)
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:
        raise ConfigError(f"{name}={text!r}: expected a number of seconds >= 0, e.g. 10")
    return seconds


# -- the typed spec a world is made from, and the one cache of live worlds ------------------
@dataclass(frozen=True)
class WorldSpec:
    """Everything a world is made from, read from the validated config once."""

    launch: Launch
    """The choice (``detect``): its kind names the world."""
    world_size: int
    backend: str = "gloo"
    device: str = "cpu"
    timeout_s: float = 120.0
    """No progress for this long fails the job (every world; see ``harness.worlds.protocol``)."""
    ray: RayConf | None = None
    """A Ray world's settings (with the job's backend, device and timeout)."""
    emulate: EmulateConf | None = None
    """An emulated cluster's settings."""
    log_dir: Path | None = None
    """Where an emulated cluster's agents write their logs (the job's output directory)."""

    @property
    def kind(self) -> str:
        return self.launch.kind

    @property
    def reuse_key(self) -> tuple:
        """What makes a live world reusable for this spec: its kind and shape, a Ray world's
        settings (not the job's dispatch mode: the world serves every mode), an emulated
        cluster's settings and log directory (one cluster per job). Not the timeout: each job
        passes its own, and ``open_world`` restarts a world whose collectives would time out
        first."""
        key = (self.kind, self.world_size, self.backend, self.device)
        if self.kind == RAY:
            return (*key, astuple(replace(self.ray, dispatch="none")))
        if self.kind == EMULATED:
            return (*key, astuple(self.emulate), str(self.log_dir))
        return key


def forked_spec(world_size: int, timeout_s: float = 120.0) -> WorldSpec:
    """A forked gloo world of ``world_size`` ranks on CPU, as a plain ``bcastbench run`` of
    that size gets (tests and the pytest plugin share it with in-process jobs)."""
    return WorldSpec(Launch(FORKED, "local"), world_size, timeout_s=timeout_s)


def close_ray(kill: bool = False) -> None:
    """Close this process's Ray world, if any: Ray shut down, every process it started gone
    (``kill``: at once, for an interrupted command, without waiting for ranks to leave)."""
    REGISTRY.close_kind(RAY, kill=kill)


def leave_joined() -> None:
    """Leave the joined world, if this process joined one: its process groups destroyed
    before the interpreter ends (registered at exit by the first joined job; see
    ``JoinedWorld.close``)."""
    REGISTRY.close_kind(JOINED)
