"""What every world of ranks offers (``World``), and the one place a process keeps its live
worlds between jobs (``REGISTRY``): a new kind of world is one class that fills the protocol.

The implementations: ``harness.worlds.forked.ForkedWorld`` (ranks forked from the driver),
``harness.worlds.joined.JoinedWorld`` (this process is one rank of a world torchrun, srun or
submitit started), ``harness.worlds.ray_world.RayWorld`` (ranks as Ray actors) and
``harness.worlds.emulated.EmulatedWorld`` (a joined world on emulated nodes, driven from
here). ``harness.worlds.launcher.choose`` decides which one a job runs on. Nothing here imports
torch: the protocol and the registry are cheap to import.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

from harness.errors import VerificationError

log = logging.getLogger(__name__)

RankFn = Callable[..., Any]
"""A task run on every rank: ``fn(ctx, *args)`` with ctx a ``harness.worlds.rank.RankContext``;
it and its arguments must pickle (forked, Ray and emulated worlds send them to the ranks)."""


class WorldError(RuntimeError):
    """A rank failed, crashed or stopped responding; the message names the rank and phase."""


JOB_FAILURES: tuple[type[BaseException], ...] = (WorldError, VerificationError)
"""What a job that ran but did not succeed raises (as opposed to a bad config or a bug): a
sweep records it as a failed job and goes on."""


@runtime_checkable
class World(Protocol):
    """Ranks that serve tasks until closed.

    ``timeout_s`` means the same in every world: a rank that reports no progress (a new phase
    through ``RankContext.report``) for that long fails the job, however long the job is.
    """

    world_size: int
    start_s: float
    """Seconds the last ``start`` took; the launcher charges it to one job and zeroes it."""

    def start(self) -> World:
        """Bring the ranks up (collective on every rank); returns the world itself."""
        ...

    def run(
        self, fn: RankFn, *args: Any, what: str = "", timeout_s: float | None = None
    ) -> list[Any] | None:
        """``fn(ctx, *args)`` on every rank; the per-rank results in rank order, on the
        process that drives the world (a joined world's other ranks get None). A rank's error,
        death or silence raises ``WorldError`` naming the rank and its phase (``what`` says
        which task), and a world that may be out of step is torn down."""
        ...

    @property
    def alive(self) -> bool:
        """Whether the world can run another task (False once closed or torn down)."""
        ...

    def close(self, kill: bool = False) -> None:
        """End the ranks (``kill``: at once, without waiting for them to leave)."""
        ...

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """The ranks that share a host, one tuple per node in node order (after ``start``)."""
        ...

    def record_fields(self) -> dict[str, Any]:
        """Fields a job's record takes from the world that ran it (the emulated cluster's
        shape and link bytes); empty for most worlds."""
        ...


class NodesFoundAtStart:
    """What a world whose ranks find their hosts when they start shares (joined, Ray): the
    ranks of each node (``_nodes``, set by ``start`` from ``group_by_node``), and no fields of
    its own for a job's record."""

    _nodes: tuple[tuple[int, ...], ...] = ()

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """The ranks that share a host, one tuple per node (empty before ``start``)."""
        return self._nodes

    def record_fields(self) -> dict[str, Any]:
        return {}


