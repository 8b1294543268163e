"""pytest-benchmark cases for the cost model's promise: ``harness.commands.predict`` answers for one
16,384-GPU layout in well under a second (issue 6), and ``pricing.price`` prices a plan of
thousands of collectives. Times are recorded in the benchmark JSON and compared across runs
with ``pytest-benchmark compare``; they are not asserted, because an absolute time on a shared
CI runner measures the runner (see bounds.py for the ratio gate).
"""

from __future__ import annotations

import pytest


@pytest.mark.benchmark(group="predict")
def test_bench_predict_one_layout(benchmark):
    from harness.commands.predict import EXAMPLE, composed, run

    cfg = composed([*EXAMPLE, "quiet=true"])
    run(cfg)  # one-off imports and caches stay out of the timed rounds
    record = benchmark.pedantic(run, args=(cfg,), rounds=3, iterations=1)
    assert record["world_size"] == 16384 and record["winner"]


@pytest.mark.benchmark(group="predict")
def test_bench_price_16k_rank_tree_plan(benchmark):
    """gloo's tree priced round by round across nodes, for every group of a 16,384-rank world."""
    from dataclasses import replace

    from strategies import get_class
    from strategies.core.cluster import load_cluster
    from strategies.core.layout import Layout
    from strategies.core.plan import PayloadSpec
    from strategies.core.pricing import price

    layout = Layout(dp=128, pp=8, tp=8, cp=2)
    spec = PayloadSpec(tensor_bytes=64 << 20, n_tensors=8, header_bytes=4096, pickle_bytes=0)
    plan = get_class("header").plan(layout, spec)
    cluster = replace(load_cluster("emulated"), gpus_per_node=8, nics_per_node=8)
    pred = benchmark.pedantic(price, args=(plan, cluster, layout), rounds=3, iterations=1)
    assert len(plan.comms) > 2000 and pred.total_s > 0
