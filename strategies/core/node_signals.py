"""The node channel's messages: a node leader's signals to its readers and their reports back,
as fixed structs over a Unix socket; the channel's error, and its option and platform checks.

The signal is one socket message per reader (slot, generation, sequence number, size), so a
small message costs a syscall on each side instead of a collective; a message signalled early
is completed by a shared word the readers poll, or a second message. A reader reports back
that it took a signal or let go of a message in words of its own on the same shared page
(``ReportWords``: no message for the node leader to receive), or, on a machine whose store
order does not make that safe, on its socket; a stripe written always goes on the socket.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import struct
from datetime import timedelta

import torch

from strategies.core.contract import ContractError

SIGNAL = struct.Struct("<4sIIQQ")  # magic, slot, generation, sequence, message bytes
SIGNAL_MAGIC = b"BCBS"
EARLY_MAGIC = b"BCBE"
"""A signal sent once the header and the non-tensor blob are in the slot, before the leaves:
the reader decodes while the writer copies, then waits for the message's completion (the
``COMPLETED`` word where its node leader said to poll it, else ``DONE_MAGIC``)."""
DONE_MAGIC = b"BCBD"
"""The leaves of the message signalled early are in the slot too (sent where readers do not
poll the completion word)."""
ABORT_MAGIC = b"BCBA"
"""The writer failed while writing the message signalled early; its error follows, as text."""
ABORT_TEXT_BYTES = 4096
STRIPE_MAGIC = b"BCSW"
"""A request (same layout as a signal) to write one stripe of the next message into a slot."""
RELEASE = struct.Struct("<IIIQ")  # kind, slot, generation, sequence
READ, RELEASED, STRIPED = 0, 1, 2
"""What a reader reports: it took the signal of a message, let go of the message, or wrote its
stripe of the message into the slot."""
HELLO = struct.Struct("<16sQ")  # the job's token, the reader's global rank
CONTROL_MAGIC = b"BCBC"
"""The node leader's answer to a reader's hello (same layout as a signal): its completion page's
memfd travels with it."""
COMPLETED = struct.Struct("Q")
"""The completion page's word: the sequence of the last message signalled early whose leaves are
all in its slot, written by the node leader once they are, where its readers poll it (no
``DONE_MAGIC`` is sent to them). Native, so it is read and written as one aligned 8-byte
access (a standard-size format may go byte by byte, and a reader could see half a word)."""
COMPLETION_PAGE_BYTES = 4096
"""The least completion page (a memory page); one with more report words is a whole number of
them (``completion_page_bytes``)."""
REPORT = struct.Struct("Q")
"""A report word: the sequence of the last signal a reader took, or of the last message in one
slot it let go of (``ReportWords``); native, as ``COMPLETED``."""
CACHE_LINE_BYTES = 64
"""Each reader's report words start a cache line of their own, and the first a line past the
completion word: a word one rank writes every call shares no line another rank spins on."""
POLL_SLEEP_S = 50e-6
"""A reader that spun ``poll_s`` on the completion word looks again after this long asleep; a
node leader waiting for a report word starts its pauses there."""
WORD_WAIT_S = 1e-3
"""The longest a node leader waiting for a reader's report word sleeps between looks (a word
wakes nobody; the reader's socket, which wakes the wait, still tells of its end)."""
POLL_STORE_ORDER = ("x86_64", "AMD64", "i386", "i686")
"""Machines whose stores reach another core in program order (x86's total store order): a
reader that sees the completion word there sees the leaves written before it. Elsewhere a
reader never polls the word (a store fence from Python is not available) and waits for the
socket's ``DONE_MAGIC``."""


class ShmError(ContractError):
    """The shared-memory channel broke (a peer's socket closed, a message that does not fit its
    segment, a stranger on the socket); the message names the rank and what it expected."""


def check_size_option(name: str, value) -> None:
    """Refuse a byte-count option that is not an int >= 0 or None, naming it and its value."""
    if value is None or (type(value) is int and value >= 0):
        return
    raise ValueError(f"shm: {name} must be a byte count (an int >= 0) or None, got {value!r}")


def check_poll_option(value) -> None:
    """Refuse a ``poll_us`` that is not an int >= 0 or None, naming it and its value."""
    if value is None or (type(value) is int and value >= 0):
        return
    raise ValueError(f"shm: poll_us must be microseconds (an int >= 0) or None, got {value!r}")


def polls(poll_us: int | None, ranks_on_node: int) -> bool:
    """Whether a reader polls the completion word for up to ``poll_us``: not None or 0, on a
    machine of ``POLL_STORE_ORDER``, and where this node has a core for each of its
    ``ranks_on_node`` ranks (a reader that polls a core another rank needs slows that rank).
    A job that pins each rank to a core of its own reads as one core here, and does not poll."""
    return (
        bool(poll_us) and platform.machine() in POLL_STORE_ORDER and usable_cores() >= ranks_on_node
    )


