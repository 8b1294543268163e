"""Opening a world: the live one of a ``WorldSpec`` (``harness.worlds.launcher``) reused across a
sweep's jobs and a test session's tests, or a new one of its kind started. Importing this
imports every kind of world (torch, megatron-core; Ray itself only when a Ray world starts), so
what must answer before those imports (a config error, the launcher's choice) stays in
``harness.worlds.launcher``."""

from __future__ import annotations

import atexit
import math
from collections.abc import Callable
from dataclasses import replace

from harness.worlds.emulated import EmulatedWorld
from harness.worlds.forked import ForkedWorld
from harness.worlds.joined import JoinedWorld
from harness.worlds.launcher import (
    EMULATED,
    FORKED,
    JOINED,
    RAY,
    Launch,
    WorldSpec,
    leave_joined,
)
from harness.worlds.protocol import REGISTRY, Reused, World
from harness.worlds.ray_world import RayWorld


def _forked(spec: WorldSpec) -> World:
    return ForkedWorld(spec.world_size, spec.backend, spec.device, spec.timeout_s)


def _joined(spec: WorldSpec) -> World:
    atexit.unregister(leave_joined)  # once, however many times a process joins
    atexit.register(leave_joined)
    return JoinedWorld(spec.launch, spec.backend, spec.device, spec.timeout_s)


def _ray(spec: WorldSpec) -> World:
    return RayWorld(spec.world_size, replace(spec.ray, dispatch="none"))


def _emulated(spec: WorldSpec) -> World:
    return EmulatedWorld(
        spec.emulate, spec.world_size, spec.log_dir, spec.timeout_s, spec.backend, spec.device
    )


KINDS: dict[str, Callable[[WorldSpec], World]] = {
    FORKED: _forked, JOINED: _joined, RAY: _ray, EMULATED: _emulated,
}  # fmt: skip
"""How each kind of world is made from its spec."""


ALONE = {JOINED, RAY, EMULATED}
"""Kinds a process holds one of at most: one default process group, one Ray session, one
emulated cluster (its signal handlers and namespaces)."""


def open_world(spec: WorldSpec) -> World:
    """The live world for ``spec``, reused across a sweep's jobs, or a new one started. A live
    world whose collectives time out sooner than this job's ``timeout_s`` allows (a forked
    world started for a job with a shorter limit) is started again, so the limit means the
    same for every job of a sweep."""
    return REGISTRY.get(
        spec.reuse_key, lambda: KINDS[spec.kind](spec).start(), alone=spec.kind in ALONE,
        fits=lambda world: getattr(world, "collective_timeout_s", math.inf) >= spec.timeout_s,
    )  # fmt: skip


def reused_world(spec: WorldSpec) -> Reused:
    """A handle on the registry's world for ``spec`` that outlives a torn-down world: each
    task goes to the live one, started again when an earlier task tore it down (a test
    session's worlds)."""
    return REGISTRY.reused(
        spec.reuse_key, lambda: KINDS[spec.kind](spec).start(), alone=spec.kind in ALONE,
        timeout_s=spec.timeout_s,
    )  # fmt: skip


# -- names the rest of the harness and its tests call -----------------------------------------
def ray_world(world_size: int, conf) -> World:
    """This process's Ray world of ``world_size`` ranks and ``conf`` (``RayConf``), from the
    registry as a ``world=ray`` job would open it."""
    return open_world(WorldSpec(Launch(RAY, "ray"), world_size, conf.backend, conf.device,
                                conf.timeout_s, ray=conf))  # fmt: skip
