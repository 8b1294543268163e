"""``vllm_shm_broadcast``: vLLM's shared-memory ``MessageQueue``, carrying the batch the way
vLLM's ``GroupCoordinator.broadcast_object`` carries any object.

What it reproduces (vllm/distributed/device_communicators/shm_broadcast.py, in our own code):
the writer (the replica leader) pickles the whole object (here the batch's TensorDict and its
non-tensor arrays) with the highest pickle protocol and puts it in the next chunk of a ring of
``max_chunks`` fixed-size chunks in one POSIX shared-memory segment. Each chunk has a flag
block: one written flag, then one read flag per node-local reader. The writer spins
(``os.sched_yield``) until the chunk is free (never written, or read by every reader), clears
its written flag, writes byte 0 (overflow or not) and the pickle after it, clears the read
flags, then sets the written flag, in that order. A reader spins until its next chunk is
written and not yet read by it, unpickles it (or, when byte 0 says overflow, takes the pickle
from a ZMQ PUB socket instead), then sets its read flag. A pickle of ``max_chunk_bytes`` or
more overflows; readers on other nodes always take the PUB socket (TCP). The segment's name,
the sockets' addresses and who reads from where travel in one ``broadcast_object_list`` on the
first call; readers subscribe and the writer waits for every subscription before the first
message (vLLM's ``wait_until_ready``). Defaults are vLLM's current ones (``MessageQueue``'s
``max_chunk_bytes`` and ``max_chunks`` as ``GroupCoordinator`` builds it): 16 MiB chunks, 10 of
them, so a pickle of up to 16 MiB stays in shared memory; vLLM's earlier 4 MiB × 6 is
``max_chunk_bytes=4194304 max_chunks=6`` (``LEGACY``). Records made before the change ran
the earlier setting under no option; rerun those to compare.

Where it differs, and why: vLLM unlinks the segment when its writer is garbage-collected, so a
killed writer leaves it in /dev/shm; here it is unlinked as soon as every reader has it open.
The local PUB socket is in the abstract namespace (vLLM's is a file under /tmp). A vLLM reader
spins for as long as the writer is silent; here it also stops, with the writer's rank, when the
writer's process is gone or after the replica's gloo timeout, so no rank waits forever.
Attaching readers bypass Python's resource tracker (vLLM patches it out), so no reader
unlinks or warns about the writer's segment. Host memory only (``Unsupported`` on a GPU).

Options: see ``VllmShmBroadcast.Options``.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os
import pickle
import secrets
import socket
import struct
import time
import weakref
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch
import torch.distributed as dist
import zmq

from strategies.core.contract import (
    ContractError,
    DataProto,
    Unsupported,
    deliver,
    leaves,
    wants_non_tensor,
)
from strategies.core.footprint import Footprint
from strategies.core.node_signals import ShmError, group_timeout_s
from strategies.core.plan import LocalWork, PayloadSpec, Plan
from strategies.core.strategy_base import Strategy
from strategies.core.trace import WORK

LIVENESS_S = 0.5
"""How often a waiting reader checks that the writer's process still exists."""
IDLE_S = 10.0
"""vLLM's SpinTimer: after this long without a message a reader sleeps between polls."""
IDLE_SLEEP_S = 0.1
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
DEFAULT_MAX_CHUNK_BYTES = 16 << 20
"""vLLM's current chunk size (a pickle this large or larger overflows to the socket)."""
DEFAULT_MAX_CHUNKS = 10
LEGACY = {"max_chunk_bytes": 4 << 20, "max_chunks": 6}
"""vLLM's earlier defaults, still selectable as these options."""


@dataclass(frozen=True)
class Handle:
    """What the writer tells its readers on the first call (vLLM's ``Handle``)."""

    writer_pid: int
    segment: str | None
    local_readers: tuple[int, ...]
    max_chunk_bytes: int
    max_chunks: int
    local_address: str | None
    remote_address: str | None


