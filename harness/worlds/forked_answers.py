"""Gathering a forked world's answers: every rank's result of a job in rank order, and a rank that
failed, died or stopped responding named with its phase and where it is."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from harness.machine import mem_available
from harness.units import human_bytes
from harness.worlds.forked_rank import OUT_OF_MEMORY, STACK_SIGNAL, PhaseBoard
from harness.worlds.protocol import WorldError
from harness.worlds.rank import in_collective

log = logging.getLogger("bcastbench")

PROGRESS_EVERY_S = 20.0
"""A long job's progress line (rank 0's phase) comes at most this often, the first this long
after the job began: a gigabyte cell runs for minutes, and a quiet terminal looks hung. Every
phase change is logged at DEBUG (``hydra.verbose=bcastbench``), with its time, for profiling."""


PEEK_S = 0.5
"""How long the driver waits for a rank's status thread while a failed job's other ranks are
still running: a busy rank is not waited on here, its silence is."""


class Collector:
    """The driver's side of a forked world's ranks while a job runs: it reads their task pipes,
    status pipes, phase board and stack dumps, gathers every rank's answer, and on any rank's
    error, death or silence tears the world down (``teardown``) and raises WorldError naming the
    rank, its phase and where it is."""

    def __init__(
        self, conns: list[Connection], status: list[Connection], processes: Sequence,
        board: PhaseBoard, stacks: str, teardown: Callable[[], None],
    ) -> None:  # fmt: skip
        self._conns, self._status, self._processes = conns, status, processes
        self._board, self._stacks, self._teardown = board, stacks, teardown
        self.world_size = len(conns)
        self._job = 0
        self._last: dict[int, tuple[int, str]] = {}
        """Each rank's last (step, phase) in the current job."""
        self._began = self._echoed = 0.0

    def collect(self, job: int, what: str, timeout_s: float) -> list[Any]:
        """Every rank's answer to job ``job``, in rank order; any rank's error, death or
        silence tears the world down (see ``ForkedWorld.run``) and raises WorldError."""
        self._job = job
        answers = _Answers(self.world_size)
        self._last = {r: (0, what) for r in range(self.world_size)}
        self._began = self._echoed = time.monotonic()
        conn_rank = {c: r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._processes)}
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
                # One rank failed; the others may now block in a collective forever. Their
                # own answers are waited for a while: a refusal comes from every rank (the
                # world stays), a leader's error after the ranks that follow it, and a rank
                # that ran out of memory is named before the peers it left. Not once every
                # error is a rank's own failure and each other rank waits on a peer: a rank
                # there can only wait until it is killed.
                if silent_s > min(5.0, timeout_s) or (
                    not answers.followers
                    and not answers.refused
                    and self._all_wait_on_peers(answers)
                ):
                    break
            elif silent_s > timeout_s:
                self._raise_hung(answers, what, timeout_s)
        if answers.errors:
            self._raise_failed(answers, what)
        return [answers.results[r] for r in range(self.world_size)]

    def _read_board(self, answers: _Answers) -> None:
        """Take the phases ranks posted on the board for this job: a new one is progress."""
        for rank in range(self.world_size):
            job, step, phase = self._board.read(rank)
            if job == self._job and step > self._last[rank][0]:
                self._last[rank] = (step, phase)
                answers.last_progress = time.monotonic()
                if rank == 0:
                    self._echo(phase)

    def _echo(self, phase: str) -> None:
        """Rank 0's new phase on the log: every one at DEBUG, one at INFO per
        ``PROGRESS_EVERY_S``."""
        now = time.monotonic()
        line = f"  ... {now - self._began:.0f} s into the job: rank 0 at {phase}"
        if now - self._echoed >= PROGRESS_EVERY_S:
            self._echoed = now
            log.info(line)
        else:
            log.debug(line)

    def _receive(self, rank: int, conn: Connection, answers: _Answers, what: str) -> bool:
        """Take one message from ``rank``; False when its pipe is closed."""
        try:
            job, kind, step, payload = conn.recv()
        except (EOFError, OSError):
            return False
        if job not in (self._job, -1):
            # Cannot happen while worlds that fail are torn down; if it does, the ranks
            # are out of step and nothing they say can be trusted.
            self._teardown()
            raise WorldError(
                f"rank {rank} answered job {job} while job {self._job} ({what}) runs: "
                "the world is out of step"
            )
        answers.last_progress = time.monotonic()
        if kind == "phase":
            self._last[rank] = (step, payload)
            if rank == 0:
                self._echo(payload)
        elif kind in ("error", "refused", "follows"):
            answers.errors[rank] = payload
            if kind == "refused":
                answers.refused.add(rank)
            elif kind == "follows":
                answers.followers.add(rank)
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
        self._processes[rank].join(2)  # reap it, so exitcode is known
        code = self._processes[rank].exitcode
        phase = self._last[rank][1]
        self._teardown()
        raise WorldError(
            f"rank {rank} {exit_reason(code)} while {phase!r} ({what}); the world was torn down"
        )

    def _raise_hung(self, answers: _Answers, what: str, timeout_s: float) -> None:
        self._read_board(answers)
        stuck = [r for r in range(self.world_size) if r not in answers.results]
        places = self._where(stuck)
        # The culprit is a rank NOT waiting in a collective (the others wait for it);
        # failing that, the one that reported the least progress.
        outside = [r for r in stuck if not in_collective(places[r])]
        culprit = outside[0] if outside else min(stuck, key=lambda r: self._last[r][0])
        detail = "; ".join(f"rank {r}: {self._last[r][1]!r}, {places[r]}" for r in stuck)
        stacks = self._stacks_of([r for r in stuck if places[r].startswith("no answer from")])
        self._teardown()
        raise WorldError(
            f"rank {culprit} stopped responding for {timeout_s:.0f} s while "
            f"{self._last[culprit][1]!r} ({what}), {places[culprit]}; "
            f"all unfinished ranks: {detail}; the world was torn down{stacks}"
        )

    def _raise_failed(self, answers: _Answers, what: str) -> None:
        # A rank whose allocation failed first: its peers fail after it, in a collective it
        # left, and would be named instead; then a rank whose error is its own, not its
        # leader's passed on.
        starved = [r for r, e in answers.errors.items() if e.startswith(OUT_OF_MEMORY)]
        causes = [r for r in answers.errors if r not in answers.followers]
        rank = min(starved or causes or answers.errors)
        # Tear down even if every rank answered: a root's broadcast can complete while a
        # failed receiver never took part, leaving the ranks' collective sequences out of
        # step, and the next job would hang or read the wrong bytes. A fresh world is cheap.
        if answers.refused != set(range(self.world_size)):
            self._teardown()
        error = answers.errors[rank]
        first_line = error.strip().splitlines()[0]
        said = "ran out of memory" if error.startswith(OUT_OF_MEMORY) else "failed"
        first_line = first_line.removeprefix(f"{OUT_OF_MEMORY}: ")
        raise WorldError(
            f"rank {rank} {said} in {what}: {first_line}\n--- traceback of rank {rank} ---\n{error}"
        )

    def _all_wait_on_peers(self, answers: _Answers) -> bool:
        """Whether every rank without an answer is in a collective or waits for a node-local
        peer (asked briefly: a rank whose status thread is slow to answer counts as busy)."""
        pending = [r for r in range(self.world_size) if not answers.has(r)]
        places = self._where(pending, patience_s=PEEK_S)
        return all(in_collective(places[r]) for r in pending)

    def _where(self, ranks: list[int], patience_s: float = 10.0) -> dict[int, str]:
        """Ask each rank's status thread where its main thread is, waiting ``patience_s`` for
        each answer; one that comes later is dropped before the next question."""
        out = {}
        for r in ranks:
            try:
                while self._status[r].poll():  # a late answer to an earlier question
                    self._status[r].recv()
                self._status[r].send("?")
                # Generous: on an overloaded machine a status thread can wait seconds for the GIL.
                out[r] = self._status[r].recv() if self._status[r].poll(patience_s) else None
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
                os.kill(self._processes[rank].pid, STACK_SIGNAL)
                paths[rank] = os.path.join(self._stacks, f"rank{rank}.txt")
            except OSError:
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


@dataclass
class _Answers:
    """What the ranks have said about the current job."""

    world_size: int
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)
    """Ranks whose error is a refusal raised before any collective (the world stays)."""
    followers: set[int] = field(default_factory=set)
    """Ranks whose error follows their replica leader's (``LeaderFailed``): named only when no
    other rank's error is known."""
    last_progress: float = field(default_factory=time.monotonic)

    def has(self, rank: int) -> bool:
        return rank in self.results or rank in self.errors

    @property
    def complete(self) -> bool:
        return len(self.results) + len(self.errors) >= self.world_size


def exit_reason(code: int | None) -> str:
    """How a rank's process ended, in words: a signal by name, and for SIGKILL, which nothing
    in the rank sends itself, what sends it on a host out of memory."""
    if code is None or code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    said = f"was killed by signal {-code} ({name})"
    if -code == signal.SIGKILL:
        said += (
            ": most likely the kernel's OOM killer, the host out of memory (its log, `dmesg`, "
            f"names the process; MemAvailable now {human_bytes(mem_available())}); lower "
            "payload.batch_size or the references, or see `bcastbench predict` for the memory "
            "each strategy needs"
        )
    return said
