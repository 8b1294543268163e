"""The forked world (``ForkedWorld``, a ``harness.worlds.protocol.World``): N real ranks forked
from the driver once, then many jobs on them, each handed the rank context every world shares
(``harness.worlds.rank.RankContext``).

Starting a gloo world of 8 costs seconds of imports and rendezvous, so sweeps and tests reuse
one world per (world size, backend, device) through ``harness.worlds.protocol.REGISTRY``. Ranks are
forked from the driver after the heavy imports, report their progress, and are killed as a
group when anything fails: no rank outlives its driver.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import socket
import tempfile
import time
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

# Imported here, in the driver, so forked ranks inherit them instead of each importing them
# (megatron-core comes with the rank context).
from tensordict import TensorDict  # noqa: E402, F401

from harness.worlds.forked_rank import STACK_SIGNAL, PhaseBoard, _worker  # noqa: E402
from harness.worlds.protocol import WorldError  # noqa: E402
from harness.worlds.rank import (  # noqa: E402
    forget_megatron_groups,
    ps,
)


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
        longer limit needs a world started for it (``harness.worlds.opening.open_world``)."""
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


_LIVE: set[ForkedWorld] = set()
"""Every started forked world, cached or not: at exit none may keep its ranks."""


def close_all() -> None:
    for world in list(_LIVE):
        world.close(kill=True)


atexit.register(close_all)
