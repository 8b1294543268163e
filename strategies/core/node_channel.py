"""Moving one message to the ranks of a node through shared memory: the node channel a node
leader and its node-local readers share, its set-up, and its closing.

The channel is a ring of segments the node leader writes and its node-local ranks map
(``strategies.core.segment_ring``), a Unix socket per reader for the signal, a shared page for
the completion word and the readers' reports (``strategies.core.node_signals``), and (across
nodes) point-to-point sends from the replica leader to each node leader
(``strategies.core.node_crossing``). The writer's and a reader's halves are
``strategies.core.ring_writer`` and ``strategies.core.ring_reader``.

A segment's fd is handed to each reader once per segment over its socket (``SCM_RIGHTS``). The
sockets live in the abstract namespace (no file), so nothing is left behind by any ending,
kill -9 included.

A reader waits for a signal as long as a gloo collective on the same replica would (that
group's timeout); a leader that dies closes its sockets, and its readers learn at once.

The protocol, one message, in the order it happens (a store strategy's side is
``strategies.core.node_store``; shm's early signal is ``Shm._write_early``):

| side   | step      | what happens                                                | where |
|--------|-----------|-------------------------------------------------------------|-------|
| both   | connect   | readers dial the node leader's socket, get the completion    | ``NodeChannel.connect`` |
|        |           | page; stripe thresholds agreed (first call only)             | |
| leader | take slot | its own slot again after a large message every reader let go | ``RingWriter.writer_slot`` |
|        |           | (``segment_ring.reuses``), else the next free one, else the  | |
|        |           | next one retired (its holder keeps the old segment)          | |
| leader | pack      | header + leaves written into the slot's segment by the slot's | ``NodeStore.put`` (``Slot.packer``) |
|        |           | packer (or replayed: ``Shm._replay``)                        | |
| leader | publish   | one socket message per reader (the segment's fd the first    | ``NodeCrossing.hand_over``, |
|        |           | time); across nodes the sends to each node leader first      | ``RingWriter.publish`` |
| leader | fill      | early signal only: the leaves copied after ``publish(early)`` | ``Filler``, ``Shm._write_early`` |
| leader | complete  | early signal only: the completion word (or a socket message) | ``RingWriter.complete`` / ``abort`` |
| reader | premap    | the slot it most likely gets, mapped while it waits          | ``RingReader.premap`` |
| reader | receive   | the signal; a copy-on-write view of the segment; its "read"  | ``RingReader.receive`` |
|        |           | report (a word on the shared page, or a socket message)      | |
| reader | header    | the header read in place, checked against the segment        | ``NodeStore.stored_header`` |
| reader | wait      | early signal only: the completion, or the leader's abort     | ``RingReader.wait_complete`` |
| reader | release   | when the last tensor viewing the segment dies, its "let go"  | ``segment_ring.map_private`` |
|        |           | report; the leader's ``_drain`` frees the slot for reuse     | (``RingWriter._drain``) |
| both   | close     | sockets closed, segments unmapped; a reader raises at once   | ``NodeChannel.close`` |
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

import torch.distributed as dist

from strategies.core.contract import Unsupported, settled
from strategies.core.node_crossing import NodeCrossing
from strategies.core.node_signals import (
    CONTROL_MAGIC,
    HELLO,
    READ,
    RELEASE,
    REPORT,
    SIGNAL,
    WORD_WAIT_S,
    ReportWords,
    ShmError,
    available,
    check_poll_option,
    check_size_option,
    close_quietly,
    completion_page,
    completion_page_bytes,
    group_timeout_s,
    polls,
    release_at,
    report_at,
    report_words_allowed,
)
from strategies.core.process_groups import ProcessGroups
from strategies.core.ring_reader import RingReader
from strategies.core.ring_writer import RingWriter

DEFAULT_STRIPE_MIN_BYTES = 1 << 20
"""Messages from this size on cross nodes in stripes (``groups.stripes``); below it the extra
signal and report cost more than a second link saves."""
DEFAULT_SLOTS = 3
"""Segments in the ring: a batch held while the next one arrives still leaves a free slot."""
CLOSE_WAIT_S = 5.0
"""How long a closing writer waits for its readers to take the last signal."""
CONNECT_TIMEOUT_S = 60.0
"""How long the node leader waits for its readers to connect while the channel is set up."""
DEFAULT_POLL_US = 2000
"""How long a reader polls the completion word of a message signalled early (``poll_us``)."""


def ranks_on_node(groups: ProcessGroups) -> int:
    """How many ranks of the world share this rank's node (every rank when the nodes are
    unknown: one node)."""
    if groups.node_of:
        mine = groups.node_of[groups.rank]
        return sum(1 for node in groups.node_of if node == mine)
    return dist.get_world_size() if dist.is_initialized() else len(groups.replica_ranks)


class NodeChannel(RingWriter, RingReader, NodeCrossing):
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
        poll_us: int | None = DEFAULT_POLL_US,
    ) -> None:
        why = available()
        if why:
            raise Unsupported(f"shm: {why}")
        if slots < 1:
            raise ValueError(f"shm: slots must be >= 1, got {slots}")
        check_size_option("stripe_min_bytes", stripe_min_bytes)
        check_poll_option(poll_us)
        self.groups = groups
        self.nodes = groups.replica_nodes
        self.stripe_min_bytes = stripe_min_bytes
        self.local = groups.node_local_ranks
        self.node_leader = self.local[0]
        self.is_node_leader = groups.rank == self.node_leader
        self.readers = tuple(r for r in self.local if r != self.node_leader)
        self.timeout_s = group_timeout_s(groups.cpu_replica_group)
        self.poll_us = poll_us if polls(poll_us, ranks_on_node(groups)) else None
        """The node leader: how long its readers spin on their socket for a signal before they
        block, and on the completion word of a message signalled early before they look at it
        between sleeps; None: they block, and wait for the completion's socket message instead
        (``node_signals.polls``). The node leader's own decides for its node: it sends it with
        its answer to each reader's hello."""
        self.poll_s: float | None = None
        """A reader: its node leader's ``poll_us`` in seconds, once connected."""
        self.connected = False
        self.closed = False
        self.closed_why = ""
        """Why the channel closed (``close``), for the error of a call made on it since."""
        self.completion: mmap.mmap | None = None
        """The node leader's completion page (``node_signals.COMPLETED``, and the readers'
        report words where they keep them, ``ReportWords``): its shared mapping on every rank
        of the node; None until ``connect``."""
        self._init_writer(slots)
        self._init_reader()
        self._init_crossing()
        weakref.finalize(
            self, _close_all, self.socks, self.fds, self.slots, self.read_upto, self.published,
            self.words,
        )  # fmt: skip

    @property
    def node_local(self) -> bool:
        """Connected, with the whole replica on this node: a message is shared memory and
        socket messages only (no point-to-point send, no stripe)."""
        return self.connected and len(self.nodes) == 1

    # -- set-up ----------------------------------------------------------------------------
    def connect(self) -> None:
        """Every node leader listens on a fresh abstract address; the replica learns them in
        one all-gather; each reader connects to its node leader and proves it is of this job
        with the token that travelled in the gather."""
        g = self.groups
        if self.closed:  # a set-up that failed is not tried again: the others are not in it
            raise settled(ShmError(
                f"rank {g.rank}: shm: the channel closed on an earlier call ({self.closed_why}); "
                "build the strategy again"
            ))  # fmt: skip
        listener = None
        mine = None
        page_fd = None
        if self.is_node_leader and self.readers:
            token = secrets.token_bytes(16)
            address = b"\0bcastbench-shm-" + secrets.token_hex(12).encode()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            listener.bind(address)
            listener.listen(len(self.readers))
            mine = (address, token)
        offers: list = [None] * len(g.replica_ranks)
        try:  # the listener is closed whatever happens from here, a failed gather included
            dist.all_gather_object(
                offers, (g.rank, mine, self.stripe_min_bytes), group=g.cpu_replica_group
            )
            by_rank = {rank: offer for rank, offer, _ in offers}
            self._agree_on_stripes({rank: threshold for rank, _, threshold in offers})
            if listener is not None:
                page_fd, self.completion = completion_page(
                    completion_page_bytes(len(self.readers), len(self.slots))
                )
                if report_words_allowed():
                    self.words.page = self.completion
                    self.words.at = {
                        rank: report_at(i, len(self.slots)) for i, rank in enumerate(self.readers)
                    }
                self._accept(listener, mine[1], page_fd)
            elif not self.is_node_leader:
                self._dial(*by_rank[self.node_leader])
        except ShmError as exc:
            # Readers that did connect learn of it from their closed socket, not a timeout.
            self.close("its set-up failed")
            raise settled(exc) from None
        finally:
            if listener is not None:
                listener.close()
            if page_fd is not None:  # every reader that connected holds it now
                os.close(page_fd)
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

    def _accept(self, listener: socket.socket, token: bytes, page_fd: int) -> None:
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
            # The answer to its hello: the completion page, whether to poll it, and where on it
            # the reader's report words are (0: it reports on its socket) for how many slots.
            at = self.words.at.get(rank, 0)
            answer = SIGNAL.pack(CONTROL_MAGIC, len(self.slots), 0, at, self.poll_us or 0)
            try:
                socket.send_fds(conn, [answer], [page_fd])
            except OSError:  # it went away after its hello: awaited like one not yet here
                conn.close()
                continue
            self.socks[rank] = conn
            self._ready = None  # the drain's poll holds every reader's socket

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
        self.completion = self._completion_page()

    def _completion_page(self) -> mmap.mmap:
        """A reader, once it said hello: the node leader's answer, its completion page, mapped
        shared, how long to spin on it (``poll_s``), and where on it this reader's report
        words are (``report_at``; None: it reports on its socket)."""
        rank = self.groups.rank
        try:
            msg, fds, _, _ = socket.recv_fds(self.sock, SIGNAL.size, 1)
        except OSError as exc:
            raise ShmError(
                f"rank {rank}: shm: node leader rank {self.node_leader} did not answer its "
                f"hello ({type(exc).__name__}: {exc})"
            ) from None
        try:
            if len(msg) != SIGNAL.size or msg[:4] != CONTROL_MAGIC or len(fds) != 1:
                raise ShmError(
                    f"rank {rank}: shm: node leader rank {self.node_leader} answered its hello "
                    f"with {len(msg)} bytes (magic {msg[:4]!r}) and {len(fds)} fds; expected "
                    f"{CONTROL_MAGIC!r} with its completion page"
                )
            _, slots, _, at, poll_us = SIGNAL.unpack(msg)
            self.poll_s = poll_us / 1e6 if poll_us else None
            size = os.fstat(fds[0]).st_size
            if at and (at % REPORT.size or slots < 1 or release_at(at, slots) > size):
                raise ShmError(
                    f"rank {rank}: shm: node leader rank {self.node_leader} placed this rank's "
                    f"report words at byte {at} for {slots} slots of a {size}-byte page; "
                    f"expected {REPORT.size}-byte aligned words inside the page"
                )
            self.report_at, self.report_slots = (at, slots) if at else (None, 0)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if at else 0)
            return mmap.mmap(fds[0], size, mmap.MAP_SHARED, prot)
        finally:
            for fd in fds:
                os.close(fd)

    def close(self, why: str = "it was closed") -> None:
        """Close the channel for good; ``why`` is what a later call on it says."""
        if not self.closed:
            self.closed = True
            self.closed_why = why
            if self.sock is not None:
                self.sock.close()
            _close_all(self.socks, self.fds, self.slots, self.read_upto, self.published, self.words)


