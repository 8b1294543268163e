"""The node leader's side of the node channel: it takes the next free slot of the ring,
signals its readers that a message is in it, and takes their reports back.

A part of ``NodeChannel`` (``strategies.core.node_channel``), which sets the state every part
reads (``groups``, ``readers``, ``timeout_s``); this part keeps its own (``_init_writer``).
"""

from __future__ import annotations

import select
import socket
import time

import torch

from strategies.core.contract import settled
from strategies.core.node_signals import (
    ABORT_MAGIC,
    ABORT_TEXT_BYTES,
    COMPLETED,
    DONE_MAGIC,
    EARLY_MAGIC,
    POLL_SLEEP_S,
    READ,
    RELEASE,
    RELEASED,
    SIGNAL,
    SIGNAL_MAGIC,
    STRIPED,
    WORD_WAIT_S,
    ReportWords,
    ShmError,
    close_quietly,
    given_up,
)
from strategies.core.phase_clock import CLOCK
from strategies.core.segment_ring import Slot, map_private, reuses


class RingWriter:
    """The node leader's half of a ``NodeChannel``: ``writer_slot`` + ``publish`` (or, signalled
    early, ``publish(early=True)`` then ``complete`` or ``abort``) per message; ``abandon``
    when the leader cannot send a message at all."""

    def _init_writer(self, slots: int) -> None:
        self.slots = [Slot(i) for i in range(slots)]
        self.turn = 0
        self.sequence = 0
        self.last_nbytes = 0  # the last message's size: a large one's slot is reused (reuses)
        self.socks: dict[int, socket.socket] = {}  # reader rank -> its socket
        self.broken: dict[int, str] = {}  # reader rank -> why its socket was dropped
        self.read_upto: dict[int, int] = {}  # reader rank -> last sequence it took
        self.striped_upto: dict[int, int] = {}  # reader rank -> last message it striped
        self.local_releases: list[tuple[int, int, int]] = []  # a node leader's own views
        self.published = [0]  # the last sequence signalled (shared with the finalizer)
        self._ready: select.poll | None = None  # the readers' sockets, polled by _drain
        self._polled: dict[int, int] = {}  # fd -> reader rank, what _ready holds
        self.words = ReportWords()
        """The readers' report words, where they keep them (set at ``connect``)."""

    def writer_slot(self) -> Slot:
        """The slot to write next: after a large message (``segment_ring.reuses``) its own
        slot again when every reader let it go; otherwise the next free one in turn, or the
        next one retired."""
        self._drain()
        n = len(self.slots)
        self._wait_behind(n)
        last = self.slots[(self.turn - 1) % n]
        if reuses(self.last_nbytes) and not last.holders and last.segment is not None:
            return last
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
        self.last_nbytes = nbytes
        slot.sequence = self.sequence
        slot.holders = set(self.readers)
        magic = EARLY_MAGIC if early else SIGNAL_MAGIC
        msg = SIGNAL.pack(magic, slot.index, seg.generation, self.sequence, nbytes)
        before = CLOCK.switch("signal")
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
        CLOCK.switch(before)
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
        """Tell every reader of a message signalled early that all of it is in the slot: where
        they poll (``poll_us``), the completion word, which they read; else a ``DONE_MAGIC`` on
        each reader's socket."""
        before = CLOCK.switch("signal")
        if self.poll_us is not None:
            COMPLETED.pack_into(self.completion, 0, slot.sequence)
            CLOCK.switch(before)
            return
        msg = SIGNAL.pack(DONE_MAGIC, slot.index, slot.segment.generation, slot.sequence, 0)
        failed = self._tell(slot, [msg])
        CLOCK.switch(before)
        if failed:
            raise settled(ShmError(
                f"rank {self.groups.rank}: shm: the message's completion could not be signalled "
                f"to node-local {', '.join(failed)}; every other node-local rank has it"
            ))  # fmt: skip

    def abort(self, slot: Slot, text: str) -> None:
        """The writer failed after an early signal: every reader raises with ``text``."""
        msg = SIGNAL.pack(ABORT_MAGIC, slot.index, slot.segment.generation, slot.sequence, 0)
        self._tell(slot, [msg, text.encode(errors="replace")[:ABORT_TEXT_BYTES]])

    def abandon(self, text: str) -> bool:
        """The writer cannot send its message (a failure it could not even ship): every
        connected reader is told ``text`` (an abort outside any message, which its ``receive``
        raises as the leader's failure) and the channel is closed; a reader the abort did not
        reach finds its socket closed. True: no reader is left waiting."""
        msg = SIGNAL.pack(ABORT_MAGIC, 0, 0, 0, 0)
        for sock in list(self.socks.values()):
            try:  # never waits: a reader whose queue is full learns from the close instead
                sock.send(msg, socket.MSG_DONTWAIT)
                sock.send(text.encode(errors="replace")[:ABORT_TEXT_BYTES], socket.MSG_DONTWAIT)
            except OSError:
                pass
        self.close(given_up(text))
        return True

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
        """Take every report the readers have made since the last call, without waiting: their
        report words (``ReportWords``), then what their sockets hold. A reader whose socket
        closed is dropped (``publish`` names it, after telling the rest). Polled, one report
        per ready socket per poll until none is ready: a receive tried on a socket with
        nothing to read costs a failed system call and an exception."""
        if self.words.page is not None:
            self._read_words()
        while self.socks:
            ready = self._poller().poll(0)
            if not ready:
                break
            for fd, _ in ready:
                rank = self._polled.get(fd)
                if rank is not None and rank in self.socks:
                    self._take(rank, self.socks[rank])
        while self.local_releases:
            self._report(self.groups.rank, RELEASED, *self.local_releases.pop())

    def _read_words(self) -> None:
        """The report words of every connected reader: the signals it took, and each slot's
        message it let go of."""
        words, socks = self.words, self.socks
        for rank in words.at:
            if rank in socks:
                self.read_upto[rank] = words.read(rank)
        for slot in self.slots:
            for rank in [r for r in slot.holders if r in words.at]:
                if words.released(rank, slot.index) >= slot.sequence:
                    slot.holders.discard(rank)

    def _poller(self) -> select.poll:
        """``_ready``, made again after the set of sockets changed (whatever adds or drops a
        reader's socket forgets it)."""
        if self._ready is None:
            self._ready = select.poll()
            self._polled = {}
            for rank, sock in self.socks.items():
                self._ready.register(sock, select.POLLIN)
                self._polled[sock.fileno()] = rank
        return self._ready

    def _take(self, rank: int, sock: socket.socket) -> None:
        """One report from ``rank``'s socket, which the poll found ready; drops the reader
        when it closed or failed."""
        try:
            raw = sock.recv(RELEASE.size, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(rank, f"its socket failed: {exc}")
            return
        if not raw:
            self._drop(rank, "it closed its socket: it ended or died")
        elif len(raw) == RELEASE.size:
            self._report(rank, *RELEASE.unpack(raw))

    def _wait_behind(self, n: int) -> None:
        """Block while some reader has not taken the signals of the last ``n`` messages: a
        leader that ran that far ahead would otherwise make a segment per call. It waits as
        long as a gloo collective would; a reader that dies meanwhile is dropped. A word wakes
        nobody: readers that report in words are looked at again after a pause that doubles
        from ``POLL_SLEEP_S`` to ``WORD_WAIT_S``."""
        deadline = time.monotonic() + self.timeout_s
        pause = POLL_SLEEP_S
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
            if any(r in self.words.at for r in behind):
                left, pause = min(left, pause), min(2 * pause, WORD_WAIT_S)
            select.select([self.socks[r] for r in behind], [], [], left)
            self._drain()

    def _drop(self, rank: int, why: str) -> None:
        sock = self.socks.pop(rank, None)
        if sock is not None:
            self._ready = None  # its fd may be reused by the next socket opened
            close_quietly(sock)
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

    def view_own(self, slot: Slot, nbytes: int) -> torch.Tensor:
        """A node leader's own copy-on-write view of what it published (a receiver too, when it
        is not the replica leader); its release is local."""
        seg = slot.segment
        slot.holders.add(self.groups.rank)
        release = (slot.index, seg.generation, slot.sequence)  # _report's, after RELEASED
        return map_private(seg.fd, nbytes, self.groups.rank, self.local_releases.append, release)
