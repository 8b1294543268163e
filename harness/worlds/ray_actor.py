"""A Ray world's rank (``RankActor``): an actor that joins the torch.distributed world and runs
the driver's tasks with a ``harness.worlds.rank.RankContext``, and the environment it starts in."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harness import paths
from harness.worlds.emulated import LINKS_ENV, link_counter
from harness.worlds.rank import RankContext, device_for, rendezvous_store, where
from harness.worlds.ray_cluster import RayConf


class _ActorBoard:
    """What a rank actor is doing, kept in the actor for the driver to ask (``RankActor.where``)
    while a task runs: the forked world's ``PhaseBoard`` interface, one slot."""

    def __init__(self) -> None:
        self.phase, self.since = "starting", time.monotonic()

    def write(self, rank: int, job: int, step: int, phase: str) -> None:
        self.phase, self.since = phase, time.monotonic()


class RankActor:
    """One rank: joins the torch.distributed world, then runs ``fn(ctx, *args)`` on request.
    Runs its methods on two threads, so ``where`` answers while ``call`` works."""

    def __init__(self, rank: int, world_size: int, backend: str, device: str) -> None:
        torch.set_num_threads(1)  # ranks share the node's cores; more threads oversubscribe
        self.rank, self.world_size = rank, world_size
        self.backend, self.device = backend, device
        self.ctx = None
        self.board = _ActorBoard()
        self._task_thread: int | None = None

    def where(self) -> tuple[str, float, str]:
        """(the phase this rank last reported, seconds since it did, where its task's thread
        is: inside a collective or outside any)."""
        frame = sys._current_frames().get(self._task_thread) if self._task_thread else None
        stack = where(frame) if frame is not None else "idle"
        return self.board.phase, time.monotonic() - self.board.since, stack

    def node_ip(self) -> str:
        import ray  # optional: the driver imports this module without it

        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        """The Ray node this actor runs on (its host)."""
        import ray  # optional: the driver imports this module without it

        return ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind((self.node_ip(), 0))
            return s.getsockname()[1]

    def join(self, master_addr: str, port: int, timeout_s: float, ifname: str | None = None) -> int:
        """Initialize torch.distributed (collective over all actors); return this pid. ``ifname``:
        this rank's own ``GLOO_SOCKET_IFNAME`` (its rail), over the actors' common one."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(port),
        )
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        # Ray pins each GPU bundle's actor to one visible device, so any index maps to 0.
        dev = device_for(self.backend, self.device, self.rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            self.backend,
            store=rendezvous_store(master_addr, port, self.rank, self.world_size, timeout),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )

        # None off an emulated cluster; there, the rank-side job counts link bytes with it.
        counter = link_counter()
        self.ctx = RankContext(
            self.rank, self.world_size, self.backend, dev, link_counter=counter, board=self.board,
            node=f"ray node {self.node_id()}",
        )  # fmt: skip
        return os.getpid()

    def lend(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(ctx, *args)``, its answer's tensors kept here and lent over Ray Direct
        Transport (``remote_rank_actor`` marks it): a task of another rank given the ObjectRef
        receives them over the ranks' collective group (gloo point to point, ``RayWorld.lend``),
        the rest of the answer through the object store."""
        self.board.write(self.rank, 0, 0, f"lending {getattr(fn, '__name__', 'an answer')}")
        return fn(self.ctx, *args)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._task_thread = threading.get_ident()
        self.board.write(self.rank, 0, 0, getattr(fn, "__name__", "task"))
        return fn(self.ctx, *args)

    def leave(self) -> None:
        """Destroy the groups and the world (collective); the actor is killed afterwards."""
        if self.ctx is not None:
            self.ctx.release_groups()
        if dist.is_initialized():
            dist.destroy_process_group()


def remote_rank_actor():
    """``RankActor`` as a Ray actor class, its ``lend`` answering over Ray Direct Transport
    (gloo). Ray is imported here, when a Ray world starts: a process that opens any other
    world never imports it."""
    import ray

    ray.method(tensor_transport="gloo")(RankActor.lend)
    return ray.remote(RankActor)


def actor_env(conf: RayConf) -> dict[str, str]:
    """The environment every rank's actor starts in: the repository on its path (an actor
    imports ``RankActor`` by this module's name), one OpenMP thread, gloo's interface, and the
    emulated cluster's link counters where there are some."""
    path = os.environ.get("PYTHONPATH", "")
    env = {
        "PYTHONPATH": str(paths.REPO) + (os.pathsep + path if path else ""),
        "OMP_NUM_THREADS": "1",
    }
    if conf.socket_ifname and "{" not in conf.socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = conf.socket_ifname
    elif conf.address == "local" and not conf.socket_ifname:
        # A private cluster is this machine alone: gloo's pairs stay on loopback.
        env["GLOO_SOCKET_IFNAME"] = "lo"

    if os.environ.get(LINKS_ENV):  # the emulated cluster's link counters, for the ranks
        env[LINKS_ENV] = os.environ[LINKS_ENV]
    return env
