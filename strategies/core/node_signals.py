"""The node channel's messages: a node leader's signals to its readers and their reports back,
as fixed structs over a Unix socket; the channel's error, and its option and platform checks.

The signal is one socket message per reader (slot, generation, sequence number, size), so a
small message costs a syscall on each side instead of a collective. A reader reports back on
the same socket: it took a signal, let go of a message, or wrote its stripe of one.
"""

from __future__ import annotations

import os
import socket
import struct
from datetime import timedelta

import torch

from strategies.core.contract import ContractError

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
HELLO = struct.Struct("<16sQ")  # the job's token, the reader's global rank


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


def send_report(sock: socket.socket, kind: int, index: int, generation: int, seq: int) -> None:
    # A finalizer's report must not wait: one that finds the queue full is lost, and its slot
    # is retired (a new segment) when its turn comes instead of reused.
    try:
        sock.send(RELEASE.pack(kind, index, generation, seq), socket.MSG_DONTWAIT)
    except OSError:  # the leader is gone or the channel closed: nothing holds the slot now
        pass


def close_quietly(sock: socket.socket) -> None:
    # A Unix socket closed with unread data resets its peer, which then loses a signal it has
    # not read yet: take the releases first.
    try:
        while sock.recv(RELEASE.size, socket.MSG_DONTWAIT):
            pass
    except OSError:
        pass
    sock.close()
