"""Tier 1 (no process group): replica groups derived from megatron-core's own groups
(strategies.core.groups), with the pure rank maths of strategies.core.layout as the oracle,
and every kind of disagreement raising with the ranks named.
"""

from __future__ import annotations

import dataclasses

import pytest

from strategies import ProcessGroups
from strategies.core.groups import (
    GroupMismatch,
    MegatronView,
    check_order,
    derive_replicas,
    node_indices,
    node_key,
    node_split,
)
from strategies.core.layout import DEFAULT_ORDER, SEED_ORDER, Layout

SHAPES = [(2, 2, 2, 1), (2, 1, 2, 2), (1, 2, 2, 1), (3, 2, 2, 2), (4, 4, 2, 1), (1, 1, 1, 1)]


def views_of(layout: Layout) -> list[MegatronView]:
    """What megatron-core's getters return on every rank of ``layout``."""

    def of(axes: str, rank: int) -> tuple[int, ...]:
        return tuple(layout.group_of(axes, rank))

    return [
        MegatronView(
            rank=r,
            tp=of("tp", r),
            cp=of("cp", r),
            tp_cp=of("tp-cp", r),
            pp=of("pp", r),
            dp=of("dp", r),
            dp_cp=of("dp-cp", r),
            mp=of("tp-pp", r),
        )
        for r in range(layout.world_size)
    ]


@pytest.mark.parametrize("order", [DEFAULT_ORDER, SEED_ORDER])
@pytest.mark.parametrize("dp,pp,tp,cp", SHAPES)
def test_replicas_equal_the_orders_tp_cp_pp_groups(dp, pp, tp, cp, order):
    layout = Layout(dp=dp, pp=pp, tp=tp, cp=cp, order=order)
    replicas = derive_replicas(views_of(layout))
    for group in layout.replica_groups():
        for r in group:
            assert replicas[r] == tuple(sorted(group))
            assert replicas[r][0] == group[0]  # the leader: tp = cp = pp = 0


def test_large_world_derives_without_an_order():
    layout = Layout(dp=16, pp=4, tp=8, cp=2, order=SEED_ORDER)  # 1024 ranks
    replicas = derive_replicas(views_of(layout))
    assert sorted(set(replicas.values())) == sorted(
        tuple(sorted(g)) for g in layout.replica_groups()
    )


def test_a_wrong_order_is_caught_naming_both_groupings():
    """The seed's world described with Megatron's default order: TP×CP agrees, PP does not."""
    real = Layout(dp=2, pp=2, tp=2, order=SEED_ORDER)
    views = views_of(real)
    replicas = derive_replicas(views)
    claimed = Layout(dp=2, pp=2, tp=2, order=DEFAULT_ORDER)
    groups = {a: claimed.groups(a) for a in ("tp-cp", "pp", "dp", "tp-cp-pp")}
    with pytest.raises(GroupMismatch) as err:
        check_order(groups, views, replicas, DEFAULT_ORDER)
    assert str(err.value).startswith("rank 0: order 'tp-cp-ep-dp-pp' gives the pp group [0, 4]")
    assert "megatron-core's groups give [0, 2]" in str(err.value)
    right = {a: real.groups(a) for a in groups}
    check_order(right, views, replicas, SEED_ORDER)  # the true order passes


def with_group(views, rank: int, **groups) -> list[MegatronView]:
    return [dataclasses.replace(v, **groups) if v.rank == rank else v for v in views]


def test_pp_groups_from_another_order_break_orthogonality():
    """TP×CP from the seed's order, PP from the default one: stages mix replicas."""
    seed = views_of(Layout(dp=2, pp=2, tp=2, order=SEED_ORDER))
    default = views_of(Layout(dp=2, pp=2, tp=2, order=DEFAULT_ORDER))
    mixed = [dataclasses.replace(s, pp=d.pp) for s, d in zip(seed, default)]
    with pytest.raises(GroupMismatch, match=r"^rank \d+: .*replica derived from megatron-core"):
        derive_replicas(mixed)


def test_dp_group_meeting_the_replica_twice_is_refused():
    views = views_of(Layout(dp=2, pp=2, tp=2))
    bad = with_group(views, 3, dp=(2, 3))
    with pytest.raises(GroupMismatch, match=r"rank 3: DP group \[2, 3\] meets the replica in"):
        derive_replicas(bad)


def test_a_group_without_its_own_rank_is_refused():
    views = views_of(Layout(dp=2, tp=2))
    with pytest.raises(GroupMismatch, match=r"rank 1: megatron-core's tp_cp group \[2, 3\]"):
        derive_replicas(with_group(views, 1, tp_cp=(2, 3)))


def test_cp_outside_dp_cp_is_refused():
    views = views_of(Layout(dp=2, tp=2, cp=2))
    bad = with_group(views, 0, dp_cp=(0, 4))
    with pytest.raises(GroupMismatch, match=r"rank 0: DP×CP group \[0, 4\] meets the replica"):
        derive_replicas(bad)


# -- which ranks of a replica share a node ---------------------------------------------------
@pytest.mark.parametrize("order", [DEFAULT_ORDER, SEED_ORDER])
@pytest.mark.parametrize("per_node", [8, 4, 16])
def test_a_replica_splits_by_node_at_16k_ranks(order, per_node):
    """16,384 ranks, ``per_node`` consecutive ranks per host (torchrun's blocks): every
    replica's node tuples are exactly its members on each host, leader's node first, each
    led by its first member; node leaders are one per host the replica touches."""
    layout = Layout(dp=128, pp=4, tp=8, cp=4, order=order)
    keys = [node_key({"RANK": str(r), "LOCAL_WORLD_SIZE": str(per_node)}) for r in range(16384)]
    node_of = node_indices(keys)
    assert node_of == tuple(r // per_node for r in range(16384))
    for group in layout.replica_groups()[::17]:  # a spread of the 128 replicas
        split = node_split(group, node_of)
        assert split[0][0] == group[0]
        assert sorted(r for n in split for r in n) == sorted(group)
        for members in split:
            assert len({node_of[r] for r in members}) == 1
            assert list(members) == [r for r in group if node_of[r] == node_of[members[0]]]
        assert len(split) == len({r // per_node for r in group})


def test_node_keys_follow_the_launcher_then_the_host():
    assert node_key({"GROUP_RANK": "3", "RANK": "9", "LOCAL_WORLD_SIZE": "2"}) == "node 3"
    assert node_key({"SLURM_NODEID": "1"}) == "node 1"
    assert node_key({"RANK": "9", "LOCAL_WORLD_SIZE": "4"}) == "node 2"
    assert node_key({}).startswith("host ")
    assert node_key({"RANK": "x", "LOCAL_WORLD_SIZE": "0"}).startswith("host ")
    assert node_split((4, 5, 6), ()) == ((4, 5, 6),)  # unknown: one node


def test_process_groups_name_their_node_local_ranks_and_node_leaders():
    node_of = (0, 0, 1, 1, 0, 0, 1, 1)
    groups = ProcessGroups(
        None, None, None, (2, 3), (2, 6), (0, 1, 2, 3, 4, 5, 6, 7), 0, 0, rank=2, node_of=node_of
    )
    assert groups.replica_nodes == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert groups.node_local_ranks == (2, 3, 6, 7)
    assert groups.node_leaders == (0, 2)
