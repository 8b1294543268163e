"""A report's figures drawn on two cores. matplotlib renders on one core, a report's figures are
independent of each other and of its text, and drawing them is most of ``bcastbench report``'s
time; so where the host has a second core and the platform forks, a forked child takes figures
from a shared queue while this process writes the text, then this process takes what is left.

The queue is a pipe holding one byte per figure: a one-byte read is atomic, so each figure is
drawn by exactly one process, and whichever is free takes the next (no cost estimates to keep).
The child sends back each figure's result as it finishes it. A child that fails, is killed or
stalls costs time, never a figure: what it did not send back is drawn here, where a figure
that cannot be drawn raises its own error."""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from harness.machine import host_cores

T = TypeVar("T")
U = TypeVar("U")

STALL_FACTOR = 10
"""A child silent for this many times the slowest figure seen (or ``STALL_FLOOR_S``, whichever
is longer) is taken for stalled: it is killed and its figures are drawn here. A figure takes
seconds; only a child blocked on something it inherited stays silent that long."""
STALL_FLOOR_S = 120.0

_LENGTH = struct.Struct("!I")


def draw_beside(
    draws: Sequence[Callable[[], T]], meanwhile: Callable[[], U], say: Callable[[str], Any] = print
) -> tuple[list[T], U]:
    """Every ``draws[i]()`` (each exactly once; most expensive first balances best) and
    ``meanwhile()``: a forked child draws while this process runs ``meanwhile``, then both draw
    what is left. Returns the draws' results in order and what ``meanwhile`` returned. Serial
    where there is one core, nothing to share or no ``fork``. ``say`` gets one line where the
    child ended badly (its figures were drawn here all the same)."""
    if len(draws) > 255:
        raise ValueError(f"{len(draws)} figures: the queue numbers at most 255")
    if not draws or host_cores() < 2 or not hasattr(os, "fork"):
        return [draw() for draw in draws], meanwhile()
    queue_r, queue_w = os.pipe()
    os.write(queue_w, bytes(range(len(draws))))  # fits a pipe's buffer: at most 255 bytes
    os.close(queue_w)
    back_r, back_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        os.close(back_r)
        _child(draws, queue_r, back_w)
    os.close(back_w)
    results: dict[int, T] = {}
    try:
        answer = meanwhile()
        slowest = _take(draws, queue_r, results)
        theirs, ending = _collect(pid, back_r, slowest)
    except BaseException:
        _stop(pid)
        raise
    finally:
        for fd in (queue_r, back_r):
            os.close(fd)
    results.update(theirs)
    missing = [i for i in range(len(draws)) if i not in results]
    if ending:
        say(f"bcastbench report: the process drawing figures beside this one {ending}; "
            f"{len(missing)} figure(s) drawn here instead")  # fmt: skip
    for i in missing:
        results[i] = draws[i]()
    return [results[i] for i in range(len(draws))], answer


def _take(draws, queue_r: int, results: dict) -> float:
    """Draw figures from the queue until it is empty; the slowest one's seconds."""
    slowest = 0.0
    while taken := os.read(queue_r, 1):
        t0 = time.monotonic()
        results[taken[0]] = draws[taken[0]]()
        slowest = max(slowest, time.monotonic() - t0)
    return slowest


def _child(draws, queue_r: int, back_w: int) -> None:  # pragma: no cover - runs in the child
    """The forked child: draw from the queue, send each result back as ``(index, result)``,
    exit without running the parent's exit handlers or flushing its buffers."""
    # Interrupts and terminations end the child as themselves, never through the handlers it
    # inherited, which belong to the parent's sweep or world.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    code = 0
    try:
        while taken := os.read(queue_r, 1):
            message = pickle.dumps((taken[0], draws[taken[0]]()))
            os.write(back_w, _LENGTH.pack(len(message)))
            _write_all(back_w, message)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _collect(pid: int, back_r: int, slowest_s: float) -> tuple[dict[int, Any], str | None]:
    """The child's results until it closes its end (or stalls: then it is killed), and how it
    ended, where not well (``None`` for a clean exit)."""
    buf, stalled = bytearray(), False
    patience = max(STALL_FLOOR_S, STALL_FACTOR * slowest_s)
    while True:
        ready, _, _ = select.select([back_r], [], [], patience)
        if not ready:
            stalled = True
            break
        chunk = os.read(back_r, 1 << 16)
        if not chunk:
            break
        buf += chunk
    if stalled:
        _stop(pid)
        ending = f"sent nothing for {patience:.0f} s and was stopped"
    else:
        _, status = os.waitpid(pid, 0)
        ending = _ending(status)
    return _messages(bytes(buf)), ending


def _messages(buf: bytes) -> dict[int, Any]:
    """Whole ``(index, result)`` messages in ``buf``; a torn last one is left out."""
    out, at = {}, 0
    while at + _LENGTH.size <= len(buf):
        (n,) = _LENGTH.unpack_from(buf, at)
        if at + _LENGTH.size + n > len(buf):
            break
        i, result = pickle.loads(buf[at + _LENGTH.size : at + _LENGTH.size + n])
        out[i] = result
        at += _LENGTH.size + n
    return out


def _ending(status: int) -> str | None:
    if os.WIFSIGNALED(status):
        return f"was killed by signal {os.WTERMSIG(status)}"
    code = os.waitstatus_to_exitcode(status)
    return None if code == 0 else f"exited with status {code}"


def _stop(pid: int) -> None:
    """Kill the child and reap it, where not reaped yet (its figures are written atomically:
    none is left torn)."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
