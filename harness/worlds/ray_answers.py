"""A Ray world's answers: every rank's result of a task in rank order, a hung or failed rank named
with its phase, and a Ctrl-C that reaches a driver waiting on Ray (``ctrl_c_as_a_flag``)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from harness.worlds.protocol import WorldError
from harness.worlds.rank import in_collective
from strategies.core.contract import follows_its_leader

DEATH_GRACE_S = 3.0
"""How long, after a rank fails, the world waits for its peers to fail too before naming one."""
PROGRESS_POLL_S = 2.0
"""How often the driver asks waiting ranks where they are."""
WAIT_SLICE_S = 0.2
"""The longest one wait on Ray lasts before the driver looks for a Ctrl-C (``ctrl_c_as_a_flag``)."""
LONG_WAIT = 3
"""A rank waiting in a collective this many limits while a rank outside any collective still
reports progress is named all the same (``culprits``)."""
DROPPED = "the Ray world's ranks were torn down (a next job starts new ones on the same cluster)"
"""What a failed task's error says happened to the world (``RayWorld.revive``)."""


def collect_answers(
    ray, actors: list, refs: list, what: str, limit: float, drop_ranks: Callable[[], None]
) -> list[Any]:
    """Every rank's answer in rank order, ``refs`` holding one task per rank (the actors', in
    rank order). A rank that fails or dies, or that reports no progress for ``limit`` seconds
    (``culprits`` says which of the silent ranks are named), has the ranks dropped
    (``drop_ranks``) and raises WorldError naming it and its phase. A Ctrl-C while it waits
    raises KeyboardInterrupt within ``WAIT_SLICE_S``."""
    rank_of = {ref: r for r, ref in enumerate(refs)}
    pending, results = list(refs), {}
    started = time.monotonic()
    with ctrl_c_as_a_flag() as check:
        while pending:
            ready, pending = _wait_one(ray, pending, PROGRESS_POLL_S, check)
            if not ready:
                waited = time.monotonic() - started
                silent = _silent_ranks(ray, actors, [rank_of[r] for r in pending], limit, waited)
                if silent:
                    drop_ranks()
                    named = "; ".join(
                        f"rank {r} stopped responding for {limit:.0f} s while {phase!r} ({at})"
                        for r, phase, at in silent
                    )
                    raise WorldError(f"{named}, in {what}; {DROPPED}")
                continue
            ref = ready[0]
            try:
                results[rank_of[ref]] = ray.get(ref)
            except Exception as exc:
                rank, exc = _root_failure(ray, rank_of[ref], exc, pending, rank_of)
                drop_ranks()
                detail = str(exc).strip()
                raise WorldError(
                    f"rank {rank} failed in {what}: {type(exc).__name__}; {DROPPED}\n{detail}"
                ) from None
    return [results[r] for r in range(len(refs))]


def _silent_ranks(ray, actors: list, ranks: list[int], limit: float, waited: float):
    """(rank, phase, where) of the ranks to name among ``ranks`` (``culprits``). A rank that
    cannot even say where it is (its actor gone or wedged) counts as silent since the task
    began, outside any collective."""
    if waited < limit:
        return []
    asks = {r: actors[r].where.remote() for r in ranks if r < len(actors)}
    states = []
    for rank, ask in asks.items():
        try:
            phase, idle_s, at = ray.get(ask, timeout=PROGRESS_POLL_S)
        except Exception:
            phase, idle_s, at = "not answering", waited, "its actor does not answer"
        states.append((rank, phase, idle_s, at))
    return culprits(states, limit)


def culprits(states: list[tuple[int, str, float, str]], limit: float):
    """(rank, phase, where) of the ranks to name, from each unfinished rank's (rank, phase,
    seconds since its last report, where): none until one has been silent for ``limit``
    seconds. A rank outside any collective is what the ranks inside one wait for, so silent
    ones outside are named alone, and while one outside is within its limit (it reported
    after the ranks that wait for it) nobody is named yet, unless a rank has waited in a
    collective for ``LONG_WAIT`` limits while it went on (a collective nobody else will
    post). When every unfinished rank waits in a collective the silent ones are named."""
    silent = [s for s in states if s[2] >= limit]
    if not silent:
        return []
    outside = [s for s in states if not in_collective(s[3])]
    named = [s for s in outside if s[2] >= limit]
    if not outside:
        named = silent
    elif not named:
        named = [s for s in silent if s[2] >= LONG_WAIT * limit]
    return [(r, phase, at) for r, phase, _, at in named]


