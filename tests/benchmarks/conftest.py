"""Benchmark-gate fixtures: the run mode (short for CI, full for numbers) and a warmed world.

``BCASTBENCH_BENCH=short`` (the default) or ``full`` picks iterations and rounds. The world is
the session's 4-rank gloo world from tests/conftest.py: started once, before anything is timed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiers import marking

from strategies.core.node_channel import DEFAULT_SLOTS

pytest_collection_modifyitems = marking(__file__, "benchmark")


@dataclass(frozen=True)
class BenchMode:
    name: str
    iters: int
    """Timed, interleaved iterations per job (each of strategy, floor, pickled)."""
    warmup: int
    """Untimed iterations per strategy before them: ``WARMUP``, so no timed call of shm, of
    auto serving with it or of the floor's shm method makes a segment of its ring."""
    rounds: int
    """Jobs per benchmark; the gate takes the median of their ratios."""


WARMUP = DEFAULT_SLOTS + 1
"""Untimed calls per strategy: shm's first calls make its ring's segments (one per slot), and
auto's first call is served by ``flat`` before its own shm ring gets the rest."""

MODES = {
    "short": BenchMode("short", iters=8, warmup=WARMUP, rounds=5),
    "full": BenchMode("full", iters=30, warmup=WARMUP, rounds=7),
}


def pytest_configure(config) -> None:
    json_path = config.getoption("benchmark_json", None)
    if json_path is not None:
        # pytest-benchmark opens the path without creating its folder (results/ci/ is ignored).
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)


def pytest_benchmark_update_json(config, benchmarks, output_json) -> None:
    """Say in the saved JSON what the numbers are, so a later reader needs no source."""
    from bounds import BOUNDS, MIN_VS_FLOOR

    output_json["bcastbench"] = {
        "mode": bench_mode().name,
        "stats_are": "per-call p50 of the strategy (max over ranks, barrier before each call), "
        "one value per round = one interleaved job; extra_info holds the same-job ratios",
        "bounds": {f"{s}@{size}": b for (s, size), b in BOUNDS.items()},
        "min_vs_floor": MIN_VS_FLOOR,
    }


def bench_mode() -> BenchMode:
    name = os.environ.get("BCASTBENCH_BENCH", "short").strip().lower() or "short"
    if name not in MODES:
        raise pytest.UsageError(f"BCASTBENCH_BENCH={name!r}; valid values: {sorted(MODES)}")
    return MODES[name]


@pytest.fixture(scope="session")
def mode() -> BenchMode:
    return bench_mode()


@pytest.fixture(scope="session")
def bench_world(world4):
    """The session's 4-rank world with the benchmark layout's groups already built, so neither
    process start-up nor megatron-core group creation falls inside a benchmark round."""
    from harness.job.execute import run_job
    from harness.job.spec import JobSpec
    from strategies.core.layout import Layout

    warm = JobSpec("flat", Layout(pp=2, tp=2), batch_size=1, seq_len=64, iters=1, warmup=0)
    run_job(world4, warm)
    return world4
