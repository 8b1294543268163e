"""The time budget per strategy (``time_budget_s``): each strategy's timed rounds from its
warm-up calls, strategies that spent theirs sitting out the rounds left, and every figure and
ratio over the rounds each took part in. No process group: the rounds run on fake calls."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from harness.errors import ConfigError
from harness.job.rounds import budget_rounds, interleaved, round_order
from harness.job.samples import rows
from harness.job.spec import JobSpec
from harness.job.stats import p50_interval, ratio_interval
from strategies.core.layout import Layout


def test_the_rounds_a_budget_pays_for_are_bounded_both_ways():
    assert budget_rounds(4.0, 0.1, most=12, least=6) == 12
    assert budget_rounds(4.0, 0.5, most=12, least=6) == 8
    assert budget_rounds(4.0, 9.0, most=12, least=6) == 6  # an interval needs six
    assert budget_rounds(4.0, 0.0, most=12, least=6) == 12


def test_a_slow_strategy_sits_out_the_last_rounds_and_shares_the_first():
    made = []

    def call(name, it, timed):
        made.append((name, it, timed))
        return {"fast": 0.01, "slow": 1.0}[name] if timed else None

    def budget(warm):
        assert set(warm) == {"fast", "slow"}  # each strategy's warm-up seconds per call
        return {"fast": 10, "slow": 6}

    times = interleaved(["fast", "slow"], 2, 10, call, budget=budget)
    assert len(times["fast"]) == 10 and len(times["slow"]) == 6
    timed_slow = [it for name, it, timed in made if name == "slow" and timed]
    assert timed_slow == list(range(6))  # the first rounds, so pairs are round for round


def test_without_warm_up_no_budget_is_taken():
    times = interleaved(["a"], 0, 3, lambda n, it, t: 1.0, budget=lambda warm: {"a": 1})
    assert len(times["a"]) == 3


def test_figures_of_unequal_rounds_pair_the_shared_ones():
    a = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.0]
    b = [2.0, 2.2, 1.8, 2.0, 2.1, 1.9]  # sat out the last two rounds
    blocks = [0] * 8
    lo, hi = ratio_interval(a, b, blocks)
    assert lo <= 0.5 <= hi and hi < 0.6
    assert p50_interval(b, blocks) is not None  # blocks longer than the samples
    assert ratio_interval(a, b[:5]) is None  # five shared rounds: too few for an interval


def test_the_samples_file_holds_each_strategys_own_rounds():
    from harness.job.results import RankResult

    results = [RankResult(r, r == 0, times_s={"a": [1.0] * 4, "b": [2.0] * 2}) for r in (0, 1)]
    counted = [row for row in rows(results, [0, 0, 0, 0]) if row[3] == -1]
    assert [row[0] for row in counted] == ["a"] * 4 + ["b"] * 2


def test_a_budget_needs_warm_up_and_a_constant_workload():
    from cli_support import cfg_of

    from harness.job.config import validate

    validate(cfg_of("time_budget_s=4", "layout=tp2"))
    for extra, match in (
        ("warmup=0", "set warmup >= 1"),
        ("time_budget_s=-1", "must be positive"),
        ("payload.cycle=[{batch_size:4},{batch_size:8}]", "varying workload"),
    ):
        with pytest.raises(ConfigError, match=match):
            validate(cfg_of("time_budget_s=4", "layout=tp2", extra))


def test_the_budget_prices_a_strategy_by_its_fastest_warm_up_call(monkeypatch):
    """A first call that sets up a channel or faults in its buffers is no guide to the timed
    ones: the budget sees the fastest warm-up call (a clock that moves only inside calls)."""
    from harness.job import rounds

    clock = [0.0]
    monkeypatch.setattr(rounds.time, "perf_counter", lambda: clock[0])
    costs = iter([5.0, 0.5])  # the set-up call, then a warm one

    def call(name, it, timed):
        if not timed:
            clock[0] += next(costs)
        return 0.1 if timed else None

    seen = {}

    def budget(warm):
        seen.update(warm)
        return {"a": 6}

    interleaved(["a"], 2, 8, call, budget=budget)
    assert seen == {"a": 0.5}


def test_a_strategy_whose_first_call_bought_its_budget_takes_no_second_warm_up():
    """A gigabyte call of a pickled way costs seconds: its second untimed call would cost more
    than its timed ones may, so only the others warm up again; the timed rounds are shared."""
    made = []

    def call(name, it, timed):
        made.append((name, it, timed))
        return 1.0 if timed else None

    def settled(warm):
        assert set(warm) == {"fast", "slow"}  # after the first warm-up round
        return {"slow"}

    times = interleaved(["fast", "slow"], 3, 6, call, settled=settled)
    warm_ups = [(name, it) for name, it, timed in made if not timed]
    assert warm_ups == [("fast", -3), ("slow", -3), ("fast", -2), ("fast", -1)]
    assert len(times["fast"]) == len(times["slow"]) == 6
    made.clear()
    interleaved(["a"], 1, 2, call, settled=lambda warm: pytest.fail("one warm-up: no choice"))


def test_each_round_orders_a_williams_design_so_no_strategy_keeps_its_neighbour():
    """A call right after one that moved a large batch is slower; with the first strategy
    merely rotating, each strategy would follow the same one in every round."""
    for n in range(1, 20):
        order = [f"s{k}" for k in range(n)]
        period = n if n % 2 == 0 else 2 * n
        rounds = [round_order(order, it) for it in range(period)]
        assert all(sorted(r) == sorted(order) for r in rounds)
        assert sorted(r[0] for r in rounds) == sorted(order * (period // n))  # each leads alike
        follows = Counter((a, b) for r in rounds for a, b in zip(r, r[1:]))
        assert set(follows) == {(a, b) for a in order for b in order if a != b}
        assert set(follows.values()) <= {period // n}  # every pair as often as any other
        assert round_order(order, period) == rounds[0]


def test_a_strategy_that_sat_out_rounds_is_compared_with_the_floor_of_its_own_rounds():
    from harness.job.results import JobSummary
    from harness.job.summary import best_floor, floor_in_rounds

    # The floor's last rounds ran light (the slow strategies had stopped): faster calls.
    calls = {
        "slow": [2.0] * 6,
        "floor": [1.0] * 6 + [0.5] * 10,
        "floor:shm": [0.9] * 6 + [0.4] * 10,
    }
    p50s = {n: float(np.median(c)) * 1e6 for n, c in calls.items()}
    names = ["floor", "floor:shm"]
    summary = JobSummary(
        payload_bytes=1, device="cpu", strategies=dict.fromkeys(calls),  # only their names are read
        floor=best_floor(p50s, names), calls_s=calls,
    )  # fmt: skip
    spec = JobSpec(strategy="slow", layout=Layout(tp=2))
    assert summary.floor.p50_us == pytest.approx(0.4e6)
    own = floor_in_rounds(spec, summary, "slow")
    assert own.p50_us == pytest.approx(0.9e6) and own.name == "floor:shm"
    assert own.single_p50_us == pytest.approx(1.0e6)
    # Every floor method in no more rounds than the strategy: the job's floor as it is.
    assert floor_in_rounds(spec, summary, "floor") is summary.floor
