"""The measured part of every job, written once: interleaved rounds with the first strategy
rotating, and the statistics of the calls they time.

Both job kinds are built on it. A broadcast job (``harness.job.broadcast``) times each call on
the ranks, from the start line; a dispatch job (``harness.job.dispatch``) times it on the
driver, from "the driver holds the global batch" until the last rank holds its chunk. That
difference is the job's *scope* (``harness.job.spec.Scope``); what each round does, in which
order, and how its times become a record's p50 is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def rotated(order: Sequence[str], it: int) -> list[str]:
    """Round ``it``'s order: who goes first rotates, so no strategy always leads a round (the
    first call after a barrier or a driver's hand-off is not the same as the others)."""
    k = it % len(order)
    return [*order[k:], *order[:k]]


def interleaved(
    order: Sequence[str],
    warmup: int,
    iters: int,
    call: Callable[[str, int, bool], float | None],
    round_start: Callable[[int, bool], None] | None = None,
) -> dict[str, list[float]]:
    """``warmup`` untimed rounds of every strategy in ``order``, then ``iters`` timed rounds
    with the first one rotating; seconds per call, by strategy.

    ``call(name, it, timed)`` makes one call (``it`` counts the timed rounds from 0, the
    warm-up rounds from ``-warmup``) and returns its seconds when ``timed``;
    ``round_start(c, timed)``, where given, runs before round ``c`` of the whole sequence
    (warm-up rounds first): the job moves call c's shape there."""
    for c in range(warmup):
        if round_start is not None:
            round_start(c, False)
        for name in order:
            call(name, c - warmup, False)
    times: dict[str, list[float]] = {name: [] for name in order}
    for it in range(iters):
        if round_start is not None:
            round_start(warmup + it, True)
        for name in rotated(order, it):
            times[name].append(call(name, it, True))
    return times


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