def _root_failure(ray, rank: int, exc: Exception, pending: list, rank_of: dict):
    """The failure to name. When one rank dies, its peers fail too (their collectives lose
    a connection), and whichever answers first is not the cause: wait briefly for the others
    and name the first by ``root_of``."""
    died = ray.exceptions.RayActorError
    if isinstance(exc, died) or not pending:
        return rank, exc
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
    others = []
    for ref in sorted(ready, key=rank_of.get):
        try:
            ray.get(ref)
        except Exception as other:  # noqa: BLE001 -- every rank's failure is a candidate
            others.append((rank_of[ref], other))
    return root_of((rank, exc), others, died)


def root_of(first: tuple[int, BaseException], others: list, died: type) -> tuple:
    """Which of the failed ranks' (rank, error) to name, ``first`` the one that answered first
    and ``others`` those that failed within the grace, in rank order: a rank whose actor died
    (``died``), else, where ``first`` only passed on its replica leader's failure (a
    receiver's ``LeaderFailed``), the first that did not (the leader's own error, as the forked
    world names it), else ``first``."""
    for rank, exc in others:
        if isinstance(exc, died):
            return rank, exc
    if _follows(first[1]):
        for rank, exc in others:
            if not _follows(exc):
                return rank, exc
    return first


def _follows(exc: BaseException) -> bool:
    """``follows_its_leader`` through Ray's wrapper (a task's error holds the rank's as
    ``cause``)."""
    return follows_its_leader(exc) or follows_its_leader(getattr(exc, "cause", None))


def placed(ray, group, timeout_s: float) -> bool:
    """Whether the placement group ``group`` is placed within ``timeout_s``; a Ctrl-C while it
    waits raises KeyboardInterrupt within ``WAIT_SLICE_S``."""
    with ctrl_c_as_a_flag() as check:
        return _wait_for(ray, [group.ready()], timeout_s, check)


@contextlib.contextmanager
def ctrl_c_as_a_flag():
    """While the driver waits on Ray, a Ctrl-C is a flag, raised as KeyboardInterrupt from the
    driver's own loop (``check()`` between waits), not from inside Ray.

    Ray's wait runs Python's signal handlers from inside its C++ loop and drops the
    KeyboardInterrupt Python's default handler raises there: a driver blocked in ``ray.wait``
    never saw its Ctrl-C and ran the job on (a sweep's Ctrl-C ended only when the SIGINT had
    also killed the cluster's processes and the driver noticed, which a loaded machine took
    longer than 30 s to do). Off the main thread, or where SIGINT is not Python's to handle
    (ignored, or the C default), nothing changes."""
    if _FLAG:  # a wait inside a wait: the outer one owns the signal
        yield _FLAG[-1]
        return
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield lambda: None
        return
    seen: list[int] = []

    def check() -> None:
        if seen:
            signal.signal(signal.SIGINT, previous)
            previous(signal.SIGINT, None)  # Python's default raises KeyboardInterrupt

    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    _FLAG.append(check)
    try:
        yield check
        check()
    finally:
        _FLAG.pop()
        signal.signal(signal.SIGINT, previous)


_FLAG: list[Callable[[], None]] = []
"""The check of the wait that owns SIGINT now (at most one: the outermost)."""


def _wait_one(ray, pending: list, timeout_s: float, check: Callable[[], None]):
    """``ray.wait(pending, num_returns=1, timeout=timeout_s)`` in slices of ``WAIT_SLICE_S``,
    ``check`` (a Ctrl-C) between them."""
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        left = deadline - time.monotonic()
        ready, rest = ray.wait(pending, num_returns=1, timeout=max(0.0, min(WAIT_SLICE_S, left)))
        if ready or left <= WAIT_SLICE_S:
            return ready, rest


def _wait_for(ray, refs: list, timeout_s: float, check: Callable[[], None]) -> bool:
    """Whether every one of ``refs`` is ready within ``timeout_s`` (``_wait_one`` slices)."""
    deadline, pending = time.monotonic() + timeout_s, list(refs)
    while pending:
        _, pending = _wait_one(ray, pending, max(0.0, deadline - time.monotonic()), check)
        if pending and time.monotonic() >= deadline:
            return False
    return True
