"""Moving one message to the ranks of a node through shared memory: a ring of segments the node
leader writes and its node-local ranks map, a Unix socket per reader for the signal and the
releases, and (across nodes) point-to-point sends from the replica leader to each node leader.

Segments are memfds (``os.memfd_create``): anonymous, never named in /dev/shm, handed to each
reader once per segment over its socket (``SCM_RIGHTS``). The sockets live in the abstract
namespace (no file either), so nothing is left behind by any ending, kill -9 included: the
kernel frees a segment with the last process that holds it. Python's resource tracker never
sees either (no ``multiprocessing.shared_memory``).

The ring: ``slots`` segments used in turn. A reader maps the segment copy-on-write
(``MAP_PRIVATE``) for every message, so the batch it returns is its own (writing to it never
reaches the other ranks or the segment) while no byte is copied, and it holds that mapping
for as long as any tensor of the batch lives; when the last one dies, a finalizer sends the
release. The leader writes into a slot only when every reader has released the message it
held; a slot some reader still holds is retired instead (the leader drops its mapping and
makes a new segment for the slot; the holder keeps the old one until it lets go), so the
leader never waits for a reader and never overwrites bytes a reader views.

The signal is one socket message per reader (slot, generation, sequence number, size), so a
small message costs a syscall on each side instead of a collective. A reader waits for it as
long as a gloo collective on the same replica would (that group's timeout); a leader that
dies closes its sockets, and its readers learn at once. While it waits, a reader maps the slot
the next message most likely lands in (``premap``).

A message can be signalled early (``publish(early=True)``: its header and non-tensor blob are
in, its leaves not yet), then completed (``complete``) or aborted with the writer's error
(``abort``); a reader of such a message reads what is there and waits for the rest
(``wait_complete``).
"""

from __future__ import annotations

import mmap
import os
import secrets
import select
import socket
import struct
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from strategies.core.contract import ContractError, Unsupported, leader_failed, settled
from strategies.core.groups import Stripe, stripes
from strategies.core.packer import Packer
from strategies.core.process_groups import ProcessGroups

SIGNAL = struct.Struct("<4sIIQQ")  # magic, slot, generation, sequence, message bytes
SIGNAL_MAGIC = b"BCBS"
EARLY_MAGIC = b"BCBE"
"""A signal sent once the header and the non-tensor blob are in the slot, before the leaves:
the reader decodes while the writer copies, then waits for the message's ``DONE_MAGIC``."""
DONE_MAGIC = b"BCBD"
"""The leaves of the message signalled early are in the slot too."""
ABORT_MAGIC = b"BCBA"
"""The writer failed while writing the message signalled early; its error follows, as text."""
ABORT_TEXT_BYTES = 4096
STRIPE_MAGIC = b"BCSW"
"""A request (same layout as a signal) to write one stripe of the next message into a slot."""
RELEASE = struct.Struct("<IIIQ")  # kind, slot, generation, sequence
READ, RELEASED, STRIPED = 0, 1, 2
"""What a reader reports: it took the signal of a message, let go of the message, or wrote its
stripe of the message into the slot."""
DEFAULT_STRIPE_MIN_BYTES = 1 << 20
"""Messages from this size on cross nodes in stripes (``groups.stripes``); below it the extra
signal and report cost more than a second link saves."""
HELLO = struct.Struct("<16sQ")  # the job's token, the reader's global rank
DEFAULT_SLOTS = 3
"""Segments in the ring: a batch held while the next one arrives still leaves a free slot."""
CLOSE_WAIT_S = 5.0
"""How long a closing writer waits for its readers to take the last signal."""
CONNECT_TIMEOUT_S = 60.0
"""How long the node leader waits for its readers to connect while the channel is set up."""


class ShmError(ContractError):
    """The shared-memory channel broke (a peer's socket closed, a message that does not fit its
    segment, a stranger on the socket); the message names the rank and what it expected."""


def check_size_option(name: str, value) -> None:
    """Refuse a byte-count option that is not an int >= 0 or None, naming it and its value."""
    if value is None or (type(value) is int and value >= 0):
        return
    raise ValueError(f"shm: {name} must be a byte count (an int >= 0) or None, got {value!r}")


def available() -> str | None:
    """Why this machine cannot run the channel, or None when it can."""
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return "needs Linux memfd_create and SCM_RIGHTS (Python >= 3.9 on Linux)"
    return None


