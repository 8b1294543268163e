"""The pytest plugin shows what it gates: under ``bcastbench_gate`` pytest-benchmark's rounds
are the strategy's per-call p50s (not a job's wall time), ``extra_info`` carries the same-run
ratios, and a terminal section lists each gated test's p50 per call, vs_floor and vs_baseline
with their 95 % intervals; ``gate.holds(...)`` passes only on a whole interval below its bound.

A user's suite runs in-process (pytester) with ``bcastbench_job`` overridden by canned job
summaries, so no rank starts; the real jobs run in tests/world/test_byo.py's example suite."""

from __future__ import annotations

import json
import statistics

import pytest

from harness import pytest_plugin

pytest_plugins = ["pytester"]

P50_US = [4000.0, 9000.0, 5000.0]
"""The strategy's per-call p50 in each canned round (µs): the benchmark's rounds must be these."""
FLOOR_US = 2000.0
PICKLED_US = 20000.0

CANNED = f"""
import itertools, time
import pytest

from harness.pytest_plugin import record_job

P50 = itertools.cycle({P50_US!r})


@pytest.fixture
def bcastbench_job(request):
    def job(strategy, layout="tp2pp2", options=None, **spec):
        time.sleep(0.05)  # a job's wall time, far from its per-call p50
        p50 = next(P50)
        summary = dict(strategy=strategy, p50_us=p50, floor_p50_us={FLOOR_US}, floor_method="one",
                       vs_floor=p50 / {FLOOR_US}, vs_baseline=p50 / {PICKLED_US},
                       vs_floor_lo=0.9 * p50 / {FLOOR_US}, vs_floor_hi=1.1 * p50 / {FLOOR_US},
                       baseline_p50_us={PICKLED_US}, payload_bytes=3 << 20,
                       collectives_per_call=3, layout=layout, payload="rl_rollout",
                       samples_us=[0.9 * p50, p50, 1.1 * p50] * 3)
        record_job(request, summary)
        return summary
    return job
"""

GATED = """
def test_gated(bcastbench_gate):
    gate = bcastbench_gate(strategy="header", layout="tp2pp2", batch_size=8)
    assert gate.vs_floor < 4.0 and gate.vs_baseline < 1.0
    assert gate.holds(vs_floor_below=4.0)
    held = gate.holds(vs_floor_below=2.6)  # the median (2.5) is below, the interval is not
    assert not held and "vs_floor [2.25, 2.75] is not wholly below 2.6" in repr(held)
    assert not gate.holds(vs_baseline_below=1.0)  # the canned jobs carry no ratio interval
"""


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(CANNED)
    pytester.makepyfile(test_user=GATED)
    return pytester


def test_benchmark_rounds_are_the_per_call_p50s(suite):
    result = suite.runpytest_inprocess("--benchmark-json=bench.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    bench = json.loads((suite.path / "bench.json").read_text())["benchmarks"][0]
    assert sorted(bench["stats"]["data"]) == pytest.approx(sorted(p / 1e6 for p in P50_US))
    info = bench["extra_info"]
    median = statistics.median(P50_US)
    assert info["p50_us"] == median and info["stats_are"].startswith("strategy p50 per call")
    assert info["vs_floor"] == pytest.approx(median / FLOOR_US)
    assert info["vs_baseline"] == pytest.approx(median / PICKLED_US)
    assert info["collectives_per_call"] == 3 and info["rounds"] == len(P50_US)
    assert (info["vs_floor_lo"], info["vs_floor_hi"]) == pytest.approx((2.25, 2.75))
    # The p50's interval pools every round's calls, widened to each round's own p50.
    assert info["p50_lo_us"] == min(P50_US) and info["p50_hi_us"] == max(P50_US)
    assert info["vs_baseline_lo"] is None
    # bcastbench compare reads the same file: one cell, its rounds as samples.
    from harness.report import cells

    (cell,) = cells.load_cells(suite.path / "bench.json").values()
    assert cell.key == ("header", "tp2pp2", "rl_rollout", 3 << 20)
    assert sorted(cell.samples) == pytest.approx(sorted(P50_US))


def test_disabled_benchmarks_still_run_every_round_and_the_section_says_so(suite):
    result = suite.runpytest_inprocess("--benchmark-disable", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert pytest_plugin.SUMMARY_TITLE in out
    row = next(line for line in out.splitlines() if line.startswith("test_gated "))
    assert f" {len(P50_US)} " in row  # every round ran, though pytest-benchmark timed none
    assert f"{statistics.median(P50_US) / FLOOR_US:.2f}x [2.25, 2.75]" in row


def test_the_section_follows_the_benchmark_table(suite):
    out = suite.runpytest_inprocess("-p", "no:cacheprovider").stdout.str()
    assert "benchmark: 1 tests" in out and "Name (time in ms)" in out
    assert out.index("benchmark: 1 tests") < out.index(pytest_plugin.SUMMARY_TITLE)


def test_summary_section_lists_the_gated_figures():
    median = statistics.median(P50_US)
    runs = [
        dict(strategy="per_key", p50_us=p, floor_p50_us=FLOOR_US, floor_method="one",
             vs_floor=p / FLOOR_US, vs_baseline=p / PICKLED_US, payload_bytes=3 << 20,
             collectives_per_call=3, layout="tp2pp2", payload="rl_rollout")
        for p in P50_US
    ]  # fmt: skip
    lines = pytest_plugin.summary_lines({"test_user.py::test_gated": runs})
    header, row = lines[0].split(), lines[1].split()
    assert header[:5] == ["test", "strategy", "layout", "payload", "jobs"]
    assert row[:3] == ["test_gated", "per_key", "tp2pp2"]
    assert f"{median / 1e3:.3f}" in row and f"{median / FLOOR_US:.2f}x" in row
    assert f"{median / PICKLED_US:.2f}x" in row and row[-1] == "3"
    legend = " ".join(lines[2:])
    assert "lower is better" in legend and "faster than pickled" in legend
