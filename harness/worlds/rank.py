"""The rank side every world shares: ``RankContext`` (who a rank is, its phase reports, its
megatron-core groups built once per layout and torn down when the layout changes), the device a
rank uses, where a blocked rank is (``where``) and the rendezvous store a world's ranks meet at.
The forked, joined, Ray and emulated worlds all hand their tasks a ``RankContext``."""

from __future__ import annotations

import datetime
import gc
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
import torch.distributed as dist

from harness.megatron_import import parallel_state
from strategies import ProcessGroups

ps = parallel_state()
"""megatron-core's parallel_state (imported quietly, once)."""


class PhaseBoard(Protocol):
    """Where a rank posts its phase for its driver to read (the forked world's shared memory,
    a Ray actor's own slot)."""

    def write(self, rank: int, job: int, step: int, phase: str) -> None: ...


@dataclass
class RankContext:
    """What a task running on a rank gets: who it is, and how to report progress."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    conn: Connection | None = None
    step: int = 0
    cache: dict = field(default_factory=dict)
    job: int = 0
    """The driver's number for the task being run; every message back carries it."""
    link_counter: Callable[[], int] | None = None
    """Bytes the emulated cluster's node links have sent so far (``harness.worlds.emulated``),
    or None outside one: the hook the rank-side job counts cross-node bytes with."""
    board: PhaseBoard | None = None
    """Where a forked world's rank posts its phase (shared memory the driver reads), or None:
    phases then travel as messages."""
    node: str | None = None
    """This rank's host as its world knows it (Ray: the node id), or None: the launcher's
    environment says (``strategies.core.groups.node_key``); the groups' ``node_of`` follows."""

    def report(self, phase: str) -> None:
        """Tell the driver what this rank is doing now (used to name a hung rank)."""
        self.step += 1
        if self.board is not None:
            self.board.write(self.rank, self.job, self.step, phase)
        else:
            self.send("phase", phase)

    def send(self, kind: str, payload: Any) -> None:
        if self.conn is not None:
            self.conn.send((self.job, kind, self.step, payload))

    def groups_for(self, layout):
        """The strategies' ProcessGroups for ``layout``, built through megatron-core once and
        cached; a new layout tears down Megatron's state and its groups, then builds them
        again (collective)."""
        key = ("groups", layout)
        if key not in self.cache:
            layout.check_world(self.world_size)
            self.cache = {k: v for k, v in self.cache.items() if k[0] != "groups"}
            self.release_groups()
            with _recording_new_groups() as made:
                ps.initialize_model_parallel(
                    **layout.megatron_kwargs(), create_gloo_process_groups=False
                )
                groups = ProcessGroups.from_megatron(
                    order="-".join(layout.tokens), device=self.device, node=self.node
                )
            self.cache["owned_groups", None] = _keep_only(groups, made)
            self.cache[key] = groups
        return self.cache[key]

    def release_groups(self) -> None:
        """Destroy the process groups the last layout made (collective, like making them).

        megatron-core's destroy_model_parallel only forgets its groups. Each gloo group keeps
        a transport thread that wakes ~100 times a second, so a world that visited a dozen
        layouts held ~200 of them per rank and its idle ranks took most of two cores."""
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        forget_megatron_groups()
        for group in self.cache.pop(("owned_groups", None), []):
            dist.destroy_process_group(group)
        # Whatever still refers to the old groups in a reference cycle is freed here, at the
        # same point of every rank's program, rather than by a collection that an allocation
        # triggers at a different moment on each rank, in the middle of the next collective.
        gc.collect()


def _megatron_groups() -> dict[str, Any]:
    """megatron-core's module globals that hold a process group (or a list or dict of them)."""

    def holds(value) -> bool:
        if isinstance(value, dist.ProcessGroup):
            return True
        items = value.values() if isinstance(value, dict) else value
        return isinstance(value, (list, tuple, dict)) and any(
            isinstance(v, dist.ProcessGroup) for v in items
        )

    return {name: value for name, value in vars(ps).items() if holds(value)}


def forget_megatron_groups() -> list:
    """Set to None every megatron-core global still holding a process group; returns what
    they held. ``destroy_model_parallel`` leaves some (megatron-core 0.16 keeps
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``): forgotten here, in the process that made
    them, they are destroyed here, where their threads run. Left set, a rank forked later
    inherits them, and the next ``initialize_model_parallel`` there drops the last reference:
    the destructor then joins threads that exist only in the driver, and the rank hangs."""
    held = _megatron_groups()
    for name in held:
        setattr(ps, name, None)
    return list(held.values())


