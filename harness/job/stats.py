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

An interval here is its pair of ends ``(lo, hi)``; the functions that take one take an
``harness.job.interval.Interval`` as well (it unpacks as the same pair), which is what records
are written from and read back as (``Interval.of`` wraps a pair).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from harness.job.interval import LEVEL, Interval

Ends = tuple[float, float]
"""An interval as its two ends, (lo, hi)."""
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


def median_interval(samples: Sequence[float], level: float = LEVEL) -> Ends | None:
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
) -> Ends | None:
    """The interval of the ratio of ``a`` to ``b``, timed in the same rounds (``a[i]`` and
    ``b[i]`` one round's calls): the median of the per-round log-ratios, its order-statistic
    interval exponentiated; with ``blocks`` (each round's repeat), widened to every block's
    median ratio. It also holds the ratio of the two medians, the figure a record prints
    (``vs_floor`` = p50 / floor p50), which can lie outside the paired interval when the two
    estimates part: a point figure outside its own interval would read as a contradiction.
    None when too few rounds (or a time is not positive)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    # A strategy that spent its time budget sat out the last rounds: the two share the first.
    shared = min(len(a), len(b))
    point = math.log(float(np.median(a)) / float(np.median(b))) if shared else 0.0
    a, b = a[:shared], b[:shared]
    if shared < MIN_SAMPLES or (a <= 0).any() or (b <= 0).any():
        return None
    d = np.log(a / b)
    lo, hi = median_interval(d, level)
    if blocks is not None:
        blocks = np.asarray(blocks)[:shared]
        for block in np.unique(blocks):
            own = float(np.median(d[blocks == block]))
            lo, hi = min(lo, own), max(hi, own)
    return math.exp(min(lo, point)), math.exp(max(hi, point))


def p50_interval(
    samples: Sequence[float], blocks: Sequence[int] | None = None, level: float = LEVEL
) -> Ends | None:
    """A p50's interval: the order-statistic one, widened to every block's own median."""
    interval = median_interval(samples, level)
    if interval is None or blocks is None:
        return interval
    lo, hi = interval
    samples = np.asarray(samples, dtype=float)
    blocks = np.asarray(blocks)[: len(samples)]  # a strategy's rounds may stop short (budget)
    for block in np.unique(blocks):
        own = float(np.median(samples[blocks == block]))
        lo, hi = min(lo, own), max(hi, own)
    return lo, hi


def excludes_one(interval: Interval | Ends | None) -> bool:
    """Whether a ratio's interval says the two differ (it lies wholly above or below 1)."""
    if interval is None:
        return False
    lo, hi = interval
    return lo > 1 or hi < 1


# -- two independent runs: the shift between them (``bcastbench compare``, the plugin's gate) --
EXACT_MAX_PAIRS = 2500
"""Up to this many pairs (m * n) the rank of the interval's ends comes from the exact
Mann-Whitney U distribution; above it, from its normal approximation (which then agrees with
the exact rank to within one)."""


def u_counts(m: int, n: int) -> list[int]:
    """How many of the C(m + n, m) orderings of two samples of sizes m and n give each value
    u = 0 .. m*n of the Mann-Whitney U statistic: the coefficients of the Gaussian binomial
    [m + n choose m](q) = prod_{i=1..m} (1 - q^(n+i)) / (1 - q^i), exact integers."""
    size = m * n + 1
    poly = [1] + [0] * (size - 1)
    for i in range(1, m + 1):
        # Multiply by (1 - q^(n+i)), then divide by (1 - q^i): the quotient is a polynomial.
        for k in range(size - 1, n + i - 1, -1):
            poly[k] -= poly[k - n - i]
        for k in range(i, size):
            poly[k] += poly[k - i]
    return poly


def shift_rank(m: int, n: int, level: float = LEVEL) -> int | None:
    """The 1-based rank k of the sorted m*n pairwise differences that is the interval's low end
    (the high end is rank m*n + 1 - k): the largest k with P(U <= k - 1) <= (1 - level) / 2.
    None when no k >= 1 does (too few samples: 3 against 3 cannot reach 95 %)."""
    alpha = (1 - level) / 2
    if m < 1 or n < 1:
        return None
    if m * n <= EXACT_MAX_PAIRS:
        counts, total = u_counts(m, n), math.comb(m + n, m)
        k, below = 0, 0
        while (below + counts[k]) / total <= alpha:  # P(U <= k) within alpha: k + 1 is fine
            below += counts[k]
            k += 1
        return k if k >= 1 else None
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    sd = math.sqrt(m * n * (m + n + 1) / 12)
    k = math.floor(m * n / 2 + 0.5 - z * sd)  # continuity-corrected P(U <= k - 1) <= alpha
    return k if k >= 1 else None


def shift_ratio(
    old: Sequence[float], new: Sequence[float], level: float = LEVEL
) -> tuple[float, Ends | None] | None:
    """How many times ``new``'s times are ``old``'s, from two independent sets of samples: the
    Hodges-Lehmann estimate of the shift of log times (the median of every ``ln new_j - ln
    old_i``) and its exact distribution-free interval (the order statistics of those
    differences that the Mann-Whitney U distribution puts at ``(1 - level) / 2`` from each
    end), both exponentiated. It assumes the two runs' log times differ by a shift, nothing
    about their shape. Returns (ratio, interval), the interval None when too few samples;
    None when either side is empty or holds a time that is not positive."""
    x, y = np.asarray(old, dtype=float), np.asarray(new, dtype=float)
    if len(x) == 0 or len(y) == 0 or not (x > 0).all() or not (y > 0).all():
        return None
    diffs = np.sort(np.subtract.outer(np.log(y), np.log(x)).ravel())
    estimate = math.exp(float(np.median(diffs)))
    k = shift_rank(len(x), len(y), level)
    if k is None:
        return estimate, None
    return estimate, (math.exp(float(diffs[k - 1])), math.exp(float(diffs[len(diffs) - k])))


def p50_ratio_interval(old: Interval | Ends | None, new: Interval | Ends | None) -> Ends | None:
    """An interval of new p50 / old p50 from the two p50 intervals alone (no samples):
    ``new_lo / old_hi .. new_hi / old_lo``. It holds whenever both p50 intervals do, so it
    covers at least 90 % (two 95 % intervals), not 95 %."""
    if old is None or new is None:
        return None
    (old_low, old_high), (new_low, new_high) = old, new
    if min(old_low, old_high, new_low, new_high) <= 0:
        return None
    return new_low / old_high, new_high / old_low


FASTER, SLOWER, SAME, UNKNOWN = "faster", "slower", "same", "unknown"


def verdict(interval: Interval | Ends | None, noise: float = 0.05) -> str:
    """A ratio (new / old) interval in words, Criterion-style: ``slower`` when its low end is
    above ``1 + noise``, ``faster`` when its high end is below ``1 / (1 + noise)``, ``same``
    otherwise (the change is within noise, or not shown); ``unknown`` without an interval."""
    if interval is None:
        return UNKNOWN
    lo, hi = interval
    if lo > 1 + noise:
        return SLOWER
    if hi < 1 / (1 + noise):
        return FASTER
    return SAME


def wholly_below(interval: Interval | Ends | None, bound: float) -> bool:
    """Whether a whole interval lies below ``bound`` (a gate that holds)."""
    if interval is None:
        return False
    _, hi = interval
    return hi < bound
