"""How sure a job's figures are (``harness.job.stats``): the order-statistic ranks of the
median's interval match the binomial table, the same samples give the same interval, a paired
ratio's interval holds the ratio the rounds share, and repeats widen it to every block."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.job.stats import (
    MIN_SAMPLES,
    excludes_one,
    median_interval,
    median_ranks,
    p50_interval,
    ratio_interval,
)


@pytest.mark.parametrize(("n", "ranks"), [(6, (1, 6)), (10, (2, 9)), (20, (6, 15)),
                                          (30, (10, 21)), (50, (18, 33))])  # fmt: skip
def test_median_ranks_are_the_binomial_tables(n, ranks):
    """1-based, as measurement.md lists them: n = 10 -> the 2nd and the 9th, ..."""
    lo, hi = median_ranks(n)
    assert (lo + 1, hi + 1) == ranks
    coverage = 1 - 2 * sum(math.comb(n, i) for i in range(lo + 1)) / 2**n
    assert coverage >= 0.95


def test_too_few_samples_have_no_interval():
    assert median_ranks(MIN_SAMPLES - 1) is None
    assert median_interval([1.0] * (MIN_SAMPLES - 1)) is None
    assert ratio_interval([1.0] * 5, [2.0] * 5) is None


def test_the_same_samples_give_the_same_interval():
    rng = np.random.default_rng(3)
    a, b = rng.lognormal(size=30), rng.lognormal(size=30)
    assert ratio_interval(a, b) == ratio_interval(list(a), list(b))
    assert median_interval(a) == median_interval(a[::-1])


def test_a_paired_ratio_sees_through_the_noise_the_rounds_share():
    """Each round's load moves both calls alike: the rounds' times spread 10x, their ratio
    stays 1.2, and the interval is tight around it."""
    rng = np.random.default_rng(0)
    load = rng.uniform(1, 10, size=30)
    a = 1.2 * load * rng.uniform(0.99, 1.01, size=30)
    lo, hi = ratio_interval(a, load)
    assert 1.15 < lo <= 1.2 <= hi < 1.25 and excludes_one((lo, hi))


def test_repeats_widen_the_interval_to_every_block():
    calls = [1.0] * 10 + [2.0] * 10 + [1.0] * 10
    blocks = [0] * 10 + [1] * 10 + [2] * 10
    assert p50_interval(calls) == (1.0, 2.0) or p50_interval(calls)[1] <= 2.0
    lo, hi = p50_interval(calls, blocks)
    assert lo <= 1.0 and hi >= 2.0  # block 1's median is 2.0
    same = [1.0] * 30
    lo, hi = ratio_interval(calls, same, blocks)
    assert lo <= 1.0 and hi >= 2.0


def test_a_tie_is_an_interval_that_holds_one():
    assert not excludes_one((0.9, 1.1)) and not excludes_one(None)
    assert excludes_one((1.01, 1.3)) and excludes_one((0.5, 0.99))