def _keep_only(groups, made: list) -> list:
    """Destroy the groups megatron-core made that the strategies do not use, and forget its
    state; returns the groups kept. Every gloo group keeps a transport thread that wakes ~100
    times a second, and megatron-core makes a dozen or more per rank (expert, embedding, DP×CP,
    ...), so an idle rank of the harness would otherwise take CPU from a broadcast that a bare
    world of one group does not pay (a benchmark measures the two side by side)."""
    used = [
        groups.tp_cp_group, groups.pp_group, groups.replica_group,
        groups.cpu_tp_cp_group, groups.cpu_pp_group, groups.cpu_replica_group,
    ]  # fmt: skip
    keep = [g for g in made if any(g is u for u in used)]
    ps.destroy_model_parallel()
    forget_megatron_groups()
    for group in made:
        if not any(group is k for k in keep):
            dist.destroy_process_group(group)
    return keep


class _recording_new_groups:
    """Within the block, every group ``torch.distributed.new_group`` makes for this rank is
    recorded (megatron-core and ProcessGroups call it through the module, so both are seen)."""

    def __enter__(self) -> list:
        self.made: list = []
        self._orig = dist.new_group

        def new_group(*args, **kwargs):
            group = self._orig(*args, **kwargs)
            if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD:
                self.made.append(group)
            return group

        dist.new_group = new_group
        return self.made

    def __exit__(self, *exc) -> None:
        dist.new_group = self._orig


def device_for(backend: str, device: str, local_rank: int) -> torch.device:
    if device == "cuda" or backend == "nccl":
        index = local_rank % max(torch.cuda.device_count(), 1)
        if backend == "nccl" or device == "cuda":
            torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def where(frame) -> str:
    """Where a thread is blocked: the innermost torch.distributed call and our caller of it."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    inner_dist = next((f for f in stack if "torch/distributed" in f.f_code.co_filename), None)
    ours = next(
        (
            f
            for f in stack
            if "/harness/" in f.f_code.co_filename or "/strategies/" in f.f_code.co_filename
        ),
        stack[0] if stack else None,
    )
    if ours is None:
        return "idle"
    at = f"{os.path.basename(ours.f_code.co_filename)}:{ours.f_lineno} {ours.f_code.co_name}"
    if inner_dist is not None:
        return f"{IN_COLLECTIVE} torch.distributed.{inner_dist.f_code.co_name} (from {at})"
    peer = next((f for f in stack if _peer_wait(f.f_code)), None)
    if peer is not None:
        return f"{WAITING_FOR_PEER} in shm's node channel, {peer.f_code.co_name} (from {at})"
    return f"outside any collective, at {stack[0].f_code.co_name} (from {at})"


IN_COLLECTIVE = "in collective"
"""How ``where`` begins for a thread blocked inside a torch.distributed call."""
WAITING_FOR_PEER = "waiting for a node-local peer"
"""How ``where`` begins for a thread blocked in one of the ``PEER_WAITS``."""
PEER_WAITS = frozenset(
    {
        ("strategies/core/ring_reader.py", "_next_message"),
        ("strategies/core/ring_reader.py", "_spin_for_message"),
        ("strategies/core/ring_reader.py", "_polled_complete"),
        ("strategies/core/ring_writer.py", "_wait_behind"),
        ("strategies/core/ring_writer.py", "publish"),
        ("strategies/core/ring_writer.py", "_tell"),
        ("strategies/core/node_channel.py", "_accept"),
        ("strategies/core/node_channel.py", "_completion_page"),
        ("strategies/core/node_crossing.py", "_wait_striped"),
    }
)
"""(file, function) of the shm node channel's waits for a node-local peer (a socket message or
a shared word): a rank blocked there waits for its peers as one in a collective does, so a hung
world names the rank it waits for, not it."""


def _peer_wait(code) -> bool:
    path = code.co_filename.replace(os.sep, "/")
    return any(path.endswith(f) and code.co_name == name for f, name in PEER_WAITS)


def in_collective(place: str) -> bool:
    """Whether ``place`` (a ``where``) is inside a collective or a node channel's wait for a
    peer: a rank there waits for its peers, so a hung world's culprit is a rank that is not."""
    return place.startswith((IN_COLLECTIVE, WAITING_FOR_PEER))


def rendezvous_store(
    host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.TCPStore:
    """The world's TCPStore, listening on ``host`` only. Left to itself, rank 0's store
    listens on every interface of the machine (``::``); here rank 0 binds the socket to
    ``host`` and hands it to the store, so a local world is reachable from this machine
    alone (and a node's from its own address)."""
    listen_fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, world_size))
        listen_fd = sock.detach()
    return dist.TCPStore(host, port, world_size, rank == 0, timeout, master_listen_fd=listen_fd)
