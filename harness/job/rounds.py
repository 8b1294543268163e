"""The measured part of every job, written once: interleaved rounds, each in its own order
(a Williams design), and the statistics of the calls they time.

Both job kinds are built on it. A broadcast job (``harness.job.broadcast``) times each call on
the ranks, from the start line; a dispatch job (``harness.job.dispatch``) times it on the
driver, from "the driver holds the global batch" until the last rank holds its chunk. That
difference is the job's *scope* (``harness.job.spec.Scope``); what each round does, in which
order, and how its times become a record's p50 is the same.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np


def williams_rows(n: int) -> list[list[int]]:
    """A Williams design for ``n`` treatments: the rows of a Latin square in which every
    treatment leads each position once and follows every other treatment exactly once (``n``
    even; ``n`` odd takes the square and its mirror, 2n rows, and every pair twice). The
    textbook design for trials whose each treatment carries over into the next."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def round_order(order: Sequence[str], it: int) -> list[str]:
    """Round ``it``'s order, a row of a Williams design over ``order`` (``williams_rows``):
    who goes first changes each round (the first call after a barrier or a driver's hand-off
    is not the same as the others), and so does who goes just before each strategy: a call
    right after one that moved and freed a large batch is slower than after a light one, and
    a fixed neighbour would charge that to one strategy in every round."""
    rows = williams_rows(len(order))
    return [order[j] for j in rows[it % len(rows)]]


def interleaved(
    order: Sequence[str],
    warmup: int,
    iters: int,
    call: Callable[[str, int, bool], float | None],
    round_start: Callable[[int, bool], None] | None = None,
    budget: Callable[[dict[str, float]], dict[str, int]] | None = None,
    settled: Callable[[dict[str, float]], set[str]] | None = None,
) -> dict[str, list[float]]:
    """``warmup`` untimed rounds of every strategy in ``order``, then ``iters`` timed rounds,
    each in its own order (``round_order``); seconds per call, by strategy.

    ``call(name, it, timed)`` makes one call (``it`` counts the timed rounds from 0, the
    warm-up rounds from ``-warmup``) and returns its seconds when ``timed``;
    ``round_start(c, timed)``, where given, runs before round ``c`` of the whole sequence
    (warm-up rounds first): the job moves call c's shape there. ``budget``, where given (and
    warm-up rounds ran), takes each strategy's fastest warm-up call's seconds and returns how many
    timed rounds it takes part in: one whose rounds are spent sits out the rest, so any two
    strategies share their first rounds. ``settled``, where given, takes each strategy's
    first warm-up call's seconds after the first warm-up round and returns the strategies that
    need no more warm-up: they sit out the other warm-up rounds (``call`` is then never given
    their ``it = -1``)."""
    warm = dict.fromkeys(order, math.inf)
    warming = list(order)
    for c in range(warmup):
        if round_start is not None:
            round_start(c, False)
        for name in warming:
            t0 = time.perf_counter()
            call(name, c - warmup, False)
            warm[name] = min(warm[name], time.perf_counter() - t0)
        if c == 0 and settled is not None and warmup > 1:
            done = settled(dict(warm))
            warming = [name for name in warming if name not in done]
    rounds = dict.fromkeys(order, iters)
    if budget is not None and warmup > 0:
        # The fastest warm-up call: a first call that set up a channel or faulted in its
        # buffers says what the set-up costs, not what the timed calls will.
        rounds = budget(warm)
    times: dict[str, list[float]] = {name: [] for name in order}
    for it in range(iters):
        if round_start is not None:
            round_start(warmup + it, True)
        for name in round_order(order, it):
            if it < rounds[name]:
                times[name].append(call(name, it, True))
    return times


def budget_rounds(budget_s: float, per_call_s: float, most: int, least: int) -> int:
    """Timed rounds for a strategy whose calls take ``per_call_s``: as many as ``budget_s``
    pays for, at least ``least`` and at most ``most``."""
    affordable = int(budget_s / per_call_s) if per_call_s > 0 else most
    return min(most, max(least, affordable))


TIMING_FIELDS = ("p50_us", "p90_us", "p99_us", "min_us", "max_us", "mean_us")
"""What ``timing_stats`` gives for one strategy's calls, in microseconds."""


def timing_stats(seconds) -> dict[str, float]:
    """The figures of ``TIMING_FIELDS`` over one strategy's calls (seconds per call)."""
    t = np.asarray(seconds, dtype=float) * 1e6
    return {
        "p50_us": float(np.percentile(t, 50)),
        "p90_us": float(np.percentile(t, 90)),
        "p99_us": float(np.percentile(t, 99)),
        "min_us": float(t.min()),
        "max_us": float(t.max()),
        "mean_us": float(t.mean()),
    }


def p50_us(seconds) -> float:
    """The median call, in microseconds."""
    return float(np.percentile(np.asarray(seconds, dtype=float), 50)) * 1e6
