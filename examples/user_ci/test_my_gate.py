"""A user's CI gate for their own strategy (here the example package's ``per_key``): each
pytest-benchmark round is one verified job with the floor and ``pickled`` in the same run, and
the gate asserts on same-run ratios. Run: ``pytest --bcastbench-mode=short`` (``full`` for
numbers to keep)."""

MY_STRATEGY = "per_key"  # or a dotted path: "my_pkg.strategies.MyStrategy"


def test_my_strategy_beats_pickled(bcastbench_gate):
    gate = bcastbench_gate(
        strategy=MY_STRATEGY,
        layout="tp2pp2",
        payload="rl_rollout",
        batch_size=64,
        options={"coalesce": True},
    )
    assert gate.collectives_per_call == 3  # size, header, one coalesced buffer
    # Bounds on ratios, never on times: the floor and pickled ran in the same world and rounds.
    # Three collectives where the network floor issues one: near 3x at this size by
    # construction, so the bound sits above that with room for a noisy shared runner. The
    # network floor is what a strategy on gloo or NCCL can reach (vs_floor's floor also has
    # node-local shared memory).
    assert gate.vs_floor_network < 4.0, f"{MY_STRATEGY}: {gate.vs_floor_network:.2f}x the floor"
    assert gate.vs_baseline < 1.0, f"{MY_STRATEGY} is not faster than pickled"