def group_timeout_s(group) -> float:
    """The gloo timeout of ``group`` (what a gloo receiver on it would wait), else 30 min."""
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return 1800.0
    return timeout.total_seconds() if isinstance(timeout, timedelta) else 1800.0


@dataclass
class Segment:
    """One memfd and the writer's shared mapping of it."""

    fd: int
    capacity: int
    generation: int
    mapping: mmap.mmap
    view: torch.Tensor

    @classmethod
    def make(cls, capacity: int, generation: int) -> Segment:
        fd = os.memfd_create("bcastbench-shm", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(capacity, 1))
            mapping = mmap.mmap(fd, max(capacity, 1), flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        view = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8, count=capacity))
        return cls(fd, capacity, generation, mapping, view)

    def close(self) -> None:
        """Drop the writer's hold (readers that map it keep their own)."""
        self.view = None  # type: ignore[assignment]
        try:
            self.mapping.close()
        except BufferError:  # a tensor of it is still alive: the mapping goes with it
            pass
        os.close(self.fd)


@dataclass
class Slot:
    """One place of the ring on the writer: its current segment and who still holds it."""

    index: int
    segment: Segment | None = None
    generation: int = 0
    sequence: int = -1
    holders: set[int] = field(default_factory=set)
    """Readers (global ranks) that have not released this slot's last message."""
    delivered: set[int] = field(default_factory=set)
    """Readers that have this segment's fd."""
    packer: Packer = field(init=False)
    """Packs a batch straight into this slot's segment (its allocator makes the segments)."""

    def __post_init__(self) -> None:
        self.packer = Packer(allocate=self.allocate)

    def buffer(self, capacity: int) -> torch.Tensor:
        """A shared view of at least ``capacity`` bytes: the current segment, or a new one
        (readers get its fd with the next signal)."""
        if self.segment is None or self.segment.capacity < capacity:
            self.retire()
            self.generation += 1
            self.segment = Segment.make(capacity, self.generation)
        return self.segment.view

    def allocate(self, capacity: int, device: torch.device) -> torch.Tensor:
        """``Packer``'s allocator: a new segment of exactly ``capacity`` bytes (host memory:
        only host groups pack straight into it, and ``validate`` refuses a batch off the
        groups' device)."""
        self.retire()
        self.generation += 1
        self.segment = Segment.make(capacity, self.generation)
        return self.segment.view

    def retire(self) -> None:
        """Let go of the segment (and the packer's view of it): the next write makes one."""
        self.packer.forget()
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.delivered = set()
        self.holders = set()


