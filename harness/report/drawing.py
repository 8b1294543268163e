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
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psutil

from harness.machine import host_cores
from harness.worlds.ray_reaper import end_processes

T = TypeVar("T")
U = TypeVar("U")

STALL_FACTOR = 10
"""A child silent for this many times the slowest figure seen (or ``STALL_FLOOR_S``, whichever
is longer) is taken for stalled: it is stopped and its figures are drawn here. A figure takes
seconds; only a child blocked on something it inherited stays silent that long."""
STALL_FLOOR_S = 120.0
STOP_GRACE_S = 5.0
"""How long a child asked to stop may take to finish its exit before it is killed."""

_LENGTH = struct.Struct("!I")


def draw_beside(
    draws: Sequence[Callable[[], T]], meanwhile: Callable[[], U], say: Callable[[str], Any] = print
) -> tuple[list[T], U]:
    """Every ``draws[i]()`` (each exactly once; most expensive first balances best) and
    ``meanwhile()``: a forked child draws while this process runs ``meanwhile``, then both draw
    what is left. Returns the draws' results in order and what ``meanwhile`` returned. Serial
    where there is one core, nothing to share, no ``fork``, or a thread beside this one (a
    notebook's kernel: a lock one of them holds at the fork would stay held in the child), or
    where the fork fails. ``say`` gets one line where the child ended badly (its figures were
    drawn here all the same)."""
    if len(draws) > 255:
        raise ValueError(f"{len(draws)} figures: the queue numbers at most 255")
    child = None
    if draws and host_cores() >= 2 and hasattr(os, "fork") and threading.active_count() == 1:
        child = _Child.fork(draws)
    if child is None:
        return [draw() for draw in draws], meanwhile()
    results: dict[int, T] = {}
    try:
        answer = meanwhile()
        slowest = _take(draws, child.queue_r, results)
        buf, ending = child.collect(slowest)
    except BaseException:
        child.stop()
        raise
    finally:
        child.close()
    results.update(_messages(buf))
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


class _Child:
    """The forked child drawing beside this process, its queue's read end (shared) and its
    answers' read end, until reaped (``collect`` or ``stop``: its pid is never signalled
    after, when it may be another process's)."""

    def __init__(self, pid: int, queue_r: int, back_r: int) -> None:
        self.pid, self.queue_r, self.back_r = pid, queue_r, back_r
        self.reaped = False

    @classmethod
    def fork(cls, draws) -> _Child | None:
        """The child, drawing; None where a pipe or the fork failed (nothing is left open)."""
        fds: list[int] = []
        try:
            queue_r, queue_w = os.pipe()
            fds += [queue_r, queue_w]
            os.write(queue_w, bytes(range(len(draws))))  # fits a pipe's buffer: 255 bytes
            back_r, back_w = os.pipe()
            fds += [back_r, back_w]
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
        except OSError:
            for fd in fds:
                os.close(fd)
            return None
        if pid == 0:  # pragma: no cover - the child's coverage is not collected
            os.close(back_r)
            os.close(queue_w)
            _child(draws, queue_r, back_w)
        os.close(queue_w)
        os.close(back_w)
        return cls(pid, queue_r, back_r)

    def collect(self, slowest_s: float) -> tuple[bytes, str | None]:
        """Everything the child sent, read until it closes its end (or stalls: then it is
        stopped), and how it ended where not well (None for a clean exit); it is reaped."""
        buf = bytearray()
        patience = max(STALL_FLOOR_S, STALL_FACTOR * slowest_s)
        while True:
            ready, _, _ = select.select([self.back_r], [], [], patience)
            if not ready:
                self.stop()
                return bytes(buf), f"sent nothing for {patience:.0f} s and was stopped"
            chunk = os.read(self.back_r, 1 << 16)
            if not chunk:
                break
            buf += chunk
        _, status = os.waitpid(self.pid, 0)
        self.reaped = True
        return bytes(buf), _ending(status)

    def stop(self) -> None:
        """End the child where it is not reaped yet (``ray_reaper.end_processes``, which reaps
        a child it waits for): SIGTERM first, so that a figure it is writing leaves no
        temporary file (``files.write_atomic`` cleans up on the way out), SIGKILL if it does
        not go within ``STOP_GRACE_S``."""
        if self.reaped:
            return
        try:
            end_processes([psutil.Process(self.pid)], STOP_GRACE_S)
        except psutil.NoSuchProcess:
            pass
        self.reaped = True

    def close(self) -> None:
        for fd in (self.queue_r, self.back_r):
            os.close(fd)


def _child(draws, queue_r: int, back_w: int) -> None:  # pragma: no cover - runs in the child
    """The forked child: draw from the queue, send each result back as ``(index, result)``,
    exit without running the parent's exit handlers or flushing its buffers."""
    # An interrupt or a termination ends the child through its own exception, never through
    # the handlers it inherited (the parent's sweep's or world's): a figure being written is
    # then removed by write_atomic on the way out. An interrupt the parent ignores (a job in
    # the background) the child ignores too.
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)
    code = 0
    try:
        while taken := os.read(queue_r, 1):
            message = pickle.dumps((taken[0], draws[taken[0]]()))
            os.write(back_w, _LENGTH.pack(len(message)))
            _write_all(back_w, message)
    except Exception as exc:
        # One line: the parent draws the figure again, and where it fails there too, its own
        # traceback is the one the user reads (the child's beside it said the same twice).
        print(f"bcastbench report: the figure drawn beside failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)  # fmt: skip
        code = 1
    except BaseException:  # stopped or interrupted: the parent says why, if anything
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _terminated(signum, frame):  # pragma: no cover - runs in the child
    raise SystemExit(f"stopped by signal {signum}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


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