def _take_reports(sock: socket.socket, rank: int, read_upto: dict) -> None:
    """A closing writer's drain of a socket: only the read reports matter now."""
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


def _close_all(
    socks: dict, fds: dict, slots: list, read_upto: dict, published: list, words: ReportWords
) -> None:
    # A reader that has not taken the last signal yet would lose it to the reset a close with
    # unread data sends: wait, briefly, until every reader has said it took the last signal
    # (a read word, or a report on its socket). A word wakes nobody, so readers that report in
    # words are looked at again every WORD_WAIT_S; a socket that has something (a report, or
    # the reader's end) wakes the wait.
    deadline = time.monotonic() + CLOSE_WAIT_S
    while socks and time.monotonic() < deadline:
        for rank in socks:
            if rank in words.at:
                read_upto[rank] = max(read_upto.get(rank, 0), words.read(rank))
        behind = {r: s for r, s in socks.items() if read_upto.get(r, 0) < published[0]}
        if not behind:
            break
        wait = max(deadline - time.monotonic(), 0)
        if any(r in words.at for r in behind):
            wait = min(wait, WORD_WAIT_S)
        ready, _, _ = select.select(list(behind.values()), [], [], wait)
        for rank, sock in behind.items():
            if sock in ready:
                _take_reports(sock, rank, read_upto)
    for sock in socks.values():
        close_quietly(sock)
    socks.clear()
    for _, fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    for slot in slots:
        slot.retire()
