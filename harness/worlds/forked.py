"""The forked world (``ForkedWorld``, a ``harness.worlds.protocol.World``): N real ranks forked
from the driver once, then many jobs on them; and the rank side every world shares
(``RankContext``: who a rank is, its phase reports, its megatron-core groups).

Starting a gloo world of 8 costs seconds of imports and rendezvous, so sweeps and tests reuse
one world per (world size, backend, device) through ``harness.worlds.protocol.REGISTRY``. Ranks are
forked from the driver after the heavy imports, report their progress, and are killed as a
group when anything fails: no rank outlives its driver.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import faulthandler
import gc
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

# Ranks are forked from this process. A fork taken after the parent ran a multi-threaded
# OpenMP region can leave a child deadlocked in its first parallel op (libgomp's pool does not
# survive fork), so the driver stays single-threaded; ranks run one thread each anyway.
torch.set_num_threads(1)

# Imported here, in the driver, so forked ranks inherit them instead of each importing them.
from harness.megatron_import import parallel_state  # noqa: E402

ps = parallel_state()
from tensordict import TensorDict  # noqa: E402, F401

from harness.worlds.protocol import REGISTRY, WorldError  # noqa: E402, F401 - WorldError's old home
from strategies import ProcessGroups, Unsupported  # noqa: E402

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


@dataclass
class RankContext:
    """What a task running on a rank gets: who it is, and how to report progress."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    conn: Connection | None = None
    step: int = 0
    cache: dict = field(default_factory=dict)
    job: int = 0
    """The driver's number for the task being run; every message back carries it."""
    link_counter: Callable[[], int] | None = None
    """Bytes the emulated cluster's node links have sent so far (``harness.worlds.emulated``),
    or None outside one: the hook the rank-side job counts cross-node bytes with."""
    board: PhaseBoard | None = None
    """Where a forked world's rank posts its phase (shared memory the driver reads), or None:
    phases then travel as messages."""
    node: str | None = None
    """This rank's host as its world knows it (Ray: the node id), or None: the launcher's
    environment says (``strategies.core.groups.node_key``); the groups' ``node_of`` follows."""

    def report(self, phase: str) -> None:
        """Tell the driver what this rank is doing now (used to name a hung rank)."""
        self.step += 1
        if self.board is not None:
            self.board.write(self.rank, self.job, self.step, phase)
        else:
            self.send("phase", phase)

    def send(self, kind: str, payload: Any) -> None:
        if self.conn is not None:
            self.conn.send((self.job, kind, self.step, payload))

    def groups_for(self, layout):
        """The strategies' ProcessGroups for ``layout``, built through megatron-core once and
        cached; a new layout tears down Megatron's state and its groups, then builds them
        again (collective)."""
        key = ("groups", layout)
        if key not in self.cache:
            layout.check_world(self.world_size)
            self.cache = {k: v for k, v in self.cache.items() if k[0] != "groups"}
            self.release_groups()
            with _recording_new_groups() as made:
                ps.initialize_model_parallel(
                    **layout.megatron_kwargs(), create_gloo_process_groups=False
                )
                groups = ProcessGroups.from_megatron(
                    order="-".join(layout.tokens), device=self.device, node=self.node
                )
            self.cache["owned_groups", None] = _keep_only(groups, made)
            self.cache[key] = groups
        return self.cache[key]

    def release_groups(self) -> None:
        """Destroy the process groups the last layout made (collective, like making them).

        megatron-core's destroy_model_parallel only forgets its groups. Each gloo group keeps
        a transport thread that wakes ~100 times a second, so a world that visited a dozen
        layouts held ~200 of them per rank and its idle ranks took most of two cores."""
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        forget_megatron_groups()
        for group in self.cache.pop(("owned_groups", None), []):
            dist.destroy_process_group(group)
        # Whatever still refers to the old groups in a reference cycle is freed here, at the
        # same point of every rank's program, rather than by a collection that an allocation
        # triggers at a different moment on each rank, in the middle of the next collective.
        gc.collect()