class Ring:
    """The chunks and their flag blocks in one mapping (vLLM's ``ShmRingBuffer``)."""

    def __init__(self, buf, n_readers: int, max_chunk_bytes: int, max_chunks: int) -> None:
        self.buf = buf
        self.n_readers = n_readers
        self.chunk = max_chunk_bytes
        self.flags_at = max_chunk_bytes * max_chunks
        self.flag_size = 1 + n_readers

    @staticmethod
    def size(n_readers: int, max_chunk_bytes: int, max_chunks: int) -> int:
        return (max_chunk_bytes + 1 + n_readers) * max_chunks

    def data(self, i: int) -> memoryview:
        return self.buf[i * self.chunk : (i + 1) * self.chunk]

    def flags(self, i: int) -> memoryview:
        start = self.flags_at + i * self.flag_size
        return self.buf[start : start + self.flag_size]


class VllmShmBroadcast(Strategy):
    name = "vllm_shm_broadcast"
    footprint = Footprint(leader=1.55, receiver=3.15, leader_kept=0.35)
    """Measured by the node memory phase (the pickle (and its ZMQ copy past the ring) on the
    leader; the message, its bytes and the unpickled batch on a reader)."""
    claims = (
        "no collective: a pickle through a shared ring of spin-waited chunks; an overflowing "
        "one, and every reader on another node, over a ZMQ PUB socket"
    )

    @dataclass(frozen=True, kw_only=True)
    class Options(Strategy.Options):
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
        """Bytes per chunk of the ring (at least 2: the overflow byte and one of pickle); a
        pickle this large or larger overflows to the ZMQ socket. vLLM's current default."""
        max_chunks: int = DEFAULT_MAX_CHUNKS
        """Chunks in the ring (at least 1). vLLM's current default; ``LEGACY`` holds its
        earlier pair."""

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.max_chunk_bytes < 2 or self.max_chunks < 1:
                raise ValueError(
                    f"vllm_shm_broadcast: max_chunk_bytes must be >= 2 and max_chunks >= 1, got "
                    f"{self.max_chunk_bytes} and {self.max_chunks}"
                )

    def __init__(self, groups, **options) -> None:
        if groups.device.type != "cpu":
            raise Unsupported(
                f"rank {groups.rank}: vllm_shm_broadcast: the ring is host memory and the groups "
                f"run on {groups.device}"
            )
        super().__init__(groups, **options)
        self.timeout_s = group_timeout_s(groups.cpu_replica_group)
        self.ring: Ring | None = None
        self.handle: Handle | None = None
        self.index = 0
        self.local_rank = -1  # this reader's place among the node-local readers (-1: remote)
        self._ctx = zmq.Context()
        self._local = self._remote = None  # PUB on the writer, SUB on a reader
        self._segment = None
        weakref.finalize(self, _close, self._ctx)

    def check(self, batch) -> None:
        """Refuse, before anything is sent, a dtype whose tensors pickle but do not unpickle in
        this torch (the readers would fail where the writer did not; vLLM's would too)."""
        for dtype in {v.dtype for _, v in leaves(batch.batch) if isinstance(v, torch.Tensor)}:
            why = _pickle_refusal(dtype)
            if why:
                raise ContractError(
                    f"rank {self.groups.rank}: vllm_shm_broadcast: a {dtype} tensor pickles but "
                    f"does not unpickle in torch {torch.__version__} ({why}), so every reader "
                    "would fail; send it as another dtype or use another strategy (flat, header)"
                )

    # -- one call ----------------------------------------------------------------------------
    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        if g.is_leader:
            nt = batch.non_tensor_batch if wants_non_tensor(batch) else None
            blob = pickle.dumps((batch.batch, nt), protocol=pickle.HIGHEST_PROTOCOL)
            WORK["pickled_bytes"] += len(blob)
            if self.handle is None:
                self._set_up_writer()
            self._enqueue(blob)
            return batch
        if self.handle is None:
            self._set_up_reader()
        td, non_tensor = self._dequeue()
        return deliver(batch, td, non_tensor)

    def _enqueue(self, blob: bytes) -> None:
        if self.ring is not None:
            overflow = len(blob) >= self.options.max_chunk_bytes
            flags = self.ring.flags(self.index)
            self._wait(
                lambda: not flags[0] or sum(flags[1:]) == self.ring.n_readers, "a free chunk"
            )
            flags[0] = 0
            data = self.ring.data(self.index)
            data[0] = int(overflow)
            if not overflow:
                data[1 : 1 + len(blob)] = blob
            for i in range(1, self.ring.n_readers + 1):
                flags[i] = 0
            flags[0] = 1  # last: readers see a whole chunk or none
            self.index = (self.index + 1) % self.options.max_chunks
            if overflow:
                self._local.send(blob, copy=False)
        if self._remote is not None:
            self._remote.send(blob, copy=False)

    def _dequeue(self):
        """The next object: unpickled straight from its chunk (the pickle says where it ends),
        which is marked read only then; or from the PUB socket."""
        if self.ring is None:
            return _unpickled(self._recv(self._remote))
        flags = self.ring.flags(self.index)
        mine = self.local_rank + 1
        self._wait(lambda: flags[0] and not flags[mine], "the next chunk")
        data = self.ring.data(self.index)
        # A chunk's pickle ends where pickle says, so only a socket's message has a known
        # length to count as unpickled.
        obj = _unpickled(self._recv(self._local)) if data[0] == 1 else pickle.loads(data[1:])
        flags[mine] = 1
        self.index = (self.index + 1) % self.options.max_chunks
        return obj

    def _wait(self, ready, what: str) -> None:
        """Spin until ``ready()``, as vLLM does, and stop if the other side is gone."""
        start = last_check = time.monotonic()
        while not ready():
            now = time.monotonic()
            if now - start > IDLE_S:
                time.sleep(IDLE_SLEEP_S)
            else:
                os.sched_yield()
            if now - last_check > LIVENESS_S:
                last_check = now
                self._check_alive(now - start, what)

    def _check_alive(self, waited_s: float, what: str) -> None:
        g = self.groups
        if not g.is_leader and not _pid_alive(self.handle.writer_pid):
            raise ShmError(
                f"rank {g.rank}: vllm_shm_broadcast: the writer (rank {g.leader}, pid "
                f"{self.handle.writer_pid}) is gone while this rank waited for {what}"
            )
        if waited_s > self.timeout_s:
            raise ShmError(
                f"rank {g.rank}: vllm_shm_broadcast: waited {waited_s:.0f} s for {what} (the "
                "replica's gloo timeout)"
            )

    def _recv(self, sock) -> bytes:
        start = time.monotonic()
        while not sock.poll(int(LIVENESS_S * 1000)):
            self._check_alive(time.monotonic() - start, "a message on the PUB socket")
        return sock.recv(copy=False).buffer

    # -- set-up on the first call (vLLM's create_from_process_group) -------------------------
    def _set_up_writer(self) -> None:
        g = self.groups
        local = tuple(r for r in g.node_local_ranks if r != g.rank)
        remote = tuple(r for r in g.replica_ranks if r != g.rank and r not in local)
        segment = local_address = remote_address = None
        if local:
            size = Ring.size(len(local), self.options.max_chunk_bytes, self.options.max_chunks)
            self._segment = shared_memory.SharedMemory(create=True, size=size)  # zero-filled
            self.ring = Ring(
                self._segment.buf, len(local), self.options.max_chunk_bytes, self.options.max_chunks
            )
            segment = self._segment.name
            self._local = self._publisher()
            local_address = f"ipc://@bcastbench-vllm-{secrets.token_hex(12)}"
            self._local.bind(local_address)
        if remote:
            self._remote = self._publisher()
            host = _own_address()
            port = self._remote.bind_to_random_port(f"tcp://{host}")
            remote_address = f"tcp://{host}:{port}"
        self.handle = Handle(
            os.getpid(), segment, local, self.options.max_chunk_bytes, self.options.max_chunks,
            local_address, remote_address,
        )  # fmt: skip
        dist.broadcast_object_list([self.handle], src=g.leader, group=g.cpu_replica_group)
        try:
            for sock, n in ((self._local, len(local)), (self._remote, len(remote))):
                for _ in range(n if sock is not None else 0):
                    if not sock.poll(int(self.timeout_s * 1000)):
                        raise ShmError(
                            f"rank {g.rank}: vllm_shm_broadcast: {n} readers did not subscribe "
                            f"within {self.timeout_s:.0f} s"
                        )
                    sock.recv()  # one subscription message per reader (XPUB_VERBOSE)
                if sock is not None and n:
                    sock.send(b"READY")
            # Every reader holds the ring open now: nothing is left in /dev/shm from here on.
            dist.barrier(group=g.cpu_replica_group)
        finally:
            if self._segment is not None:
                self._segment.unlink()

    def _set_up_reader(self) -> None:
        g = self.groups
        box = [None]
        dist.broadcast_object_list(box, src=g.leader, group=g.cpu_replica_group)
        self.handle = handle = box[0]
        if g.rank in handle.local_readers:
            self.local_rank = handle.local_readers.index(g.rank)
            size = Ring.size(len(handle.local_readers), handle.max_chunk_bytes, handle.max_chunks)
            self._segment = _attach(handle.segment, size, g.rank)
            self.ring = Ring(
                memoryview(self._segment), len(handle.local_readers), handle.max_chunk_bytes,
                handle.max_chunks,
            )  # fmt: skip
            self._local = self._subscriber(handle.local_address)
        else:
            self._remote = self._subscriber(handle.remote_address)
        sock = self._local if self._local is not None else self._remote
        start = time.monotonic()
        while not sock.poll(int(LIVENESS_S * 1000)):
            self._check_alive(time.monotonic() - start, "the writer's READY")
        if sock.recv() != b"READY":
            raise ShmError(f"rank {g.rank}: vllm_shm_broadcast: the writer did not say READY")
        dist.barrier(group=g.cpu_replica_group)

    def _publisher(self):
        sock = self._ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.XPUB_VERBOSE, True)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def _subscriber(self, address: str):
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, "")
        sock.connect(address)
        return sock

    @classmethod
    def plan(cls, layout, spec: PayloadSpec) -> Plan:
        """One node (a layout holds no nodes): no collective; the leader pickles every leaf
        and the flagged non-tensor arrays, each receiver unpickles them (the pickle's own
        framing is not counted)."""
        nt = spec.sent_non_tensor_bytes
        work = LocalWork(pickled_bytes=spec.tensor_bytes + nt)
        return Plan(cls.name, [], leader=work, receiver=work)


