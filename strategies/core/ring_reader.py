"""A reader's side of the node channel: it waits for its node leader's signal, maps the
message's segment copy-on-write and reports the signal taken and, later, the message released
(in its report words on the completion page, ``node_signals.ReportWords``, else on its socket).

A part of ``NodeChannel`` (``strategies.core.node_channel``), which sets the state every part
reads (``groups``, ``node_leader``, ``timeout_s``); this part keeps its own (``_init_reader``).
While it waits, a reader maps the slot the next message most likely lands in (``premap``).
A message signalled early (its header and non-tensor blob in, its leaves not yet) is read
while the writer copies; ``wait_complete`` waits for the rest, or raises the writer's error.
"""

from __future__ import annotations

import os
import select
import socket
import time

import torch

from strategies.core.contract import leader_failed, settled
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
    STRIPE_MAGIC,
    ShmError,
    given_up,
    release_at,
    send_report,
    write_report,
)
from strategies.core.segment_ring import Premap, map_private, release_claimed, reuses


class RingReader:
    """A reader's half of a ``NodeChannel``: ``premap`` before it waits, ``receive`` per
    message, and ``wait_complete`` for a message signalled early."""

    def _init_reader(self) -> None:
        self.sock: socket.socket | None = None  # the socket to the node leader
        self.fds: dict[int, tuple[int, int]] = {}  # slot -> (generation, fd)
        self.last_index: int | None = None  # the slot of the last message it took
        self.last_nbytes = 0  # its size: after a large one the writer reuses the slot
        self.pending: int | None = None  # a message signalled early, not complete yet
        self._sock_poll: select.poll | None = None  # the socket, for _sock_ready
        self.report_at: int | None = None
        """Where on the completion page this reader's report words are (``report_at``), once
        connected; None: it reports on its socket."""
        self.report_slots = 0
        """The node leader's slots, which have a release word each (with ``report_at``)."""
        self.polled_count = 0
        """Messages signalled early whose completion this reader read from the word."""

    def premap(self) -> Premap | None:
        """A reader, before it waits: a copy-on-write mapping of the slot the next message
        most likely arrives in (the one after the last, as the writer takes them in turn; the
        last one again after a large message, ``segment_ring.reuses``), made while the writer
        still packs; None until this reader holds that slot's segment.
        ``receive`` uses it when the signal names that very segment; otherwise it is dropped
        unused and releases nothing."""
        if self.last_index is None:
            return None
        step = 0 if reuses(self.last_nbytes) else 1
        index = (self.last_index + step) % len(self.slots)
        held = self.fds.get(index)
        if held is None:
            return None
        generation, fd = held
        claim: list[int] = []
        view = map_private(
            fd, None, self.groups.rank, release_claimed, claim, *self._release(index, generation)
        )
        return Premap(index, generation, view, claim)

    def receive(self, premap: Premap | None = None) -> torch.Tensor:
        """Wait for the next message; returns it as a copy-on-write view of its segment (the
        release goes out when the last tensor viewing it dies): ``premap``'s view when the
        message is in its segment, else a new mapping. On the replica leader's node a
        stripe sender sends its stripes before it returns; on another node a stripe receiver
        writes its stripe first, when its node leader asks. Where it polls (``poll_s``), it
        spins on its socket first, so a signal within that time wakes no one. A writer that
        gave up its channel (``RingWriter.abandon``) is raised here as the leader's failure,
        and the channel is closed."""
        while True:
            self._spin_for_message()
            magic, index, generation, sequence, nbytes = self._next_message()
            if magic in (SIGNAL_MAGIC, EARLY_MAGIC):
                break
            if magic == ABORT_MAGIC:  # the writer gave up (``RingWriter.abandon``)
                self._given_up(self._abort_text() or "it gave up its channel")
            self._write_stripe(index, generation, sequence, nbytes)
        self.pending = sequence if magic == EARLY_MAGIC else None
        if self.report_at is not None:
            write_report(self.completion, self.report_at, sequence)
        else:
            try:  # waits for room: the leader may be waiting for exactly this report
                self.sock.send(RELEASE.pack(READ, index, generation, sequence))
            except OSError:  # the leader is gone: this message is whole all the same
                pass
        self.last_index, self.last_nbytes = index, nbytes
        if (
            premap is not None
            and (premap.index, premap.generation) == (index, generation)
            and 0 < nbytes <= premap.view.numel()
        ):
            premap.claim.append(sequence)
            view = premap.view[:nbytes]
        else:
            view = map_private(
                self._fd(index, generation), nbytes, self.groups.rank,
                *self._release(index, generation), sequence,
            )  # fmt: skip
        if self.groups.rank in self.nodes[0]:
            for handle in self._send_stripes(view, nbytes):
                handle.wait()
        return view

    def _release(self, index: int, generation: int) -> tuple:
        """How this reader reports that it let go of a message in slot ``index`` (``generation``
        of its segment): a function and its arguments, the message's sequence to come last.
        Its release word for the slot, else a ``RELEASED`` report on its socket."""
        if self.report_at is not None:
            return write_report, self.completion, release_at(self.report_at, index)
        return send_report, self.sock, RELEASED, index, generation

    def wait_complete(self) -> None:
        """A reader of a message signalled early (``pending``): wait until all of it is in the
        segment; the writer's failure meanwhile is raised here, as the leader's."""
        sequence, self.pending = self.pending, None
        if sequence is None:
            return
        if self._polled_complete(sequence):
            self.polled_count += 1
            return
        magic, _, _, got, _ = self._next_message(DONE_MAGIC, ABORT_MAGIC)
        if magic == ABORT_MAGIC:
            text = self._abort_text() or "it failed while writing"
            if got != sequence:  # not this message's: the writer gave up its channel
                self._given_up(text)
            raise settled(leader_failed(self.groups, text))
        if got != sequence:
            self.close()
            raise ShmError(
                f"rank {self.groups.rank}: shm: the completion of message {got} arrived while "
                f"message {sequence} was awaited; the channel is closed"
            )

    def _given_up(self, text: str) -> None:
        """The writer gave up its channel (``RingWriter.abandon``) with its failure ``text``:
        close this end with the same reason, and raise it as the leader's failure."""
        self.close(given_up(text))
        raise settled(leader_failed(self.groups, text))

    def _abort_text(self) -> str:
        """The text that follows an abort in the socket ("" when it cannot be read)."""
        try:
            return self.sock.recv(ABORT_TEXT_BYTES).decode(errors="replace")
        except OSError:
            return ""

    def _sock_ready(self) -> select.poll:
        """A poll of this reader's socket (made once)."""
        if self._sock_poll is None:
            self._sock_poll = select.poll()
            self._sock_poll.register(self.sock, select.POLLIN)
        return self._sock_poll

    def _spin_for_message(self) -> None:
        """Where this reader polls (``poll_s``): look at its socket, yielding the core, until a
        message is there or ``poll_s`` passed (then ``_next_message`` blocks as anywhere else).
        A message that comes meanwhile is read without a wake-up through the scheduler."""
        if self.poll_s is None or self.sock is None or self.sock.fileno() == -1:
            return
        ready = self._sock_ready()
        until = time.perf_counter() + self.poll_s
        while not ready.poll(0) and time.perf_counter() < until:
            os.sched_yield()

    def _polled_complete(self, sequence: int) -> bool:
        """A reader whose node leader writes the completion word (``poll_s``): True once the
        word holds message ``sequence``; False when its socket holds the writer's abort or end
        instead (``wait_complete`` reads it there). It spins, yielding its core, for
        ``poll_s``, then looks between short sleeps, for as long as a gloo collective would
        wait. A word past ``sequence`` means a later message completed: this one did unless its
        abort is first in the socket."""
        if self.poll_s is None:
            return False
        word, sock, ready = self.completion, self.sock, self._sock_ready()
        start = time.perf_counter()
        spin_until, deadline = start + self.poll_s, start + self.timeout_s
        while True:
            done = COMPLETED.unpack_from(word, 0)[0]
            if done == sequence:
                return True
            readable = ready.poll(0)
            if done > sequence or readable:
                first = _first_in(sock) if readable else b"?"
                if first[:4] == ABORT_MAGIC and (
                    len(first) != SIGNAL.size or SIGNAL.unpack(first)[3] == sequence
                ):
                    return False  # this message's abort
                # Another message's abort (the writer gave up its channel, ``abandon``: left for
                # the next call) or a closed socket (a leader that completed this message and
                # ended) after the word was written: a whole message. The writer signals a
                # message only once the one before is complete, so a later signal over an older
                # word is out of step: wait_complete raises either.
                return COMPLETED.unpack_from(word, 0)[0] >= sequence
            now = time.perf_counter()
            if now > deadline:
                raise ShmError(
                    f"rank {self.groups.rank}: shm: node leader rank {self.node_leader} did not "
                    f"complete message {sequence} within {self.timeout_s:.0f} s (the replica's "
                    "gloo timeout)"
                )
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(POLL_SLEEP_S)

    def _next_message(self, *accept: bytes) -> tuple[bytes, int, int, int, int]:
        """A reader: the next message from the node leader, one of ``accept`` (by default a
        signal, early or not, a stripe request, or the writer's abort); a segment's fd that
        comes with it is kept for its slot."""
        accept = accept or (SIGNAL_MAGIC, EARLY_MAGIC, STRIPE_MAGIC, ABORT_MAGIC)
        rank = self.groups.rank
        if self.sock is None or self.sock.fileno() == -1:
            raise ShmError(
                f"rank {rank}: shm: node leader rank {self.node_leader}: the channel closed on "
                f"an earlier call ({self.closed_why or 'its socket closed'}); build the strategy "
                "again"
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
        fields = SIGNAL.unpack(msg) if len(msg) == SIGNAL.size else None
        if (
            fields is None
            or fields[0] not in accept
            or (self.report_at is not None and fields[1] >= self.report_slots)
        ):
            for fd in fds:
                os.close(fd)
            self.sock.close()  # out of step with the writer: nothing after it can be trusted
            raise ShmError(
                f"rank {rank}: shm: a malformed signal of {len(msg)} bytes (magic "
                f"{msg[:4]!r}; expected one of {b', '.join(accept).decode()}, for one of the "
                f"node leader's slots); the channel is closed"
            )
        magic, index, generation, sequence, nbytes = fields
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


def _first_in(sock: socket.socket) -> bytes:
    """The first message in ``sock`` (readable), left there for ``wait_complete`` to read; b""
    when the socket is closed or broken."""
    try:
        return sock.recv(SIGNAL.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return b"?"  # nothing after all: the poll looks again
    except OSError:
        return b""