def _megatron_groups() -> dict[str, Any]:
    """megatron-core's module globals that hold a process group (or a list or dict of them)."""

    def holds(value) -> bool:
        if isinstance(value, dist.ProcessGroup):
            return True
        items = value.values() if isinstance(value, dict) else value
        return isinstance(value, (list, tuple, dict)) and any(
            isinstance(v, dist.ProcessGroup) for v in items
        )

    return {name: value for name, value in vars(ps).items() if holds(value)}


def forget_megatron_groups() -> list:
    """Set to None every megatron-core global still holding a process group; returns what
    they held. ``destroy_model_parallel`` leaves some (megatron-core 0.16 keeps
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``): forgotten here, in the process that made
    them, they are destroyed here, where their threads run. Left set, a rank forked later
    inherits them, and the next ``initialize_model_parallel`` there drops the last reference:
    the destructor then joins threads that exist only in the driver, and the rank hangs."""
    held = _megatron_groups()
    for name in held:
        setattr(ps, name, None)
    return list(held.values())


_INHERITED: list = []
"""In a forked rank: the driver's process groups it inherited, kept referenced so that none is
ever destroyed here (their threads are the driver's)."""


def _keep_only(groups, made: list) -> list:
    """Destroy the groups megatron-core made that the strategies do not use, and forget its
    state; returns the groups kept. Every gloo group keeps a transport thread that wakes ~100
    times a second, and megatron-core makes a dozen or more per rank (expert, embedding, DP×CP,
    ...), so an idle rank of the harness would otherwise take CPU from a broadcast that a bare
    world of one group does not pay (a benchmark measures the two side by side)."""
    used = [
        groups.tp_cp_group, groups.pp_group, groups.replica_group,
        groups.cpu_tp_cp_group, groups.cpu_pp_group, groups.cpu_replica_group,
    ]  # fmt: skip
    keep = [g for g in made if any(g is u for u in used)]
    ps.destroy_model_parallel()
    forget_megatron_groups()
    for group in made:
        if not any(group is k for k in keep):
            dist.destroy_process_group(group)
    return keep


class _recording_new_groups:
    """Within the block, every group ``torch.distributed.new_group`` makes for this rank is
    recorded (megatron-core and ProcessGroups call it through the module, so both are seen)."""

    def __enter__(self) -> list:
        self.made: list = []
        self._orig = dist.new_group

        def new_group(*args, **kwargs):
            group = self._orig(*args, **kwargs)
            if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD:
                self.made.append(group)
            return group

        dist.new_group = new_group
        return self.made

    def __exit__(self, *exc) -> None:
        dist.new_group = self._orig


