"""Tier 2 (real gloo worlds): verl 0.9.1's own DataProto and its own worker payload (jagged
NestedTensor and NonTensorData/NonTensorStack leaves, from verl's ``left_right_2_no_padding``)
through every strategy on tp2pp2 and tp2pp2dp2. Every rank either ends with the leader's batch,
exact, in the class it was handed, or raises a refusal naming the leader's error.
Skips when verl is not installed (see tests/verl_support.py for the install).
"""

from __future__ import annotations

import pytest
from batchgen import batch_problems
from verl_support import receiver_entry, verl_dataproto, verl_modules, verl_worker_payload

import strategies
from strategies.core.layout import Layout

LAYOUTS = {"tp2pp2": Layout(tp=2, pp=2), "tp2pp2dp2": Layout(dp=2, tp=2, pp=2)}
PAYLOADS = {
    "verl_dataproto_flag": lambda b, s: verl_dataproto(b, s, True),
    "verl_dataproto": lambda b, s: verl_dataproto(b, s, False),
    "verl_worker_payload": verl_worker_payload,
}


def interop_job(ctx, name: str, layout: Layout, payload: str):
    """Two calls (a first and a steady-state one) with this replica's verl object."""
    groups = ctx.groups_for(layout)
    try:
        strategy = strategies.get(name, groups)
    except NotImplementedError as exc:
        return "refused layout", str(exc)
    problems = []
    for call, b in enumerate((3, 3)):
        seed = 100 * layout.coords(ctx.rank)["dp"] + call
        expected = PAYLOADS[payload](b, seed)
        entry = PAYLOADS[payload](b, seed) if groups.is_leader else receiver_entry(expected)
        try:
            out = strategy.get_data_input(entry)
        except Exception as exc:  # noqa: BLE001 -- the leader may raise its own type
            return "refused", f"{type(exc).__name__}: {exc}"
        if type(out) is not type(expected) or out is not entry:
            problems.append(f"rank {ctx.rank}: returned {type(out).__name__}, not the entry")
        problems += batch_problems(expected, out, groups.is_leader, f"rank {ctx.rank} call {call}")
    return "exact", problems


@pytest.mark.world
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", strategies.names_for_world())
def test_verl_objects_arrive_exact_or_are_refused_on_every_rank(request, name, layout, payload):
    verl_modules()  # skip here, before any rank imports verl
    lay = LAYOUTS[layout]
    world = request.getfixturevalue("world4" if lay.world_size == 4 else "world8")
    results = world.run(interop_job, name, lay, payload, timeout_s=30)
    outcomes = {outcome for outcome, _ in results}
    if outcomes == {"refused layout"}:
        pytest.skip(f"{name} refuses {lay.describe()}")
    assert len(outcomes) == 1, f"ranks disagree: {results}"
    if outcomes == {"exact"}:
        assert [p for _, problems in results for p in problems] == []
        return
    leader = lay.leaders()[0]
    refusal = results[leader][1].split(": ", 1)[1]  # the leader names the leaf it cannot carry
    assert "batch[" in refusal, refusal
    for rank in lay.group_of("tp-cp-pp", leader):
        assert refusal in results[rank][1], (rank, results[rank][1])
    assert name not in ("pickled", "header", "flat", "direct", "pp_first", "scatter_allgather")
