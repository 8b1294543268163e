"""What runs inside a rank of the forked world: its entry point (``_worker``: leave the
driver's state behind, join the gloo world, serve tasks until told to stop), the phase board it
posts to in memory shared with the driver, and the status thread and stack dumps that name
where a stuck rank is. The driver's side is ``harness.worlds.forked``."""

from __future__ import annotations

import ctypes
import datetime
import errno
import faulthandler
import gc
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from harness.worlds.rank import (
    RankContext,
    device_for,
    forget_megatron_groups,
    ps,
    rendezvous_store,
    where,
)
from strategies import Unsupported
from strategies.core.contract import follows_its_leader

PHASE_BYTES = 240
"""Room for one rank's phase on a ``PhaseBoard`` (UTF-8; longer phases are cut)."""


class PhaseBoard:
    """What each rank of a forked world is doing, in memory shared with the driver.

    A rank reports its phase before every timed call. As a message on its pipe that woke the
    driver four times per call of a 4-rank world, on the cores the ranks were timing
    broadcasts on; here it is a memory write, and the driver reads the board only when it
    looks for progress (once a second), a crashed rank's phase or a hung one's. Each slot is
    a seqlock: its counter is odd while the rank writes, so the driver never reads a torn
    phase.
    """

    def __init__(self, mp, world_size: int) -> None:
        self.seq = mp.RawArray(ctypes.c_uint64, 2 * world_size)  # per rank: job, counter
        self.text = mp.RawArray(ctypes.c_char, PHASE_BYTES * world_size)

    def write(self, rank: int, job: int, step: int, phase: str) -> None:
        at = rank * PHASE_BYTES
        raw = phase.encode(errors="replace")[:PHASE_BYTES]
        self.seq[2 * rank + 1] = 2 * step - 1  # odd: being written
        self.seq[2 * rank] = job
        self.text[at : at + PHASE_BYTES] = raw.ljust(PHASE_BYTES, b"\0")
        self.seq[2 * rank + 1] = 2 * step

    def read(self, rank: int) -> tuple[int, int, str]:
        """(job, step, phase) of ``rank``'s last report; (−1, 0, "") before its first."""
        at = rank * PHASE_BYTES
        for _ in range(1000):
            count = self.seq[2 * rank + 1]
            if count % 2:
                continue
            job, raw = self.seq[2 * rank], self.text[at : at + PHASE_BYTES]
            if self.seq[2 * rank + 1] == count:
                break
        else:
            return -1, 0, ""
        if count == 0:
            return -1, 0, ""
        return job, count // 2, raw.rstrip(b"\0").decode(errors="replace")


_INHERITED: list = []
"""In a forked rank: the driver's process groups it inherited, kept referenced so that none is
ever destroyed here (their threads are the driver's)."""


def _die_with_parent() -> None:
    # A rank must never outlive its driver (Ctrl-C, kill -9 of the driver, a crashed test).
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _leave_the_drivers_state() -> None:
    """A forked rank's first act: everything inherited from the driver stays where it is. A
    collection here must never run the destructor of a process group the driver made, whose
    threads do not exist in this process (it would join them forever): the heap is frozen and
    megatron-core's inherited groups pinned. Its other state goes too (the global memory
    buffer, ...), so the rank's first initialize_model_parallel finds it uninitialised; nothing
    is destroyed, as the groups are pinned and their globals already None."""
    gc.freeze()
    _INHERITED.extend(forget_megatron_groups())
    ps.destroy_model_parallel()


RENDEZVOUS_FILE = "rendezvous"
"""The FileStore's file in the world's directory (``_join_world``)."""


def _worker(
    local_rank: int,
    world_size: int,
    port: int,
    backend: str,
    device: str,
    timeout_s: float,
    conns: list[Connection],
    status_conns: list[Connection],
    board: PhaseBoard | None = None,
    stacks: str | None = None,
) -> None:
    """A forked rank's life: leave the driver's state behind, join the gloo world, serve the
    driver's tasks until it says stop, then leave the world."""
    conn = _settle(local_rank, conns, status_conns, stacks)
    rendezvous = os.path.join(stacks, RENDEZVOUS_FILE) if stacks else None
    ctx = _join_world(
        local_rank, world_size, port, backend, device, timeout_s, conn, board, rendezvous
    )  # fmt: skip
    if ctx is None:
        return
    _serve(ctx, conn)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _settle(
    local_rank: int, conns: list[Connection], status_conns: list[Connection], stacks: str | None
) -> Connection:
    """A forked rank's first acts, before it joins the world: bound to its driver's life, clear
    of the driver's state, deaf to Ctrl-C, its stacks written on ``STACK_SIGNAL``, only its own
    pipes kept and its status thread answering. Returns its task pipe."""
    _die_with_parent()
    _leave_the_drivers_state()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver owns Ctrl-C and kills us
    if stacks is not None:
        _dump_stacks_on_signal(os.path.join(stacks, f"rank{local_rank}.txt"))
    conn = conns[local_rank]
    for c in conns + status_conns:
        if c not in (conn, status_conns[local_rank]):
            c.close()
    _answer_status(status_conns[local_rank], threading.get_ident())
    torch.set_num_threads(1)  # N ranks share the cores; more threads only oversubscribe
    return conn