def _die_with_parent() -> None:
    # A rank must never outlive its driver (Ctrl-C, kill -9 of the driver, a crashed test).
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _device_for(backend: str, device: str, local_rank: int) -> torch.device:
    if device == "cuda" or backend == "nccl":
        index = local_rank % max(torch.cuda.device_count(), 1)
        if backend == "nccl" or device == "cuda":
            torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


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
        dev = _device_for(backend, device, local_rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend,
            store=rendezvous_store("127.0.0.1", port, local_rank, world_size, timeout),
            rank=local_rank,
            world_size=world_size,
            timeout=timeout,
        )
        ctx = RankContext(local_rank, world_size, backend, dev, conn, board=board)
        ctx.send("ready", None)
    except Exception:
        conn.send((0, "error", 0, traceback.format_exc()))
        return
    _serve(ctx, conn)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


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
            ctx.send(kind, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


def where(frame) -> str:
    """Where a thread is blocked: the innermost torch.distributed call and our caller of it."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    inner_dist = next((f for f in stack if "torch/distributed" in f.f_code.co_filename), None)
    ours = next(
        (
            f
            for f in stack
            if "/harness/" in f.f_code.co_filename or "/strategies/" in f.f_code.co_filename
        ),
        stack[0] if stack else None,
    )
    if ours is None:
        return "idle"
    at = f"{os.path.basename(ours.f_code.co_filename)}:{ours.f_lineno} {ours.f_code.co_name}"
    if inner_dist is not None:
        return f"in collective torch.distributed.{inner_dist.f_code.co_name} (from {at})"
    return f"outside any collective, at {stack[0].f_code.co_name} (from {at})"


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


def rendezvous_store(
    host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.TCPStore:
    """The world's TCPStore, listening on ``host`` only. Left to itself, rank 0's store
    listens on every interface of the machine (``::``); here rank 0 binds the socket to
    ``host`` and hands it to the store, so a local world is reachable from this machine
    alone (and a node's from its own address)."""
    listen_fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, world_size))
        listen_fd = sock.detach()
    return dist.TCPStore(host, port, world_size, rank == 0, timeout, master_listen_fd=listen_fd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ForkedWorld:
    """N ranks started once with torch.multiprocessing (fork), serving tasks until closed; all
    on this machine, so one node."""

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        device: str = "cpu",
        timeout_s: float = 120.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self._ctx = None
        self._conns: list[Connection] = []
        self._last: dict[int, tuple[int, str]] = {}
        self._board: PhaseBoard | None = None
        self._stacks: str | None = None
        self._job = 0
        self.start_s = 0.0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> ForkedWorld:
        if dist.is_initialized():
            raise WorldError(
                "this process already holds a torch.distributed default group (rank "
                f"{dist.get_rank()} of {dist.get_world_size()}): ranks forked from it would "
                "inherit it and cannot start their own world; destroy it first "
                "(torch.distributed.destroy_process_group()), or run the job under torchrun, "
                "where this process joins the launcher's world instead"
            )
        t0 = time.perf_counter()
        self._job = 0  # the ranks' "ready" answers carry job 0
        mp = tmp.get_context("fork")
        pairs = [mp.Pipe(duplex=True) for _ in range(self.world_size)]
        status = [mp.Pipe(duplex=True) for _ in range(self.world_size)]
        self._conns = [a for a, _ in pairs]
        self._status = [a for a, _ in status]
        children = [b for _, b in pairs]
        status_children = [b for _, b in status]
        self._board = PhaseBoard(mp, self.world_size)
        # A process group the driver dropped but megatron-core or a reference cycle still
        # holds (an in-process job's, a test's) is destroyed here, where its threads exist, not
        # in a rank that inherits it: there its destructor waits for the driver's threads.
        if not ps.model_parallel_is_initialized():
            forget_megatron_groups()
        gc.collect()
        port = _free_port()
        self._stacks = tempfile.mkdtemp(prefix="bcastbench-stacks-")
        try:
            self._ctx = tmp.start_processes(
                _worker,
                args=(
                    self.world_size, port, self.backend, self.device, self.collective_timeout_s,
                    children, status_children, self._board, self._stacks,
                ),
                nprocs=self.world_size,
                join=False,
                start_method="fork",
            )  # fmt: skip
        except BaseException:
            self._drop_stacks()
            raise
        for c in children + status_children:
            c.close()
        self._collect("starting the world", self.timeout_s)
        self.start_s = time.perf_counter() - t0
        _LIVE.add(self)
        return self

    @property
    def collective_timeout_s(self) -> float:
        """Gloo's own limit on one collective in this world's ranks, fixed when it starts: past
        ``timeout_s``, so the driver names a hung rank before gloo raises. A later job with a
        longer limit needs a world started for it (``harness.worlds.launcher.open_world``)."""
        return self.timeout_s + 5

    @property
    def alive(self) -> bool:
        return self._ctx is not None and all(p.is_alive() for p in self._ctx.processes)

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        return (tuple(range(self.world_size)),)

    def record_fields(self) -> dict[str, Any]:
        return {}

    def _drop_stacks(self) -> None:
        if self._stacks is not None:
            shutil.rmtree(self._stacks, ignore_errors=True)
            self._stacks = None

    def close(self, kill: bool = False) -> None:
        if self._ctx is None:
            self._drop_stacks()
            return
        procs = self._ctx.processes
        if not kill:
            for c in self._conns:
                try:
                    c.send(None)
                except (OSError, BrokenPipeError):
                    pass
            deadline = time.monotonic() + 5
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for c in self._conns + self._status:
            c.close()
        self._drop_stacks()
        self._ctx = None
        _LIVE.discard(self)

    def __enter__(self) -> ForkedWorld:
        return self.start() if self._ctx is None else self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)

    # -- tasks -----------------------------------------------------------------------------
    def run(
        self, fn: Callable[..., Any], *args: Any, what: str = "", timeout_s: float | None = None
    ) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank; return the per-rank results in rank order.

        Any rank's error, crash or silence (no progress for ``timeout_s``) kills the whole
        world and raises WorldError naming the rank and what it was doing.
        """
        if not self.alive:
            raise WorldError("the world is not running (it was closed or a rank died)")
        self._job += 1
        try:
            for c in self._conns:
                c.send((self._job, fn, args))
            return self._collect(
                what or getattr(fn, "__name__", "task"), timeout_s or self.timeout_s
            )
        except WorldError:
            raise  # _collect tore the world down, unless every rank refused before any collective
        except BaseException:
            # Anything else that cut the wait short (an unpicklable result, Ctrl-C, a test
            # framework's interrupt) may leave answers in flight and ranks in a collective: a
            # world left like that is out of step, so it goes.
            self.close(kill=True)
            raise

    def _where(self, ranks: list[int]) -> dict[int, str]:
        """Ask each rank's status thread where its main thread is (2 s at most)."""
        out = {}
        for r in ranks:
            try:
                self._status[r].send("?")
                # Generous: on an overloaded machine a status thread can wait seconds for the GIL.
                out[r] = self._status[r].recv() if self._status[r].poll(10.0) else None
            except (OSError, EOFError):
                out[r] = "no answer (process gone)"
            if out[r] is None:
                out[r] = "no answer from its status thread (its main thread holds the GIL)"
        return out

    def _stacks_of(self, ranks: list[int]) -> str:
        """Every thread's Python stack of each of ``ranks``, as its faulthandler writes them on
        ``STACK_SIGNAL``: where a rank is whose status thread cannot get the GIL. Every rank is
        signalled first, then all dumps are read against one deadline (3 s)."""
        paths = {}
        for rank in ranks:
            try:
                os.kill(self._ctx.processes[rank].pid, STACK_SIGNAL)
                paths[rank] = os.path.join(self._stacks or "", f"rank{rank}.txt")
            except (OSError, AttributeError):
                continue
        texts = dict.fromkeys(paths, "")
        settled: set[int] = set()
        deadline = time.monotonic() + 3.0
        while paths and len(settled) < len(paths) and time.monotonic() < deadline:
            time.sleep(0.2)
            for rank, path in paths.items():  # a dump is whole once it stops growing
                try:
                    with open(path, errors="replace") as f:
                        now = f.read()
                except OSError:
                    continue
                if now and now == texts[rank]:
                    settled.add(rank)
                texts[rank] = now
        return "".join(
            f"\n--- stacks of rank {rank} (faulthandler) ---\n{text.strip()}"
            for rank, text in texts.items()
            if text.strip()
        )

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        """Every rank's answer to the current job, in rank order; any rank's error, death or
        silence tears the world down (see ``run``) and raises WorldError."""
        answers = _Answers(self.world_size)
        self._last = {r: (0, what) for r in range(self.world_size)}
        conn_rank = {c: r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._ctx.processes)}
        while not answers.complete:
            pending = [c for c, r in conn_rank.items() if not answers.has(r)]
            for obj in wait(pending + list(sentinels), timeout=1.0):
                if obj in sentinels:
                    self._check_exit(sentinels[obj], answers, what)
                else:
                    self._receive(conn_rank[obj], obj, answers, what)
            self._read_board(answers)
            silent_s = time.monotonic() - answers.last_progress
            if answers.errors and not answers.complete:
                # One rank failed; the others may now block in a collective forever.
                if silent_s > min(5.0, timeout_s):
                    break
            elif silent_s > timeout_s:
                self._raise_hung(answers, what, timeout_s)
        if answers.errors:
            self._raise_failed(answers, what)
        return [answers.results[r] for r in range(self.world_size)]

    def _read_board(self, answers: _Answers) -> None:
        """Take the phases ranks posted on the board for this job: a new one is progress."""
        if self._board is None:
            return
        for rank in range(self.world_size):
            job, step, phase = self._board.read(rank)
            if job == self._job and step > self._last[rank][0]:
                self._last[rank] = (step, phase)
                answers.last_progress = time.monotonic()

    def _receive(self, rank: int, conn: Connection, answers: _Answers, what: str) -> bool:
        """Take one message from ``rank``; False when its pipe is closed."""
        try:
            job, kind, step, payload = conn.recv()
        except (EOFError, OSError):
            return False
        if job not in (self._job, -1):
            # Cannot happen while worlds that fail are torn down; if it does, the ranks
            # are out of step and nothing they say can be trusted.
            self.close(kill=True)
            raise WorldError(
                f"rank {rank} answered job {job} while job {self._job} ({what}) runs: "
                "the world is out of step"
            )
        answers.last_progress = time.monotonic()
        if kind == "phase":
            self._last[rank] = (step, payload)
        elif kind in ("error", "refused"):
            answers.errors[rank] = payload
            if kind == "refused":
                answers.refused.add(rank)
        else:
            answers.results[rank] = payload
        return True

    def _check_exit(self, rank: int, answers: _Answers, what: str) -> None:
        """A rank's process ended: drain what it said before dying; without an answer, fail."""
        conn = self._conns[rank]
        while not answers.has(rank) and conn.poll():
            if not self._receive(rank, conn, answers, what):
                break
        if answers.has(rank):
            return
        self._read_board(answers)  # its last phase
        self._ctx.processes[rank].join(2)  # reap it, so exitcode is known
        code = self._ctx.processes[rank].exitcode
        phase = self._last[rank][1]
        self.close(kill=True)
        raise WorldError(
            f"rank {rank} exited with code {code} while {phase!r} ({what}); the world was torn down"
        )

    def _raise_hung(self, answers: _Answers, what: str, timeout_s: float) -> None:
        self._read_board(answers)
        stuck = [r for r in range(self.world_size) if r not in answers.results]
        places = self._where(stuck)
        # The culprit is a rank NOT waiting in a collective (the others wait for it);
        # failing that, the one that reported the least progress.
        outside = [r for r in stuck if not places[r].startswith("in collective")]
        culprit = outside[0] if outside else min(stuck, key=lambda r: self._last[r][0])
        detail = "; ".join(f"rank {r}: {self._last[r][1]!r}, {places[r]}" for r in stuck)
        stacks = self._stacks_of([r for r in stuck if places[r].startswith("no answer from")])
        self.close(kill=True)
        raise WorldError(
            f"rank {culprit} stopped responding for {timeout_s:.0f} s while "
            f"{self._last[culprit][1]!r} ({what}), {places[culprit]}; "
            f"all unfinished ranks: {detail}; the world was torn down{stacks}"
        )

    def _raise_failed(self, answers: _Answers, what: str) -> None:
        rank = min(answers.errors)
        # Tear down even if every rank answered: a root's broadcast can complete while a
        # failed receiver never took part, leaving the ranks' collective sequences out of
        # step, and the next job would hang or read the wrong bytes. A fresh world is cheap.
        if answers.refused != set(range(self.world_size)):
            self.close(kill=True)
        error = answers.errors[rank]
        first_line = error.strip().splitlines()[0]
        raise WorldError(
            f"rank {rank} failed in {what}: {first_line}\n--- traceback of rank {rank} ---\n{error}"
        )


@dataclass
class _Answers:
    """What the ranks have said about the current job."""

    world_size: int
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)
    """Ranks whose error is a refusal raised before any collective (the world stays)."""
    last_progress: float = field(default_factory=time.monotonic)

    def has(self, rank: int) -> bool:
        return rank in self.results or rank in self.errors

    @property
    def complete(self) -> bool:
        return len(self.results) + len(self.errors) >= self.world_size


World = ForkedWorld
"""The forked world under the name its callers know (tests, calibration)."""

_LIVE: set[ForkedWorld] = set()
"""Every started forked world, cached or not: at exit none may keep its ranks."""


def close_all() -> None:
    for world in list(_LIVE):
        world.close(kill=True)


atexit.register(close_all)
