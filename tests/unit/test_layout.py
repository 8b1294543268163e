"""Tier 1 (no process group): our rank maths against megatron-core's own RankGenerator.

Groups and coordinates must equal Megatron's for every token we use, in both orders, up to
16,384 ranks; ``megatron_kwargs`` must pass the checks ``initialize_model_parallel`` makes.
"""

from __future__ import annotations

import itertools
import warnings

import pytest

from strategies.core.layout import (
    AXES,
    DEFAULT_ORDER,
    SEED_ORDER,
    Layout,
    LayoutError,
    parse_layout,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.parallel_state import RankGenerator

TOKENS = ("tp", "pp", "dp", "cp", "tp-cp", "tp-pp", "tp-cp-pp", "dp-cp")
ORDERS = (DEFAULT_ORDER, SEED_ORDER)

# (dp, pp, tp, cp): small odd shapes catch stride mistakes; the last ones are 16,384 ranks.
SHAPES = [
    (1, 1, 1, 1),
    (2, 1, 1, 1),
    (1, 2, 1, 1),
    (1, 1, 2, 1),
    (1, 1, 1, 2),
    (2, 2, 2, 1),
    (2, 2, 2, 2),
    (3, 5, 2, 1),
    (5, 3, 1, 3),
    (2, 3, 4, 5),
    (7, 1, 3, 2),
    (4, 4, 8, 2),
    (16, 16, 8, 4),
]
HUGE_SHAPES = [(128, 8, 8, 2), (64, 4, 8, 8)]


def generator(layout: Layout) -> RankGenerator:
    return RankGenerator(
        tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order=layout.order
    )


def shape_id(shape) -> str:
    dp, pp, tp, cp = shape
    return f"dp{dp}pp{pp}tp{tp}cp{cp}"


# -- groups and coordinates ------------------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES + HUGE_SHAPES, ids=shape_id)
def test_groups_equal_megatron(shape, order):
    dp, pp, tp, cp = shape
    layout = Layout(dp=dp, pp=pp, tp=tp, cp=cp, order=order)
    gen = generator(layout)
    for token in TOKENS:
        assert layout.groups(token) == gen.get_ranks(token), (layout.describe(), token)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_coords_equal_position_in_megatron_groups(shape, order):
    dp, pp, tp, cp = shape
    layout = Layout(dp=dp, pp=pp, tp=tp, cp=cp, order=order)
    gen = generator(layout)
    expected = {r: {} for r in range(layout.world_size)}
    for axis in ("tp", "cp", "dp", "pp"):
        for group in gen.get_ranks(axis):
            for index, rank in enumerate(group):
                expected[rank][axis] = index
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        assert {a: coords[a] for a in ("tp", "cp", "dp", "pp")} == expected[rank], rank
        assert coords["ep"] == 0


@pytest.mark.parametrize("order", ORDERS)
def test_coords_at_16k_ranks_sampled(order):
    layout = Layout(dp=128, pp=8, tp=8, cp=2, order=order)
    gen = generator(layout)
    sample = [0, 1, 2, 15, 16, 17, 127, 128, 1000, 4095, 8191, 12345, 16382, 16383]
    for axis in ("tp", "cp", "dp", "pp"):
        position = {r: i for g in gen.get_ranks(axis) for i, r in enumerate(g) if r in sample}
        for rank in sample:
            assert layout.coords(rank)[axis] == position[rank], (axis, rank)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_groups_partition_the_world(shape, order):
    dp, pp, tp, cp = shape
    layout = Layout(dp=dp, pp=pp, tp=tp, cp=cp, order=order)
    for token in TOKENS:
        groups = layout.groups(token)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(layout.world_size)), token
    replicas = layout.replica_groups()
    assert len(replicas) == dp
    assert all(len(g) == layout.replica_size for g in replicas)
    assert layout.leaders() == [g[0] for g in replicas]
    for leader in layout.leaders():
        c = layout.coords(leader)
        assert c["tp"] == c["cp"] == c["pp"] == 0
    for rank in range(min(layout.world_size, 64)):  # group_of scans every group
        group = layout.group_of("tp-cp", rank)
        assert rank in group and len(group) == layout.tp_cp


def test_token_order_inside_a_group_name_does_not_matter():
    layout = Layout(dp=2, pp=3, tp=2, cp=2, order=SEED_ORDER)
    assert layout.groups("pp-cp-tp") == layout.groups("tp-cp-pp")
    assert layout.groups(" TP - CP ") == layout.groups("tp-cp")