def _join_world(
    local_rank: int, world_size: int, port: int, backend: str, device: str, timeout_s: float,
    conn: Connection, board: PhaseBoard | None, rendezvous: str | None = None,
) -> RankContext | None:  # fmt: skip
    """Join the gloo world on loopback and tell the driver this rank is ready; the rank's
    context, or None once the error is sent to the driver. ``rendezvous``: a file in the
    world's own directory the ranks meet through (every rank is on this machine; a TCP store
    would be one more listening socket, and in a private network namespace its client asks a
    resolver it cannot reach for loopback's name and warns on every rank); else the TCP store
    on loopback."""
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # Every rank is on this machine: gloo's pairs listen and connect on loopback, not on
        # whatever address the host name resolves to.
        GLOO_SOCKET_IFNAME="lo",
    )
    try:
        dev = device_for(backend, device, local_rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend,
            store=dist.FileStore(rendezvous, world_size)
            if rendezvous
            else rendezvous_store("127.0.0.1", port, local_rank, world_size, timeout),
            rank=local_rank,
            world_size=world_size,
            timeout=timeout,
        )
        ctx = RankContext(local_rank, world_size, backend, dev, conn, board=board)
        ctx.send("ready", None)
    except Exception:
        conn.send((0, "error", 0, traceback.format_exc()))
        return None
    return ctx


def _serve(ctx: RankContext, conn: Connection) -> None:
    """Run the driver's tasks on this rank until it says stop (or its pipe closes)."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        except Exception as exc:  # e.g. a task function the forked rank cannot unpickle
            ctx.job = -1  # unknown: the driver treats it as this job's failure
            ctx.send(
                "error",
                f"could not receive the task ({type(exc).__name__}: {exc}); ranks are forked "
                "when the world starts, so task functions must be importable, or defined "
                f"before World.start()\n{traceback.format_exc()}",
            )
            continue
        if msg is None:
            break
        ctx.job, fn, args = msg
        try:
            ctx.send("ok", fn(ctx, *args))
        except Exception as exc:  # report, keep serving; the driver decides the world's fate
            # An Unsupported refusal is raised on every rank before any collective, so the
            # world stays in step; anything else may have left collectives half done.
            kind = "refused" if isinstance(exc, Unsupported) else "error"
            if kind == "error" and follows_its_leader(exc):
                kind = "follows"
            said = f"{type(exc).__name__}: {exc}"
            if out_of_memory(exc):
                said = f"{OUT_OF_MEMORY}: {said}"
            ctx.send(kind, f"{said}\n{traceback.format_exc()}")


OUT_OF_MEMORY = "ran out of memory"
"""How a rank's error begins when an allocation failed (``out_of_memory``)."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation the host (or the rank's limit) refused: Python's
    MemoryError, an OS call's ENOMEM (a mapping, a thread), or torch's allocator saying it
    cannot allocate."""
    if isinstance(exc, MemoryError) or "can't allocate memory" in str(exc):
        return True
    return isinstance(exc, OSError) and exc.errno == errno.ENOMEM


STACK_SIGNAL = signal.SIGUSR1
"""Asks a forked rank to write every thread's Python stack to its file (``faulthandler``)."""


def _dump_stacks_on_signal(path: str) -> None:
    """On ``STACK_SIGNAL``, write every thread's Python stack to ``path``. faulthandler writes
    from the signal handler without the GIL, so this names where a rank is even when its main
    thread holds the GIL in native code and the status thread cannot answer."""
    stream = open(path, "w")  # noqa: SIM115 - held open for the life of the rank
    faulthandler.register(STACK_SIGNAL, file=stream, all_threads=True)


def _answer_status(conn: Connection, main_ident: int) -> None:
    """A daemon thread that tells the driver where the main thread is, even when it is stuck."""

    def serve() -> None:
        while True:
            try:
                conn.recv()
                conn.send(where(sys._current_frames().get(main_ident)))
            except (EOFError, OSError):
                return

    threading.Thread(target=serve, daemon=True, name="bcastbench-status").start()
