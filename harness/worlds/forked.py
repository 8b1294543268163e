"""The forked world (``ForkedWorld``, a ``harness.worlds.protocol.World``): N real ranks forked
from the driver once, then many jobs on them, each handed the rank context every world shares
(``harness.worlds.rank.RankContext``).

Starting a gloo world of 8 costs seconds of imports and rendezvous, so sweeps and tests reuse
one world per (world size, backend, device) through ``harness.worlds.protocol.REGISTRY``. Ranks are
forked from the driver after the heavy imports, report their progress, and are killed as a
group when anything fails: no rank outlives its driver. What runs in a rank is
``harness.worlds.forked_rank``; gathering the ranks' answers and naming a failed or hung rank,
``harness.worlds.forked_answers``.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

# Ranks are forked from this process. A fork taken after the parent ran a multi-threaded
# OpenMP region can leave a child deadlocked in its first parallel op (libgomp's pool does not
# survive fork), so the driver stays single-threaded; ranks run one thread each anyway.
torch.set_num_threads(1)

# Imported here, in the driver, so forked ranks inherit them instead of each importing them
# (megatron-core comes with the rank context).
from tensordict import TensorDict  # noqa: E402, F401

from harness.worlds.forked_answers import Collector  # noqa: E402
from harness.worlds.forked_rank import PhaseBoard, _worker  # noqa: E402
from harness.worlds.protocol import WorldError  # noqa: E402
from harness.worlds.rank import (  # noqa: E402
    forget_megatron_groups,
    ps,
)
from harness.worlds.ray_network import (  # noqa: E402
    PrivateNetwork,
    namespace_handle,
    visiting,
)

STACKS_PREFIX = "bcastbench-stacks-"
"""A world's directory in the temporary directory (its ranks' stack files and their
rendezvous file) is named this, then its driver's pid, then a random part."""


def world_directory() -> str:
    """A new world's directory, after removing those a killed driver left (``orphaned``)."""
    for path in orphaned():
        shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{STACKS_PREFIX}{os.getpid()}-")


