"""Tier 2 (real gloo worlds): ``ProcessGroups.from_megatron()`` with no order argument on a
world megatron-core initialized with the seed's order (``tp-cp-ep-pp-dp``): the groups it
derives are the layout's, every strategy is exact on them, and an order that contradicts
megatron-core's groups raises on every rank before any strategy runs.
"""

from __future__ import annotations

import pytest
from batchgen import BatchSpec
from test_strategies_world import FIXED, TEST_OPTIONS, run_contract

import strategies
from strategies.core.groups import GroupMismatch
from strategies.core.layout import DEFAULT_ORDER, SEED_ORDER, Layout

SEED_LAYOUTS = [
    pytest.param(Layout(dp=2, pp=2, tp=2, order=SEED_ORDER), id="dp2pp2tp2-seed"),
    pytest.param(Layout(dp=2, tp=2, cp=2, order=SEED_ORDER), id="dp2cp2tp2-seed"),
]


def megatron_groups_job(ctx, layout: Layout, order: str | None):
    """Initialize megatron-core with the layout's order, then build the strategies' groups
    from its state with ``order`` (None: derived); the groups are left where the contract
    jobs look them up (``ctx.groups_for``), so every strategy runs on exactly these."""
    from megatron.core import parallel_state

    from harness.worlds.rank import _recording_new_groups

    ctx.cache = {k: v for k, v in ctx.cache.items() if k[0] != "groups"}
    ctx.release_groups()
    with _recording_new_groups() as made:
        ctx.cache["owned_groups", None] = made  # released by the next layout, even on failure
        parallel_state.initialize_model_parallel(
            **layout.megatron_kwargs(), create_gloo_process_groups=False
        )
        groups = strategies.ProcessGroups.from_megatron(order=order, device=ctx.device)
    ctx.cache["groups", layout] = groups
    return (
        groups.replica_ranks, groups.pp_ranks, groups.tp_cp_ranks, groups.replicas,
        groups.node_of, groups.node_local_ranks, groups.node_leaders,
    )  # fmt: skip


@pytest.mark.world
@pytest.mark.parametrize("layout", SEED_LAYOUTS)
def test_groups_without_order_are_the_layouts(world8, layout):
    got = world8.run(megatron_groups_job, layout, None)
    for rank, (replica, pp, tp_cp, replicas, node_of, local, node_leaders) in enumerate(got):
        # A forked world is one host: every rank of a replica is node-local, one node leader.
        assert node_of == (0,) * 8 and local == replica and node_leaders == (replica[0],)
        assert list(replica) == layout.group_of("tp-cp-pp", rank), rank
        assert list(pp) == layout.group_of("pp", rank), rank
        assert list(tp_cp) == layout.group_of("tp-cp", rank), rank
        assert replica[0] == layout.leaders()[layout.coords(rank)["dp"]]
        assert replicas == layout.dp
    spec = BatchSpec(FIXED.leaves, FIXED.non_tensor, FIXED.meta, broadcast_non_tensor=True)
    for name in strategies.names_for_world():
        options = TEST_OPTIONS.get(name, {})
        try:
            problems = run_contract(world8, name, layout, spec, (3, 3, 1), 11, options)
        except pytest.skip.Exception:  # a peer that refuses the layout on every rank
            continue
        assert problems == [], name


def mismatch_job(ctx, layout: Layout, order: str):
    """``megatron_groups_job`` that returns the GroupMismatch each rank raised (or None)."""
    try:
        megatron_groups_job(ctx, layout, order)
    except GroupMismatch as exc:
        return str(exc)
    return None


@pytest.mark.world
def test_an_order_megatron_did_not_use_raises_on_every_rank(world8):
    layout = Layout(dp=2, pp=2, tp=2, order=SEED_ORDER)
    messages = world8.run(mismatch_job, layout, DEFAULT_ORDER, timeout_s=30)
    assert len(set(messages)) == 1, messages  # every rank, the same message
    assert messages[0].startswith(
        "rank 0: order 'tp-cp-ep-dp-pp' gives the pp group [0, 4], "
        "but megatron-core's groups give [0, 2]"
    ), messages[0]
