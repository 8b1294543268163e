"""A user's CI gate for their own strategy (here the example package's ``per_key``): one
verified job per pytest-benchmark round with the floor and ``pickled`` in the same run, gated
on same-run ratios. Run: ``pytest --bcastbench-mode=short`` (``full`` for numbers to keep)."""

import statistics

MY_STRATEGY = "per_key"  # or a dotted path: "my_pkg.strategies.MyStrategy"


def test_my_strategy_beats_pickled(benchmark, bcastbench_job, bcastbench_mode):
    runs = []

    def one_job():
        runs.append(
            bcastbench_job(
                strategy=MY_STRATEGY,
                layout="tp2pp2",
                payload="rl_rollout",
                batch_size=64,
                options={"coalesce": True},
            )
        )

    benchmark.pedantic(one_job, rounds=bcastbench_mode.rounds, iterations=1)
    while len(runs) < bcastbench_mode.rounds:  # with --benchmark-disable it ran once
        one_job()
    vs_floor = statistics.median(r["vs_floor"] for r in runs)
    vs_baseline = statistics.median(r["vs_baseline"] for r in runs)
    benchmark.extra_info.update(vs_floor=vs_floor, vs_baseline=vs_baseline)
    assert runs[0]["collectives_per_call"] == 3  # size, header, one coalesced buffer
    # Generous on purpose: shared CI runners are noisy; the collective count above is the
    # structural check, this one catches a strategy that stopped being a broadcast at all.
    assert vs_floor < 8.0, f"{MY_STRATEGY} is {vs_floor:.2f}x the floor"
    assert vs_baseline < 1.0, f"{MY_STRATEGY} is not faster than pickled ({vs_baseline:.2f}x)"