def orphaned(root: str | None = None) -> list[str]:
    """This user's world directories whose driver no longer runs: a driver killed by SIGKILL
    removes nothing, and its ranks die with it, so the next world to start removes them. A
    directory of a live driver, another user's, or one without a driver's pid in its name is
    left alone."""
    root = root or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(STACKS_PREFIX)]
    except OSError:
        return []
    out = []
    for name in names:
        pid, dash, _ = name[len(STACKS_PREFIX) :].partition("-")
        path = os.path.join(root, name)
        if not (dash and pid.isdigit()) or int(pid) == os.getpid():
            continue
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            out.append(path)
        except OSError:  # alive under another user, or the directory went meanwhile
            continue
    return sorted(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ForkedWorld:
    """N ranks started once with torch.multiprocessing (fork), serving tasks until closed; all
    on this machine, so one node."""

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        device: str = "cpu",
        timeout_s: float = 120.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self._ctx = None
        self._conns: list[Connection] = []
        self._status: list[Connection] = []
        self._answers: Collector | None = None
        self._stacks: str | None = None
        self._job = 0
        self.start_s = 0.0
        self.private_network = False
        """Whether the ranks run in a loopback-only network namespace of their own."""
        self._netns: int | None = None
        """A handle on that namespace: the driver reads the ranks' answers inside it."""

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> ForkedWorld:
        if dist.is_initialized():
            raise WorldError(
                "this process already holds a torch.distributed default group (rank "
                f"{dist.get_rank()} of {dist.get_world_size()}): ranks forked from it would "
                "inherit it and cannot start their own world; destroy it first "
                "(torch.distributed.destroy_process_group()), or run the job under torchrun, "
                "where this process joins the launcher's world instead"
            )
        t0 = time.perf_counter()
        self._job = 0  # the ranks' "ready" answers carry job 0
        self._answers = self._fork()
        with visiting(self._netns):
            self._answers.collect(self._job, "starting the world", self.timeout_s)
        self.start_s = time.perf_counter() - t0
        _LIVE.add(self)
        return self

    def _fork(self) -> Collector:
        """The ranks forked, each with its task and status pipes, the phase board and the
        world's directory (a file for each rank's stack dumps, the file the ranks meet
        through); the collector of their answers."""
        mp = tmp.get_context("fork")
        pairs = [mp.Pipe(duplex=True) for _ in range(self.world_size)]
        status = [mp.Pipe(duplex=True) for _ in range(self.world_size)]
        self._conns = [a for a, _ in pairs]
        self._status = [a for a, _ in status]
        children = [b for _, b in pairs]
        status_children = [b for _, b in status]
        board = PhaseBoard(mp, self.world_size)
        # A process group the driver dropped but megatron-core or a reference cycle still
        # holds (an in-process job's, a test's) is destroyed here, where its threads exist, not
        # in a rank that inherits it: there its destructor waits for the driver's threads.
        if not ps.model_parallel_is_initialized():
            forget_megatron_groups()
        gc.collect()
        port = _free_port()
        self._stacks = world_directory()
        # Where this host allows it (root), the ranks start in a network namespace of their
        # own whose only interface is loopback: gloo's store and pairs are on loopback anyway,
        # and an engine a strategy starts that listens on every interface (Mooncake's TCP
        # transport, UCX's) is then reachable from nothing outside the job.
        network = PrivateNetwork()
        self.private_network = network.enter()
        self._netns = namespace_handle() if self.private_network else None
        try:
            self._ctx = tmp.start_processes(
                _worker,
                args=(
                    self.world_size, port, self.backend, self.device, self.collective_timeout_s,
                    children, status_children, board, self._stacks,
                ),
                nprocs=self.world_size,
                join=False,
                start_method="fork",
            )  # fmt: skip
        except BaseException:
            self._drop_stacks()
            raise
        finally:
            network.leave()
        for c in children + status_children:
            c.close()
        return Collector(
            self._conns, self._status, self._ctx.processes, board, self._stacks,
            teardown=lambda: self.close(kill=True),
        )  # fmt: skip

    @property
    def collective_timeout_s(self) -> float:
        """Gloo's own limit on one collective in this world's ranks, fixed when it starts: past
        ``timeout_s``, so the driver names a hung rank before gloo raises. A later job with a
        longer limit needs a world started for it (``harness.worlds.opening.open_world``)."""
        return self.timeout_s + 5

    @property
    def alive(self) -> bool:
        return self._ctx is not None and all(p.is_alive() for p in self._ctx.processes)

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        return (tuple(range(self.world_size)),)

    def record_fields(self) -> dict[str, Any]:
        return {}

    def _drop_stacks(self) -> None:
        if self._stacks is not None:
            shutil.rmtree(self._stacks, ignore_errors=True)
            self._stacks = None

    def close(self, kill: bool = False) -> None:
        if self._ctx is None:
            self._drop_stacks()
            if self._netns is not None:
                os.close(self._netns)
                self._netns = None
            return
        procs = self._ctx.processes
        if not kill:
            for c in self._conns:
                try:
                    c.send(None)
                except (OSError, BrokenPipeError):
                    pass
            deadline = time.monotonic() + 5
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for c in self._conns + self._status:
            c.close()
        self._drop_stacks()
        if self._netns is not None:
            os.close(self._netns)
            self._netns = None
        self._ctx = self._answers = None
        _LIVE.discard(self)

    def __enter__(self) -> ForkedWorld:
        return self.start() if self._ctx is None else self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)

    # -- tasks -----------------------------------------------------------------------------
    def run(
        self, fn: Callable[..., Any], *args: Any, what: str = "", timeout_s: float | None = None
    ) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank; return the per-rank results in rank order.

        Any rank's error, crash or silence (no progress for ``timeout_s``) kills the whole
        world and raises WorldError naming the rank and what it was doing.
        """
        if not self.alive:
            raise WorldError("the world is not running (it was closed or a rank died)")
        self._job += 1
        try:
            for c in self._conns:
                c.send((self._job, fn, args))
            with visiting(self._netns):
                return self._answers.collect(
                    self._job, what or getattr(fn, "__name__", "task"), timeout_s or self.timeout_s
                )
        except WorldError:
            raise  # torn down by the collector, unless every rank refused before any collective
        except BaseException:
            # Anything else that cut the wait short (an unpicklable result, Ctrl-C, a test
            # framework's interrupt) may leave answers in flight and ranks in a collective: a
            # world left like that is out of step, so it goes.
            self.close(kill=True)
            raise


_LIVE: set[ForkedWorld] = set()
"""Every started forked world, cached or not: at exit none may keep its ranks."""


def close_all() -> None:
    for world in list(_LIVE):
        world.close(kill=True)


atexit.register(close_all)
