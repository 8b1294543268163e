"""The gate on carry-over: a job alternating a large and a small batch on the header family.

One round = one job whose calls cycle large, small, large, ... (``payload.cycle``), then time
each shape alone (``steady_iters``). Each shape's p50 inside the sequence over its steady-state
p50, both from the same job (``vs_steady`` in the record's ``shapes``), median over rounds,
must stay within ``bounds.VS_STEADY`` (per mode): a small call that pays for the large one before it
fails here, however fast the steady state is.
"""

from __future__ import annotations

import statistics

import pytest
from bounds import ALTERNATING, ALTERNATING_STRATEGIES, VS_STEADY

from harness.job.execute import run_job
from harness.job.spec import JobSpec
from harness.payload.workload import build
from strategies.core.layout import Layout

LAYOUT = Layout(pp=2, tp=2)
SEQ_LEN = 512


def alternating_spec(strategy: str, mode) -> JobSpec:
    """large, small, large, ...: the timed calls hold ``mode.iters`` of each shape (the
    sequence's p50), then ``mode.iters`` rounds of each shape alone (its steady state). No
    references: the gate compares the strategy with itself."""
    cycle = [{"batch_size": ALTERNATING["large"]}, {"batch_size": ALTERNATING["small"]}]
    payload = {"batch_size": ALTERNATING["large"], "cycle": cycle}
    return JobSpec(
        strategy,
        LAYOUT,
        payload="rl_rollout",
        batch_size=ALTERNATING["large"],
        seq_len=SEQ_LEN,
        iters=2 * mode.iters,
        warmup=2 * mode.warmup,  # every slot of shm's ring has held both shapes (auto)
        references=(),
        workload=build(payload, LAYOUT.dp, SEQ_LEN, recorded=False),
        steady_iters=mode.iters,
    )


@pytest.mark.world
@pytest.mark.parametrize("strategy", ALTERNATING_STRATEGIES)
def test_alternating_shapes_pay_their_own_size(bench_world, mode, strategy, record_property):
    spec = alternating_spec(strategy, mode)
    rounds = []
    for _ in range(mode.rounds):
        rounds.append(run_job(bench_world, spec)["shapes"])
    names = [f"b{s['batch_size']} ({s['payload_bytes']:,} B)" for s in rounds[0]]
    median = [statistics.median(r[k]["vs_steady"] for r in rounds) for k in range(len(names))]
    record_property("vs_steady", dict(zip(names, median)))
    record_property("rounds", rounds)
    bound = VS_STEADY[mode.name]
    problems = [
        f"{name}: p50 in the sequence {v:.2f}x its steady state > {bound} ({mode.name} mode)"
        for name, v in zip(names, median)
        if v > bound
    ]
    assert not problems, (
        f"{strategy} alternating on tp2pp2: "
        + "; ".join(problems)
        + (" [" + per_round(names, rounds) + "]")
    )


def per_round(names: list[str], rounds: list[list[dict]]) -> str:
    return "; ".join(
        f"round {i}: "
        + ", ".join(
            f"{n} {s['p50_us'] / 1e3:.2f} ms vs steady {s['steady_p50_us'] / 1e3:.2f} ms"
            for n, s in zip(names, r)
        )
        for i, r in enumerate(rounds)
    )