def test_orders_that_omit_size_one_axes_match_megatron():
    for order in ("tp-pp-dp", "tp-dp-pp", "pp-tp", "dp"):
        sizes = {a: 1 for a in ("tp", "cp", "dp", "pp")}
        for axis in order.split("-"):
            sizes[axis] = 3
        layout = Layout(order=order, **sizes)
        gen = RankGenerator(ep=1, order=order, **sizes)
        for token in TOKENS:
            assert layout.groups(token) == gen.get_ranks(token), (order, token)


# -- the seed's example ----------------------------------------------------------------------
def test_seed_example_dp2_pp2_tp2():
    """The walkthrough's 8 ranks: rank = tp + 2·pp + 4·dp (DP slowest)."""
    layout = Layout(dp=2, pp=2, tp=2, order=SEED_ORDER)
    expected = {
        0: (0, 0, 0),
        1: (0, 0, 1),
        2: (0, 1, 0),
        3: (0, 1, 1),
        4: (1, 0, 0),
        5: (1, 0, 1),
        6: (1, 1, 0),
        7: (1, 1, 1),
    }
    for rank, (dp, pp, tp) in expected.items():
        c = layout.coords(rank)
        assert (c["dp"], c["pp"], c["tp"]) == (dp, pp, tp), rank
    assert layout.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("tp-cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.replica_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.leaders() == [0, 4]
    assert layout.group_of("pp", 2) == [0, 2]
    assert layout.group_of("pp", 3) == [1, 3]


def test_default_order_puts_pp_slowest():
    layout = Layout(dp=2, pp=2, tp=2)
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.replica_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.leaders() == [0, 2]


def test_parse_layout():
    assert parse_layout("tp2pp2dp2") == Layout(dp=2, pp=2, tp=2)
    assert parse_layout("dp2tp2cp2", SEED_ORDER) == Layout(dp=2, tp=2, cp=2, order=SEED_ORDER)
    assert parse_layout("PP4") == Layout(pp=4)
    for bad in ("", "tp", "tp2x", "ep2", "tp2 pp2", "tp-2"):
        with pytest.raises(LayoutError, match="cannot parse layout"):
            parse_layout(bad)


# -- megatron_kwargs -------------------------------------------------------------------------
def megatron_checks(layout: Layout) -> list[str]:
    """The arithmetic ``initialize_model_parallel`` (megatron-core 0.16) runs on its
    arguments, replayed without a process group; returns what it would reject."""
    kw = layout.megatron_kwargs()
    world = layout.world_size
    tp = kw["tensor_model_parallel_size"]
    pp = kw.get("pipeline_model_parallel_size", 1)
    cp = kw.get("context_parallel_size", 1)
    ep = kw.get("expert_model_parallel_size", 1)
    etp = kw.get("expert_tensor_parallel_size") or tp
    order = kw.get("order", DEFAULT_ORDER)
    problems = []
    if world % (tp * pp * cp):
        return [f"world {world} not divisible by tp·pp·cp {tp * pp * cp}"]
    dp = world // (tp * pp * cp)
    decoder = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    if world % (etp * ep * pp):
        return [f"world {world} not divisible by etp·ep·pp {etp * ep * pp}"]
    expert_dp = world // (etp * ep * pp)
    expert = RankGenerator(tp=etp, ep=ep, dp=expert_dp, pp=pp, cp=1, order=order)
    if not (order.endswith("pp") or pp == 1 or expert_dp == dp):
        problems.append(f"expert dp {expert_dp} != dp {dp} with order {order}")
    if decoder.get_ranks("pp") != expert.get_ranks("pp"):
        problems.append("pp groups of the expert generator differ")
    # The dense groups Megatron builds must be ours.
    for token in ("tp", "pp", "cp", "dp", "tp-cp"):
        if decoder.get_ranks(token) != layout.groups(token):
            problems.append(f"megatron's {token} groups differ from the layout's")
    return problems


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "shape",
    [s for s in SHAPES if s[0] * s[1] * s[2] * s[3] <= 4096] + [(2, 2, 2, 4), (3, 2, 1, 4)],
    ids=shape_id,
)
def test_megatron_kwargs_pass_initialize_model_parallel_checks(shape, order):
    dp, pp, tp, cp = shape
    layout = Layout(dp=dp, pp=pp, tp=tp, cp=cp, order=order)
    assert megatron_checks(layout) == []
    kw = layout.megatron_kwargs()
    assert kw["tensor_model_parallel_size"] == tp
    assert kw["pipeline_model_parallel_size"] == pp
    assert kw["context_parallel_size"] == cp
    assert kw["order"] == "-".join(layout.tokens)