def _unpickled(blob):
    WORK["unpickled_bytes"] += len(blob)
    return pickle.loads(blob)


@functools.cache
def _pickle_refusal(dtype: torch.dtype) -> str | None:
    """Why a tensor of ``dtype`` does not survive a pickle round trip, or None."""
    try:
        pickle.loads(pickle.dumps(torch.zeros(1, dtype=dtype), protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:  # noqa: BLE001 -- whatever torch raises is the reason
        return f"{type(exc).__name__}: {exc}"
    return None


def _attach(name: str, size: int, rank: int) -> mmap.mmap:
    """Open the writer's segment by name without Python's resource tracker (which would
    otherwise unlink it, or warn of a leak, when this reader exits)."""
    try:
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    except OSError as exc:
        raise ShmError(
            f"rank {rank}: vllm_shm_broadcast: cannot open the writer's segment {name!r} ({exc}); "
            "the ranks were taken to share a host"
        ) from None
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs: a killed process its parent has not reaped yet (a zombie) is
    gone, though signalling it still succeeds."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def _own_address() -> str:
    """The address remote readers reach this host at: the one gloo uses (GLOO_SOCKET_IFNAME's),
    loopback when the world's rendezvous is on loopback (one host), else the host name's."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if ifname:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
            return socket.inet_ntoa(packed[20:24])
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master == "localhost" or master.startswith("127."):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def _close(ctx) -> None:
    ctx.destroy(linger=0)


STRATEGY = VllmShmBroadcast