def group_by_node(node_of_rank: Sequence[Hashable]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each node, nodes in the order their first rank appears:
    ``group_by_node(["a", "a", "b", "b"]) == ((0, 1), (2, 3))``."""
    by_node: dict[Hashable, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        by_node.setdefault(node, []).append(rank)
    return tuple(tuple(ranks) for ranks in by_node.values())


def _revived(world: World) -> bool:
    """Whether a world a failed task tore down started its ranks again: a world that keeps
    what its ranks ran on (a Ray world its cluster) offers ``revive()``; one that cannot
    revive, or fails to, is closed and started anew by the caller."""
    revive = getattr(world, "revive", None)
    if revive is None:
        return False
    try:
        revive()
    except Exception as exc:  # noqa: BLE001 -- a new world is started instead; say why
        log.warning("the %s world could not start its ranks again (%s); starting a new one",
                    type(world).__name__, exc)  # fmt: skip
        return False
    return world.alive


class WorldRegistry:
    """The live worlds of this process, one per key: the key is what makes a world reusable
    (``(kind, world_size, ...)``, its first item the kind), so a sweep's jobs and a test
    session's tests share worlds instead of starting their own. A world that a failed job
    tore down is revived (``revive()``, where it offers one) or closed and started again on
    the next ``get``."""

    def __init__(self) -> None:
        self.worlds: dict[Hashable, World] = {}

    def get(
        self, key: tuple, start: Callable[[], World], alone: bool = False,
        fits: Callable[[World], bool] | None = None,
    ) -> World:  # fmt: skip
        """The live world under ``key``, or the one ``start()`` returns (started), kept.
        ``alone``: a process holds one world of this kind at most (one Ray session, one
        default process group), so a live one under another key is closed first. ``fits``:
        whether the live world can serve this job (one that cannot is closed and started
        again)."""
        world = self.worlds.get(key)
        if world is not None and (fits is None or fits(world)):
            if world.alive or _revived(world):
                return world
        self.close(key, kill=True)
        if alone:
            self.close_kind(key[0], kill=False)
        world = start()
        self.worlds[key] = world
        return world

    def peek(self, key: tuple) -> World | None:
        """The world under ``key``, live or not, without starting one."""
        return self.worlds.get(key)

    def reused(
        self, key: tuple, start: Callable[[], World], alone: bool = False,
        timeout_s: float | None = None,
    ) -> Reused:  # fmt: skip
        """A handle that runs each task on the live world under ``key`` (see ``Reused``)."""
        return Reused(self, key, start, alone, timeout_s)

    def close(self, key: tuple, kill: bool = False) -> None:
        world = self.worlds.pop(key, None)
        if world is not None:
            world.close(kill=kill or not world.alive)

    def close_kind(self, kind: str, kill: bool = False) -> None:
        for key in [k for k in self.worlds if k[0] == kind]:
            self.close(key, kill=kill)

    def close_all(self, kill: bool = False) -> None:
        # Newest first: a Ray world started after a forked one may hold ranks that fork too.
        for key in reversed(list(self.worlds)):
            self.close(key, kill=kill)


class Reused:
    """A world of the registry held across tests: every ``run`` goes to the live world under
    its key, started again when an earlier task tore it down; ``alive`` says whether the
    current one still is (and starts nothing). Other attributes are the current world's. A
    task without a ``timeout_s`` of its own gets the handle's: the live world may have been
    started for a job with another limit."""

    def __init__(
        self, registry: WorldRegistry, key: tuple, start: Callable[[], World],
        alone: bool = False, timeout_s: float | None = None,
    ) -> None:  # fmt: skip
        self._registry, self._key, self._start = registry, key, start
        self._alone, self._timeout_s = alone, timeout_s

    @property
    def world(self) -> World:
        return self._registry.get(self._key, self._start, alone=self._alone)

    def start(self) -> Reused:
        """Start the world now unless it is live (the handle itself is returned)."""
        self._registry.get(self._key, self._start, alone=self._alone)
        return self

    def run(self, fn: RankFn, *args: Any, what: str = "", timeout_s: float | None = None):
        return self.world.run(fn, *args, what=what, timeout_s=timeout_s or self._timeout_s)

    @property
    def alive(self) -> bool:
        current = self._registry.peek(self._key)
        return current is not None and current.alive

    def close(self, kill: bool = False) -> None:
        self._registry.close(self._key, kill=kill)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.world, name)


REGISTRY = WorldRegistry()
"""This process's live worlds: the run path (``harness.worlds.opening.open_world``), the test
session's worlds (tests/conftest.py) and the pytest plugin's (``harness.pytest_plugin``)."""
atexit.register(REGISTRY.close_all)