def test_seed_order_with_cp_needs_expert_tp_absorbing_cp():
    """Why megatron_kwargs sets etp = tp·cp: without it Megatron's own assert fires."""
    layout = Layout(dp=2, pp=2, tp=2, cp=2, order=SEED_ORDER)
    assert layout.megatron_kwargs()["expert_tensor_parallel_size"] == 4
    world, order = layout.world_size, "-".join(layout.tokens)
    naive = RankGenerator(tp=2, ep=1, dp=world // (2 * 2), pp=2, cp=1, order=order)
    assert naive.get_ranks("pp") != generator(layout).get_ranks("pp")


def test_megatron_kwargs_raise_for_orders_megatron_cannot_build():
    """Every order Layout accepts must either work in initialize_model_parallel or be refused
    by megatron_kwargs with a LayoutError (not an AssertionError deep inside Megatron on every
    rank). With cp > 1 and pp > 1 many orders (e.g. tp-pp-cp-ep-dp) have no expert TP size
    that satisfies both of Megatron's checks."""
    silent = []
    for perm in itertools.permutations(AXES):
        order = "-".join(perm)
        for dp, pp, tp, cp in [(2, 2, 2, 2), (1, 2, 2, 2), (2, 2, 1, 2)]:
            layout = Layout(dp=dp, pp=pp, tp=tp, cp=cp, order=order)
            try:
                problems = megatron_checks(layout)
            except LayoutError:
                continue
            if problems:
                silent.append(f"{layout.describe()}: {problems[0]}")
    assert not silent, f"{len(silent)} layouts pass megatron_kwargs but fail in Megatron: " + (
        "; ".join(silent[:3])
    )


# -- errors with arithmetic ------------------------------------------------------------------
def test_check_world_shows_the_arithmetic():
    layout = Layout(dp=2, pp=2, tp=2)
    layout.check_world(8)
    with pytest.raises(LayoutError) as err:
        layout.check_world(6)
    assert str(err.value) == "dp(2) * pp(2) * tp(2) * cp(1) = 8 != WORLD_SIZE(6)"


@pytest.mark.parametrize("axis", ["dp", "pp", "tp", "cp"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_non_positive_or_non_integer_sizes_are_refused(axis, value):
    with pytest.raises(LayoutError, match=rf"layout\.{axis} must be a positive integer, got"):
        Layout(**{axis: value})


def test_bad_orders_are_refused():
    with pytest.raises(LayoutError, match=r"unknown axes \['xp'\]"):
        Layout(order="tp-xp-dp-pp")
    with pytest.raises(LayoutError, match=r"names \['tp'\] more than once"):
        Layout(order="tp-cp-tp-dp-pp")
    with pytest.raises(LayoutError, match=r"omits cp but layout\.cp=2"):
        Layout(cp=2, order="tp-dp-pp")
    Layout(order="tp-dp-pp")  # omitting size-1 axes is fine, as in Megatron


def test_bad_queries_are_refused():
    layout = Layout(dp=2, tp=2)
    with pytest.raises(LayoutError, match="unknown axis 'xp'"):
        layout.groups("tp-xp")
    with pytest.raises(LayoutError, match="rank 4 outside world of 4"):
        layout.coords(4)
    with pytest.raises(LayoutError, match="rank -1 outside world of 4"):
        layout.coords(-1)


def test_sizes_and_describe():
    layout = Layout(dp=3, pp=2, tp=4, cp=2, order=SEED_ORDER)
    assert layout.world_size == 48
    assert layout.replica_size == 16
    assert layout.tp_cp == 8
    assert layout.size("ep") == 1
    assert layout.describe() == "dp3×pp2×tp4×cp2 (tp-cp-ep-pp-dp)"
    assert Layout() == Layout(order=DEFAULT_ORDER)
    assert Layout(dp=2, pp=2) != Layout(dp=2, pp=2, order=SEED_ORDER)
