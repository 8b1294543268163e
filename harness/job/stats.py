"""How sure a job's figures are: 95 % intervals from its own samples, distribution-free and
deterministic (the same samples give the same interval).

- A median (a p50): the order-statistic interval, the sample quantiles whose ranks the binomial
  distribution of the number of calls below the true median bounds.
- A same-job ratio of two things timed in the same interleaved rounds (``vs_floor``,
  ``vs_baseline``, a strategy against another): per round the log-ratio ``d = ln(tA / tB)`` of
  the two calls of that round, and the order-statistic (sign-test) interval of the median of
  ``d``, exponentiated (``../shared/brief/measurement.md``). Pairing by round takes out what a
  round shares (the host's load at that moment), which is most of the noise here.
- Repeats (``repeats=N``: N blocks of rounds): the interval is widened to cover every block's
  own estimate, so it says how much the answer moved between the blocks as well as inside them.

What it does not cover: the world and the host the job ran on (a ratio taken on 4 ranks sharing
2 cores need not hold on a node with a core per rank), and drift slower than a job. Fewer than
``MIN_SAMPLES`` samples give no interval (None).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LEVEL = 0.95
MIN_SAMPLES = 6
"""Below this, no pair of order statistics covers the median with 95 %: no interval."""


def _binom_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def median_ranks(n: int, level: float = LEVEL) -> tuple[int, int] | None:
    """The 0-based ranks (lo, hi) of the sorted samples that bound the median with at least
    ``level`` coverage: ``x(k)`` and ``x(n - k + 1)`` (1-based) for the largest k with
    P(X <= k - 1) <= (1 - level) / 2, X ~ Binomial(n, 1/2) (n = 10: the 2nd and 9th; 30: the
    10th and 21st). None below ``MIN_SAMPLES``."""
    if n < MIN_SAMPLES:
        return None
    alpha = (1 - level) / 2
    k = 0  # how many of P(X <= 0), P(X <= 1), ... stay within alpha
    while _binom_cdf(k, n) <= alpha:
        k += 1
    return k - 1, n - k


def median_interval(samples: Sequence[float], level: float = LEVEL) -> tuple[float, float] | None:
    """The order-statistic interval of the median of ``samples``; None when too few."""
    ranks = median_ranks(len(samples), level)
    if ranks is None:
        return None
    ordered = np.sort(np.asarray(samples, dtype=float))
    return float(ordered[ranks[0]]), float(ordered[ranks[1]])


def ratio_interval(
    a: Sequence[float],
    b: Sequence[float],
    blocks: Sequence[int] | None = None,
    level: float = LEVEL,
) -> tuple[float, float] | None:
    """The interval of the ratio of ``a`` to ``b``, timed in the same rounds (``a[i]`` and
    ``b[i]`` one round's calls): the median of the per-round log-ratios, its order-statistic
    interval exponentiated; with ``blocks`` (each round's repeat), widened to every block's
    median ratio. None when too few rounds (or a time is not positive)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) != len(b) or len(a) < MIN_SAMPLES or (a <= 0).any() or (b <= 0).any():
        return None
    d = np.log(a / b)
    lo, hi = median_interval(d, level)
    if blocks is not None:
        blocks = np.asarray(blocks)
        for block in np.unique(blocks):
            own = float(np.median(d[blocks == block]))
            lo, hi = min(lo, own), max(hi, own)
    return math.exp(lo), math.exp(hi)


def p50_interval(
    samples: Sequence[float], blocks: Sequence[int] | None = None, level: float = LEVEL
) -> tuple[float, float] | None:
    """A p50's interval: the order-statistic one, widened to every block's own median."""
    interval = median_interval(samples, level)
    if interval is None or blocks is None:
        return interval
    lo, hi = interval
    samples, blocks = np.asarray(samples, dtype=float), np.asarray(blocks)
    for block in np.unique(blocks):
        own = float(np.median(samples[blocks == block]))
        lo, hi = min(lo, own), max(hi, own)
    return lo, hi


def excludes_one(interval: tuple[float, float] | None) -> bool:
    """Whether a ratio's interval says the two differ (it lies wholly above or below 1)."""
    return interval is not None and (interval[0] > 1 or interval[1] < 1)