def usable_cores() -> float:
    """The cores this process may run on: its affinity, capped by its cgroup's CPU quota (a
    container that sees every core of the host may be allowed a few of them)."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform: every core
        cores = float(os.cpu_count() or 1)
    for path, period_path in QUOTA_FILES:
        try:
            with open(path) as f:
                fields = f.read().split()
            if period_path is not None:
                with open(period_path) as f:
                    fields.append(f.read().strip())
            quota, period = fields[0], fields[1]
        except (OSError, IndexError):
            continue
        if quota not in ("max", "-1"):
            try:
                cores = min(cores, int(quota) / int(period))
            except (ValueError, ZeroDivisionError):
                pass
        break
    return cores


QUOTA_FILES = (
    ("/sys/fs/cgroup/cpu.max", None),  # cgroup v2: "<quota> <period>" or "max <period>"
    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),  # v1
)
"""Where a process's CPU quota is read (its own cgroup's, as a container mounts it)."""


def report_words_allowed() -> bool:
    """Whether readers may report in words (``ReportWords``): a reader's release word must not
    reach the node leader before the reader's last reads of the segment are done, which x86's
    store order guarantees (``POLL_STORE_ORDER``) and Python cannot fence elsewhere."""
    return platform.machine() in POLL_STORE_ORDER


def report_at(index: int, slots: int) -> int:
    """The byte offset of reader ``index``'s read word on the completion page of a ring of
    ``slots``; its release words follow (``release_at``). The first cache line holds the
    completion word."""
    return CACHE_LINE_BYTES + index * _round_up(REPORT.size * (1 + slots), CACHE_LINE_BYTES)


def release_at(at: int, index: int) -> int:
    """The offset of the release word for slot ``index`` of the reader whose read word is at
    ``at``."""
    return at + REPORT.size * (1 + index)


def completion_page_bytes(readers: int, slots: int) -> int:
    """The completion page of ``readers`` readers' report words on a ring of ``slots``."""
    return max(COMPLETION_PAGE_BYTES, _round_up(report_at(readers, slots), COMPLETION_PAGE_BYTES))


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def completion_page(nbytes: int = COMPLETION_PAGE_BYTES) -> tuple[int, mmap.mmap]:
    """The node leader's completion page of ``nbytes``: a memfd (sent to each reader as it
    connects) and its shared mapping."""
    fd = os.memfd_create("bcastbench-shm-done", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise


class ReportWords:
    """The node leader's reading of its readers' report words on the completion page: each
    reader writes, at its own ``report_at``, the sequence of the last signal it took, then one
    word per slot, the highest sequence of a message in that slot whose every view died. A
    slot's current message is the latest written into it, so the reader let go of it exactly
    when the word holds its sequence. Reading a word costs no system call, where a report on
    the socket costs the reader a send and the node leader a poll and a receive. Empty
    (``page`` None) where readers report on their sockets."""

    def __init__(self) -> None:
        self.page: mmap.mmap | None = None
        self.at: dict[int, int] = {}
        """Reader rank -> the offset of its read word."""

    def read(self, rank: int) -> int:
        """The sequence of the last signal ``rank`` took (0 before any)."""
        return REPORT.unpack_from(self.page, self.at[rank])[0]

    def released(self, rank: int, index: int) -> int:
        """The sequence of the last message in slot ``index`` that ``rank`` let go of."""
        return REPORT.unpack_from(self.page, release_at(self.at[rank], index))[0]


def write_report(page: mmap.mmap, at: int, sequence: int) -> None:
    """A reader's report word at ``at`` raised to ``sequence``: a message released after a later
    one of its slot leaves the later one's word. Two finalizers of one reader racing in two
    threads may lower it, which costs the slot a new segment, never a release too early: a
    word only ever holds the sequence of a message that was let go of."""
    if REPORT.unpack_from(page, at)[0] < sequence:
        REPORT.pack_into(page, at, sequence)


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


def send_report(sock: socket.socket, kind: int, index: int, generation: int, seq: int) -> None:
    # A finalizer's report must not wait: one that finds the queue full is lost, and its slot
    # is retired (a new segment) when its turn comes instead of reused.
    try:
        sock.send(RELEASE.pack(kind, index, generation, seq), socket.MSG_DONTWAIT)
    except OSError:  # the leader is gone or the channel closed: nothing holds the slot now
        pass


def given_up(text: str) -> str:
    """Why a channel closed when its writer gave it up over a failure it could not ship (what
    every later call on either end says)."""
    return f"the leader's failure could not be shipped: {text}"


def close_quietly(sock: socket.socket) -> None:
    # A Unix socket closed with unread data resets its peer, whose next receive then fails
    # before the messages still queued for it (a signal, an abort): take the reports first.
    # Shut for reading before that, so a report sent meanwhile fails on its sender (which
    # expects it to) instead of arriving between the drain and the close.
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    try:
        while sock.recv(RELEASE.size, socket.MSG_DONTWAIT):
            pass
    except OSError:
        pass
    sock.close()
