"""pytest-benchmark case for the cost model's promise: ``harness.predict`` answers for one
16,384-GPU layout in well under a second (issue 6). The time is recorded in the benchmark JSON
and compared across runs with ``pytest-benchmark compare``; it is not asserted, because an
absolute time on a shared CI runner measures the runner (see bounds.py for the ratio gate).
"""

from __future__ import annotations

import pytest


@pytest.mark.benchmark(group="predict")
def test_bench_predict_one_layout(benchmark):
    from hydra import compose, initialize_config_dir

    from harness.predict import CONF, EXAMPLE, run

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="predict", overrides=[*EXAMPLE, "quiet=true"])
    run(cfg)  # one-off imports and caches stay out of the timed rounds
    record = benchmark.pedantic(run, args=(cfg,), rounds=3, iterations=1)
    assert record["world_size"] == 16384 and record["winner"]