class NodeChannel:
    """A node leader and its node-local readers (one per strategy instance and replica).

    ``connect`` (collective over the replica's gloo group) runs on the first call; after it a
    call is ``writer_slot`` + ``publish`` on the node leader and ``receive`` on a reader.

    Across nodes a message of at least ``stripe_min_bytes`` crosses in stripes
    (``groups.stripes``): the i-th rank of the leader's node sends one slice to the i-th rank
    of each other node, which writes it straight into its node leader's segment (the node
    leader hands it the segment with a stripe request, and publishes once every stripe is
    in), so each rank's own link carries its share. None: every message crosses whole."""

    def __init__(
        self,
        groups: ProcessGroups,
        slots: int = DEFAULT_SLOTS,
        stripe_min_bytes: int | None = DEFAULT_STRIPE_MIN_BYTES,
    ) -> None:
        why = available()
        if why:
            raise Unsupported(f"shm: {why}")
        if slots < 1:
            raise ValueError(f"shm: slots must be >= 1, got {slots}")
        check_size_option("stripe_min_bytes", stripe_min_bytes)
        self.groups = groups
        self.nodes = groups.replica_nodes
        self.stripe_min_bytes = stripe_min_bytes
        self.striped_upto: dict[int, int] = {}  # writer: reader rank -> last message it striped
        self._stripes_of: tuple[int, tuple] = (-1, ())  # (message bytes, its stripes)
        self.local = groups.node_local_ranks
        self.node_leader = self.local[0]
        self.is_node_leader = groups.rank == self.node_leader
        self.readers = tuple(r for r in self.local if r != self.node_leader)
        self.slots = [Slot(i) for i in range(slots)]
        self.turn = 0
        self.sequence = 0
        self.socks: dict[int, socket.socket] = {}  # writer: reader rank -> its socket
        self.broken: dict[int, str] = {}  # writer: reader rank -> why its socket was dropped
        self.read_upto: dict[int, int] = {}  # writer: reader rank -> last sequence it took
        self.sock: socket.socket | None = None  # reader: the socket to the node leader
        self.fds: dict[int, tuple[int, int]] = {}  # reader: slot -> (generation, fd)
        self.last_index: int | None = None  # reader: the slot of the last message it took
        self.pending: int | None = None  # reader: a message signalled early, not complete yet
        self.timeout_s = group_timeout_s(groups.cpu_replica_group)
        self.connected = False
        self.closed = False
        self.local_releases: list[tuple[int, int, int]] = []  # a node leader's own views
        self.published = [0]  # writer: the last sequence signalled (shared with the finalizer)
        weakref.finalize(
            self, _close_all, self.socks, self.fds, self.slots, self.read_upto, self.published
        )

    # -- set-up ----------------------------------------------------------------------------
    def connect(self) -> None:
        """Every node leader listens on a fresh abstract address; the replica learns them in
        one all-gather; each reader connects to its node leader and proves it is of this job
        with the token that travelled in the gather."""
        g = self.groups
        if self.closed:  # a set-up that failed is not tried again: the others are not in it
            raise settled(ShmError(
                f"rank {g.rank}: shm: the channel's set-up failed on an earlier call; build the "
                "strategy again"
            ))  # fmt: skip
        listener = None
        mine = None
        if self.is_node_leader and self.readers:
            token = secrets.token_bytes(16)
            address = b"\0bcastbench-shm-" + secrets.token_hex(12).encode()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            listener.bind(address)
            listener.listen(len(self.readers))
            mine = (address, token)
        offers: list = [None] * len(g.replica_ranks)
        dist.all_gather_object(
            offers, (g.rank, mine, self.stripe_min_bytes), group=g.cpu_replica_group
        )
        by_rank = {rank: offer for rank, offer, _ in offers}
        try:
            self._agree_on_stripes({rank: threshold for rank, _, threshold in offers})
            if listener is not None:
                self._accept(listener, mine[1])
            elif not self.is_node_leader:
                self._dial(*by_rank[self.node_leader])
        except ShmError as exc:
            # Readers that did connect learn of it from their closed socket, not a timeout.
            self.close()
            raise settled(exc) from None
        finally:
            if listener is not None:
                listener.close()
        self.connected = True

    def _agree_on_stripes(self, thresholds: dict[int, int | None]) -> None:
        """Across nodes every rank of the replica must compute the same stripes, so the same
        ``stripe_min_bytes``: with another, a stripe receiver would wait for a slice nobody
        sends. The set-up gather carried every rank's, so every rank refuses alike, here (on
        one node nothing is striped and the option does nothing)."""
        if len(self.nodes) > 1 and len(set(thresholds.values())) > 1:
            values = ", ".join(f"rank {r}: {v}" for r, v in sorted(thresholds.items()))
            raise ShmError(
                f"rank {self.groups.rank}: shm: stripe_min_bytes differs across the replica "
                f"({values}); build the strategy with the same options on every rank"
            )

    def _accept(self, listener: socket.socket, token: bytes) -> None:
        listener.settimeout(CONNECT_TIMEOUT_S)
        while len(self.socks) < len(self.readers):
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                missing = sorted(set(self.readers) - set(self.socks))
                raise ShmError(
                    f"rank {self.groups.rank}: shm: node-local ranks {missing} did not connect "
                    f"within {CONNECT_TIMEOUT_S:.0f} s"
                ) from None
            conn.settimeout(CONNECT_TIMEOUT_S)
            try:
                hello = conn.recv(HELLO.size)
                got, rank = HELLO.unpack(hello) if len(hello) == HELLO.size else (b"", -1)
            except (OSError, struct.error):
                got, rank = b"", -1
            uid = struct.unpack("3i", conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]  # fmt: skip
            if got != token or rank not in self.readers or rank in self.socks or uid != os.getuid():
                conn.close()  # not one of ours: its connection is refused, ours still awaited
                continue
            conn.setblocking(True)
            self.socks[rank] = conn

    def _dial(self, address: bytes, token: bytes) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.connect(address)
        except OSError as exc:
            sock.close()
            raise ShmError(
                f"rank {self.groups.rank}: shm: cannot reach node leader rank {self.node_leader}"
                f" over its Unix socket ({exc}); the two ranks were taken to share a host and a "
                "network namespace"
            ) from None
        sock.sendall(HELLO.pack(token, self.groups.rank))
        sock.settimeout(self.timeout_s)
        self.sock = sock

    # -- the writer (node leader) ----------------------------------------------------------
    def writer_slot(self) -> Slot:
        """The slot to write next: the next free one in turn, or the next one retired."""
        self._drain()
        n = len(self.slots)
        self._wait_behind(n)
        for step in range(n):
            slot = self.slots[(self.turn + step) % n]
            if not slot.holders:
                break
        else:
            slot = self.slots[self.turn % n]
            slot.retire()
        self.turn = slot.index + 1
        return slot

    @property
    def segments_made(self) -> int:
        """Segments the writer has made so far (growth and retired slots make them)."""
        return sum(slot.generation for slot in self.slots)

    def publish(self, slot: Slot, nbytes: int, early: bool = False) -> None:
        """Tell every reader that ``slot`` holds a message of ``nbytes`` bytes; ``early``: its
        header and non-tensor blob only, so far (``complete`` follows, or ``abort``)."""
        seg = slot.segment
        if seg is None or nbytes > seg.capacity:
            raise ShmError(f"rank {self.groups.rank}: shm: {nbytes} bytes do not fit the slot")
        self.sequence += 1
        self.published[0] = self.sequence
        slot.sequence = self.sequence
        slot.holders = set(self.readers)
        magic = EARLY_MAGIC if early else SIGNAL_MAGIC
        msg = SIGNAL.pack(magic, slot.index, seg.generation, self.sequence, nbytes)
        failed: list[str] = []
        for rank in self.readers:  # every live reader is told, whoever fails before it
            sock = self.socks.get(rank)
            if sock is None:
                failed.append(f"rank {rank} ({self.broken.get(rank, 'not connected')})")
                continue
            try:
                if rank in slot.delivered:  # it has the segment: a plain send is cheaper
                    sock.send(msg)
                else:
                    socket.send_fds(sock, [msg], [seg.fd])
            except Exception as exc:  # noqa: BLE001 -- reported once every reader had its turn
                failed.append(f"rank {rank} ({type(exc).__name__}: {exc})")
                # Closed, so that reader raises at once instead of waiting for a signal.
                self._drop(rank, f"its signal failed on an earlier call: {exc}")
                slot.holders.discard(rank)
                continue
            slot.delivered.add(rank)
        if failed:
            if early:  # the readers that were told wait for the rest: release them
                self.abort(slot, f"the signal to node-local {', '.join(failed)} failed")
            # Settled: every other reader has this call's message, so nothing may be shipped
            # in its place (it would reach them as their next call's batch).
            raise settled(ShmError(
                f"rank {self.groups.rank}: shm: the message could not be signalled to node-local "
                f"{', '.join(failed)}; every other node-local rank has it"
            ))  # fmt: skip

    def complete(self, slot: Slot) -> None:
        """Tell every reader of a message signalled early that all of it is in the slot."""
        msg = SIGNAL.pack(DONE_MAGIC, slot.index, slot.segment.generation, slot.sequence, 0)
        failed = self._tell(slot, [msg])
        if failed:
            raise settled(ShmError(
                f"rank {self.groups.rank}: shm: the message's completion could not be signalled "
                f"to node-local {', '.join(failed)}; every other node-local rank has it"
            ))  # fmt: skip

    def abort(self, slot: Slot, text: str) -> None:
        """The writer failed after an early signal: every reader raises with ``text``."""
        msg = SIGNAL.pack(ABORT_MAGIC, slot.index, slot.segment.generation, slot.sequence, 0)
        self._tell(slot, [msg, text.encode(errors="replace")[:ABORT_TEXT_BYTES]])

    def _tell(self, slot: Slot, messages: list[bytes]) -> list[str]:
        """Send ``messages`` to every live reader of the message in ``slot``; a reader whose
        socket fails is dropped (its socket closed: it raises at once). Returns the failures."""
        failed: list[str] = []
        for rank in self.readers:
            sock = self.socks.get(rank)
            if sock is None:  # dropped while signalling: publish named it
                continue
            try:
                for msg in messages:
                    sock.send(msg)
            except Exception as exc:  # noqa: BLE001 -- reported once every reader had its turn
                failed.append(f"rank {rank} ({type(exc).__name__}: {exc})")
                self._drop(rank, f"a message to it failed on an earlier call: {exc}")
                slot.holders.discard(rank)
        return failed

    def _drain(self) -> None:
        """Take every report the readers have sent since the last call, without waiting. A
        reader whose socket closed is dropped (``publish`` names it, after telling the rest)."""
        for rank, sock in list(self.socks.items()):
            while True:
                try:
                    raw = sock.recv(RELEASE.size, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    self._drop(rank, f"its socket failed: {exc}")
                    break
                if not raw:
                    self._drop(rank, "it closed its socket: it ended or died")
                    break
                if len(raw) == RELEASE.size:
                    self._report(rank, *RELEASE.unpack(raw))
        while self.local_releases:
            self._report(self.groups.rank, RELEASED, *self.local_releases.pop())

    def _wait_behind(self, n: int) -> None:
        """Block while some reader has not taken the signals of the last ``n`` messages: a
        leader that ran that far ahead would otherwise make a segment per call. It waits as
        long as a gloo collective would; a reader that dies meanwhile is dropped."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            behind = [r for r in self.socks if self.sequence - self.read_upto.get(r, 0) >= n]
            if not behind:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise ShmError(
                    f"rank {self.groups.rank}: shm: node-local ranks {sorted(behind)} took no "
                    f"signal for {self.timeout_s:.0f} s (the replica's gloo timeout)"
                )
            select.select([self.socks[r] for r in behind], [], [], left)
            self._drain()

    def _drop(self, rank: int, why: str) -> None:
        sock = self.socks.pop(rank, None)
        if sock is not None:
            _close_quietly(sock)
        self.broken[rank] = why

    def _report(self, rank: int, kind: int, index: int, generation: int, sequence: int) -> None:
        if kind == READ:
            self.read_upto[rank] = max(self.read_upto.get(rank, 0), sequence)
        elif kind == STRIPED:
            self.striped_upto[rank] = max(self.striped_upto.get(rank, 0), sequence)
        elif index < len(self.slots):
            slot = self.slots[index]
            if slot.generation == generation and slot.sequence == sequence:
                slot.holders.discard(rank)

    # -- a reader --------------------------------------------------------------------------
    def premap(self) -> Premap | None:
        """A reader, before it waits: a copy-on-write mapping of the slot the next message
        most likely arrives in (the one after the last, as the writer takes them in turn),
        made while the writer still packs; None until this reader holds that slot's segment.
        ``receive`` uses it when the signal names that very segment; otherwise it is dropped
        unused and releases nothing."""
        if self.last_index is None:
            return None
        index = (self.last_index + 1) % len(self.slots)
        held = self.fds.get(index)
        if held is None:
            return None
        generation, fd = held
        claim: list[int] = []
        view = map_private(
            fd, None, self.groups.rank, _release_claimed, self.sock, claim, index, generation
        )
        return Premap(index, generation, view, claim)

    def receive(self, premap: Premap | None = None) -> torch.Tensor:
        """Wait for the next message; returns it as a copy-on-write view of its segment (the
        release goes out when the last tensor viewing it dies): ``premap``'s view when the
        message is in its segment, else a new mapping. On the replica leader's node a
        stripe sender sends its stripes before it returns; on another node a stripe receiver
        writes its stripe first, when its node leader asks."""
        while True:
            magic, index, generation, sequence, nbytes = self._next_message()
            if magic in (SIGNAL_MAGIC, EARLY_MAGIC):
                break
            self._write_stripe(index, generation, sequence, nbytes)
        self.pending = sequence if magic == EARLY_MAGIC else None
        try:  # waits for room: the leader may be waiting for exactly this report
            self.sock.send(RELEASE.pack(READ, index, generation, sequence))
        except OSError:  # the leader is gone: this message is whole all the same
            pass
        self.last_index = index
        if (
            premap is not None
            and (premap.index, premap.generation) == (index, generation)
            and 0 < nbytes <= premap.view.numel()
        ):
            premap.claim.append(sequence)
            view = premap.view[:nbytes]
        else:
            view = map_private(
                self._fd(index, generation), nbytes, self.groups.rank, _send_report, self.sock,
                RELEASED, index, generation, sequence,
            )  # fmt: skip
        if self.groups.rank in self.nodes[0]:
            for handle in self._send_stripes(view, nbytes):
                handle.wait()
        return view

    def wait_complete(self) -> None:
        """A reader of a message signalled early (``pending``): wait until all of it is in the
        segment; the writer's failure meanwhile is raised here, as the leader's."""
        sequence, self.pending = self.pending, None
        if sequence is None:
            return
        magic, _, _, got, _ = self._next_message(DONE_MAGIC, ABORT_MAGIC)
        if magic == ABORT_MAGIC:
            try:
                text = self.sock.recv(ABORT_TEXT_BYTES).decode(errors="replace")
            except OSError:
                text = ""
            raise settled(leader_failed(self.groups, text or "it failed while writing"))
        if got != sequence:
            self.close()
            raise ShmError(
                f"rank {self.groups.rank}: shm: the completion of message {got} arrived while "
                f"message {sequence} was awaited; the channel is closed"
            )

    def _next_message(self, *accept: bytes) -> tuple[bytes, int, int, int, int]:
        """A reader: the next message from the node leader, one of ``accept`` (by default a
        signal, early or not, or a stripe request); a segment's fd that comes with it is kept
        for its slot."""
        accept = accept or (SIGNAL_MAGIC, EARLY_MAGIC, STRIPE_MAGIC)
        rank = self.groups.rank
        if self.sock is None or self.sock.fileno() == -1:
            raise ShmError(
                f"rank {rank}: shm: node leader rank {self.node_leader}: the channel closed on "
                "an earlier call; build the strategy again"
            )
        try:
            msg, fds, _, _ = socket.recv_fds(self.sock, SIGNAL.size, 1)
        except TimeoutError:
            raise ShmError(
                f"rank {rank}: shm: no message from node leader rank {self.node_leader} within "
                f"{self.timeout_s:.0f} s (the replica's gloo timeout)"
            ) from None
        except OSError as exc:
            self.sock.close()
            raise ShmError(
                f"rank {rank}: shm: node leader rank {self.node_leader}: {exc}"
            ) from None
        if not msg:
            self.sock.close()
            raise ShmError(
                f"rank {rank}: shm: node leader rank {self.node_leader} closed its socket (it "
                "ended or died)"
            )
        if len(msg) != SIGNAL.size or msg[:4] not in accept:
            for fd in fds:
                os.close(fd)
            self.sock.close()  # out of step with the writer: nothing after it can be trusted
            raise ShmError(
                f"rank {rank}: shm: a malformed signal of {len(msg)} bytes (magic "
                f"{msg[:4]!r}; expected one of {b', '.join(accept).decode()}); the channel is closed"
            )
        magic, index, generation, sequence, nbytes = SIGNAL.unpack(msg)
        if fds:
            old = self.fds.pop(index, None)
            if old is not None:
                os.close(old[1])
            for extra in fds[1:]:
                os.close(extra)
            self.fds[index] = (generation, fds[0])
        return magic, index, generation, sequence, nbytes

    def _fd(self, index: int, generation: int) -> int:
        held = self.fds.get(index)
        if held is None or held[0] != generation:
            raise ShmError(
                f"rank {self.groups.rank}: shm: slot {index} generation {generation} arrived "
                "without its segment"
            )
        return held[1]

    def _write_stripe(self, index: int, generation: int, sequence: int, nbytes: int) -> None:
        """A stripe receiver: this rank's stripe of message ``sequence`` straight from its
        sender into the slot's segment (a shared mapping, dropped at once), then the report."""
        rank = self.groups.rank
        fd = self._fd(index, generation)
        size = os.fstat(fd).st_size
        mine = [s for s in self._node_stripes(nbytes) if s.receiver == rank]
        if nbytes > size or len(mine) != 1 or mine[0].sender == self.groups.leader:
            raise ShmError(
                f"rank {rank}: shm: a stripe request for {nbytes} bytes in a {size}-byte "
                f"segment that gives this rank no stripe of its own"
            )
        s = mine[0]
        mapping = mmap.mmap(fd, s.hi, flags=mmap.MAP_SHARED)
        array = np.frombuffer(mapping, dtype=np.uint8)
        try:
            dist.recv(
                torch.from_numpy(array[s.lo :]), s.sender, group=self.groups.cpu_replica_group
            )
        finally:
            del array
            try:
                mapping.close()
            except BufferError:  # still viewed by a failed receive's frame: it goes with it
                pass
        try:
            self.sock.send(RELEASE.pack(STRIPED, index, generation, sequence))
        except OSError as exc:
            raise ShmError(
                f"rank {rank}: shm: node leader rank {self.node_leader}: its stripe report "
                f"failed ({exc})"
            ) from None

    def view_own(self, slot: Slot, nbytes: int) -> torch.Tensor:
        """A node leader's own copy-on-write view of what it published (a receiver too, when it
        is not the replica leader); its release is local."""
        seg = slot.segment
        slot.holders.add(self.groups.rank)
        release = (slot.index, seg.generation, slot.sequence)  # _report's, after RELEASED
        return map_private(seg.fd, nbytes, self.groups.rank, self.local_releases.append, release)

    # -- across nodes ----------------------------------------------------------------------
    def hand_over(self, slot: Slot, buf: torch.Tensor, announce: bool) -> None:
        """Replica leader: ``buf`` (the message in ``slot``'s segment) to every other node's
        leader and to this node's readers. The point-to-point sends (the size first when
        ``announce``, then the bytes or this rank's stripes of them) are posted before this
        node is signalled, so the other nodes' transfers run while it signals; then they are waited for. A send that fails
        to post leaves nobody waiting for a signal: nothing was signalled yet."""
        g = self.groups
        others = g.node_leaders[1:]
        handles = []
        if announce and others:
            size = torch.tensor([buf.numel()], dtype=torch.int64)
            handles += [dist.isend(size, dst, group=g.cpu_replica_group) for dst in others]
        handles += self._send_stripes(buf, buf.numel())
        self.publish(slot, max(buf.numel(), 1))
        for h in handles:
            h.wait()

    def receive_from_leader(self, nbytes: int | None, max_bytes: int) -> torch.Tensor:
        """A node leader other than the replica leader: the replica leader's bytes straight into
        this node's segment (``nbytes``, or the size it announces first when None), signalled
        to this node; returns this rank's own copy-on-write view of them."""
        g = self.groups
        if nbytes is None:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, g.leader, group=g.cpu_replica_group)
            nbytes = int(size[0])
            if not 0 < nbytes <= max_bytes:
                raise ShmError(
                    f"rank {g.rank}: shm: the leader announced {nbytes} bytes; expected 1 to "
                    f"max_bytes={max_bytes}"
                )
        slot = self.writer_slot()
        view = slot.buffer(max(nbytes, 1))
        mine, *theirs = self._node_stripes(nbytes)
        if theirs:
            self._request_stripes(slot, theirs, nbytes)
        dist.recv(view[mine.lo : mine.hi], mine.sender, group=g.cpu_replica_group)
        if theirs:
            self._wait_striped([s.receiver for s in theirs], self.sequence + 1)
        self.publish(slot, max(nbytes, 1))
        return self.view_own(slot, max(nbytes, 1))[:nbytes]

    def _node_stripes(self, nbytes: int) -> tuple[Stripe, ...]:
        """This rank's node's stripes of a message of ``nbytes`` (a node other than the
        replica leader's), its node leader's first."""
        me = self.groups.rank
        return next(node for node in self._stripes(nbytes) if any(s.receiver == me for s in node))

    def _stripes(self, nbytes: int) -> tuple[tuple[Stripe, ...], ...]:
        """``groups.stripes`` for this replica's nodes, remembered for the last size (a
        stream of same-sized messages asks for the same stripes on both sides every call)."""
        if self._stripes_of[0] != nbytes:
            self._stripes_of = (nbytes, stripes(self.nodes, nbytes, self.stripe_min_bytes))
        return self._stripes_of[1]

    def _send_stripes(self, buf: torch.Tensor, nbytes: int) -> list:
        """Post this rank's stripes of the message in ``buf`` to the other nodes (the replica
        leader's node only); returns the sends' handles."""
        g = self.groups
        return [
            dist.isend(buf[s.lo : s.hi], s.receiver, group=g.cpu_replica_group)
            for node in self._stripes(nbytes)
            for s in node
            if s.sender == g.rank
        ]

    def _request_stripes(self, slot: Slot, theirs, nbytes: int) -> None:
        """Node leader: hand each stripe's receiver the slot's segment to write its stripe of
        the next message into. A request that cannot be sent leaves a stripe nobody writes:
        the channel closes, so every rank of the node learns at once."""
        seg = slot.segment
        msg = SIGNAL.pack(STRIPE_MAGIC, slot.index, seg.generation, self.sequence + 1, nbytes)
        for s in theirs:
            sock = self.socks.get(s.receiver)
            try:
                if sock is None:
                    raise ShmError(self.broken.get(s.receiver, "not connected"))
                socket.send_fds(sock, [msg], [] if s.receiver in slot.delivered else [seg.fd])
            except Exception as exc:  # noqa: BLE001 -- named in the error below
                self.close()
                raise ShmError(
                    f"rank {self.groups.rank}: shm: node-local rank {s.receiver} cannot be asked "
                    f"for its stripe ({type(exc).__name__}: {exc}); the channel is closed"
                ) from None
            slot.delivered.add(s.receiver)

    def _wait_striped(self, ranks: list[int], sequence: int) -> None:
        """Node leader: block until every rank of ``ranks`` has reported its stripe of message
        ``sequence`` written, as long as a gloo receive would wait; a rank that dies closes the
        channel, so the node's other ranks learn at once."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._drain()
            left = [r for r in ranks if self.striped_upto.get(r, 0) < sequence]
            if not left:
                return
            gone = [r for r in left if r not in self.socks]
            why = None
            if gone:
                why = "; ".join(f"rank {r}: {self.broken.get(r)}" for r in gone)
            elif time.monotonic() >= deadline:
                why = f"no report within {self.timeout_s:.0f} s (the replica's gloo timeout)"
            if why:
                self.close()
                raise ShmError(
                    f"rank {self.groups.rank}: shm: node-local ranks {left} did not write their "
                    f"stripes ({why}); the channel is closed"
                )
            select.select([self.socks[r] for r in left], [], [], deadline - time.monotonic())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.sock is not None:
                self.sock.close()
            _close_all(self.socks, self.fds, self.slots, self.read_upto, self.published)


def map_private(fd: int, nbytes: int | None, rank: int, on_release, *args) -> torch.Tensor:
    """The first ``nbytes`` of a segment (None: all of it), mapped copy-on-write, as a uint8
    tensor; ``on_release(*args)`` runs when the last tensor viewing it dies (the array the
    tensor's storage holds is what dies last)."""
    size = os.fstat(fd).st_size
    if nbytes is None:
        nbytes = size
    if nbytes > size or nbytes == 0:
        raise ShmError(
            f"rank {rank}: shm: a message of {nbytes} bytes announced for a {size}-byte segment"
        )
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    array = np.frombuffer(mapping, dtype=np.uint8)
    weakref.finalize(array, on_release, *args)
    return torch.from_numpy(array)


@dataclass
class Premap:
    """A reader's mapping of the segment it expects the next message in (``premap``)."""

    index: int
    generation: int
    view: torch.Tensor
    """The whole segment, copy-on-write."""
    claim: list[int]
    """The sequence of the message that took this mapping, once one has: its release."""


def _release_claimed(sock: socket.socket, claim: list[int], index: int, generation: int) -> None:
    # A premap no message took held nothing the writer waits for.
    if claim:
        _send_report(sock, RELEASED, index, generation, claim[0])


def _send_report(sock: socket.socket, kind: int, index: int, generation: int, seq: int) -> None:
    # A finalizer's report must not wait: one that finds the queue full is lost, and its slot
    # is retired (a new segment) when its turn comes instead of reused.
    try:
        sock.send(RELEASE.pack(kind, index, generation, seq), socket.MSG_DONTWAIT)
    except OSError:  # the leader is gone or the channel closed: nothing holds the slot now
        pass


def _take_reports(sock: socket.socket, rank: int, read_upto: dict) -> None:
    """A closing writer's drain: only the read reports matter now."""
    try:
        while raw := sock.recv(RELEASE.size, socket.MSG_DONTWAIT):
            if len(raw) == RELEASE.size:
                kind, _, _, sequence = RELEASE.unpack(raw)
                if kind == READ:
                    read_upto[rank] = max(read_upto.get(rank, 0), sequence)
        read_upto[rank] = 1 << 62  # closed by the reader: nothing left to wait for
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:
        read_upto[rank] = 1 << 62


def _close_quietly(sock: socket.socket) -> None:
    # A Unix socket closed with unread data resets its peer, which then loses a signal it has
    # not read yet: take the releases first.
    try:
        while sock.recv(RELEASE.size, socket.MSG_DONTWAIT):
            pass
    except OSError:
        pass
    sock.close()


def _close_all(socks: dict, fds: dict, slots: list, read_upto: dict, published: list) -> None:
    # A reader that has not taken the last signal yet would lose it to the reset a close with
    # unread data sends (a release can arrive after any drain): wait, briefly, until every
    # reader has reported it read the last signal.
    deadline = time.monotonic() + CLOSE_WAIT_S
    while socks and time.monotonic() < deadline:
        behind = [s for r, s in socks.items() if read_upto.get(r, 0) < published[0]]
        if not behind:
            break
        ready, _, _ = select.select(behind, [], [], max(deadline - time.monotonic(), 0))
        for rank, sock in socks.items():
            if sock in ready:
                _take_reports(sock, rank, read_upto)
    for sock in socks.values():
        _close_quietly(sock)
    socks.clear()
    for _, fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    for slot in slots:
        slot.retire()
