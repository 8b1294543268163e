"""Tier 3 (real gloo worlds): count the collectives each strategy issues, per rank, and check
that every strategy's ``plan`` lists exactly the collectives a real call records.
"""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch

import strategies
from harness.payload import generated
from strategies import DataProto
from strategies.core.layout import SEED_ORDER, Layout
from strategies.core.parts import nbytes_of
from strategies.core.plan import Plan, spec_of
from strategies.core.trace import Recorder

pytestmark = pytest.mark.world

TP2PP2 = Layout(tp=2, pp=2)
PP2CP2 = Layout(pp=2, cp=2)
TP4 = Layout(tp=4)
PP4 = Layout(pp=4)
DP2_DEFAULT = Layout(dp=2, pp=2, tp=2)
DP2_SEED = Layout(dp=2, pp=2, tp=2, order=SEED_ORDER)
DP2_CP_SEED = Layout(dp=2, tp=2, cp=2, order=SEED_ORDER)
LAYOUTS = [TP2PP2, PP2CP2, DP2_DEFAULT, DP2_SEED, DP2_CP_SEED]


def leaf_bytes(dp: DataProto) -> tuple[int, ...]:
    return tuple(nbytes_of(t) for _, t in dp.batch.items(include_nested=True, leaves_only=True))


def make_batch(payload: str, flag: bool) -> DataProto:
    # The same data on every replica, so one PayloadSpec describes every leader's batch.
    return generated.make(payload, 2, 64, seed=3, broadcast_non_tensor=flag)


# -- the job: record two calls on every rank -----------------------------------------------------
def record_job(ctx, name: str, layout: Layout, payload: str, flag: bool, options) -> dict:
    groups = ctx.groups_for(layout)
    full = make_batch(payload, flag)
    try:
        strategy = strategies.get(name, groups, **options)
    except NotImplementedError as exc:  # a peer that refuses this layout on every rank
        return {"refused": f"{type(exc).__name__}: {exc}"}
    strategy.prepare(full.entry_state(groups.is_leader))
    calls = []
    # First call, then steady state; a third call, because auto's choice (served from the
    # second call on) may set itself up on its first call (shm connects its node).
    for _ in range(3):
        with Recorder() as rec:
            strategy.get_data_input(full.entry_state(groups.is_leader))
        calls.append([(c.kind, c.ranks, c.root, c.nbytes) for c in rec.comms])
    return {
        "rank": ctx.rank,
        "is_leader": groups.is_leader,
        "calls": calls,
        "spec": spec_of(full) if groups.is_leader else None,
        "leaf_bytes": leaf_bytes(full),
    }


def record(world, name, layout, payload="multimodal", flag=False, **options) -> list[dict]:
    results = world.run(record_job, name, layout, payload, flag, options)
    if "refused" in results[0]:
        pytest.skip(f"{name} refuses {layout.describe()}: {results[0]['refused'][:120]}")
    return results


def world_of(request, layout: Layout):
    return request.getfixturevalue("world4" if layout.world_size == 4 else "world8")


def leader_counts(results: list[dict], call: int) -> list[int]:
    return [len(r["calls"][call]) for r in results if r["is_leader"]]


def total_bytes(results: list[dict]) -> int:
    spec = next(r["spec"] for r in results if r["spec"] is not None)
    return spec.header_bytes + spec.tensor_bytes


# -- counts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [TP2PP2, TP4, PP4, DP2_SEED], ids=lambda x: x.describe())
def test_pickled_two_per_hop(request, layout):
    results = record(world_of(request, layout), "pickled", layout)
    for r in results:
        c = layout.coords(r["rank"])
        hops = (c["pp"] == 0 and layout.tp_cp > 1) + (layout.pp > 1)
        assert len(r["calls"][1]) == 2 * hops, r["rank"]
        assert len({comm[1] for comm in r["calls"][1]}) == hops  # one group per hop
        sizes = [comm[3] for comm in r["calls"][1]]
        assert sizes[0::2] == [8] * hops  # the object sizes, then the pickled bytes


@pytest.mark.parametrize("name", ["header", "flat", "pp_first"])
@pytest.mark.parametrize("layout", [TP2PP2, TP4, DP2_SEED], ids=lambda x: x.describe())
def test_wire_strategies_one_broadcast_per_hop_in_steady_state(request, name, layout):
    if name not in strategies.names_for_world():
        pytest.skip(f"{name} is not installed")
    results = record(world_of(request, layout), name, layout)
    assert total_bytes(results) > 64 << 10  # the first call must outgrow the 64 KiB default
    hops = 1 if name == "flat" else (layout.tp_cp > 1) + (layout.pp > 1)
    assert leader_counts(results, 1) == [hops] * layout.dp
    assert leader_counts(results, 0) == [2 * hops] * layout.dp
    for r in results:
        assert len(r["calls"][1]) in (1, 2)
        assert all(kind == "broadcast" for kind, *_ in r["calls"][1])
        assert 2 * len(r["calls"][1]) == len(r["calls"][0])


@pytest.mark.parametrize("name", ["header", "flat"])
def test_small_batch_is_one_broadcast_per_hop_from_the_first_call(world4, name):
    results = record(world4, name, TP2PP2, payload="pretrain")
    assert total_bytes(results) < 64 << 10
    hops = 1 if name == "flat" else 2
    assert leader_counts(results, 0) == leader_counts(results, 1) == [hops]


@pytest.mark.parametrize("layout", [TP2PP2, TP4, PP4, DP2_CP_SEED], ids=lambda x: x.describe())
def test_scatter_allgather_as_its_docstring_claims(request, layout):
    """Header broadcast + scatter on stage 0 (tp·cp>1) + chunk broadcast (pp>1) + all-gather
    (tp·cp>1), every call."""
    results = record(world_of(request, layout), "scatter_allgather", layout)
    n = layout.tp_cp
    for r in results:
        stage0 = layout.coords(r["rank"])["pp"] == 0
        expected = ["broadcast"]
        if n > 1 and stage0:
            expected.append("scatter")
        if layout.pp > 1:
            expected.append("broadcast")
        if n > 1:
            expected.append("all_gather")
        for call in r["calls"]:
            assert [kind for kind, *_ in call] == expected, r["rank"]


@pytest.mark.parametrize("layout", [TP2PP2, DP2_SEED], ids=lambda x: x.describe())
def test_floor_is_one_broadcast(request, layout):
    results = record(world_of(request, layout), "floor", layout)
    tensor_bytes = next(r["spec"] for r in results if r["spec"]).tensor_bytes
    for r in results:
        for call in r["calls"]:
            assert len(call) == 1
            kind, ranks, root, nbytes = call[0]
            assert kind == "broadcast" and nbytes == tensor_bytes
            assert list(ranks) == layout.group_of("tp-cp-pp", r["rank"]) and root == ranks[0]


# -- plan == trace -----------------------------------------------------------------------------
def planned(name: str, layout: Layout, results: list[dict], first_call: bool, **options) -> Plan:
    cls = strategies.get_class(name)
    spec = next(r["spec"] for r in results if r["spec"] is not None)
    params = inspect.signature(cls.plan).parameters
    kwargs = dict(options)
    if "leaf_bytes" in params:
        kwargs["leaf_bytes"] = results[0]["leaf_bytes"]
    if first_call:
        kwargs["expect"] = 64 << 10
    return cls.plan(layout, spec, **kwargs)


def mismatches(plan: Plan, results: list[dict], call: int) -> list[str]:
    out = []
    for r in results:
        rank = r["rank"]
        want = plan.for_rank(rank)
        got = r["calls"][call]
        if len(want) != len(got):
            out.append(
                f"rank {rank}: plan has {len(want)} comms, trace {len(got)}: "
                f"plan {[(c.kind, c.ranks, c.root, c.nbytes) for c in want]} trace {got}"
            )
            continue
        for i, (c, (kind, ranks, root, nbytes)) in enumerate(zip(want, got)):
            if c.what == "barrier" and (kind, ranks, c.nbytes) == ("barrier", c.ranks, 0):
                continue  # a pulled store's barrier, priced as an empty broadcast
            if (c.kind, c.ranks, c.root) != (kind, ranks, root):
                out.append(
                    f"rank {rank} comm {i}: plan {c.kind, c.ranks, c.root}, trace "
                    f"{kind, ranks, root}"
                )
            elif c.exact and c.nbytes != nbytes:
                out.append(f"rank {rank} comm {i} ({c.what}): plan {c.nbytes} B, trace {nbytes} B")
    return out


def has_plan(name: str) -> bool:
    return strategies.get_class(name).plan.__func__ is not strategies.Strategy.plan.__func__


PLANNED = [n for n in strategies.names_for_world(include_floor=True) if has_plan(n)]


@pytest.mark.parametrize("flag", [False, True], ids=["tensors_only", "non_tensor"])
@pytest.mark.parametrize("name", PLANNED)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.describe())
def test_plan_equals_trace_in_steady_state(request, layout, name, flag):
    results = record(world_of(request, layout), name, layout, flag=flag)
    assert mismatches(planned(name, layout, results, first_call=False), results, 2) == []


@pytest.mark.parametrize("name", [n for n in PLANNED if n in ("header", "flat", "pp_first")])
@pytest.mark.parametrize("layout", [TP2PP2, DP2_SEED], ids=lambda x: x.describe())
def test_plan_equals_trace_on_the_first_call(request, layout, name):
    """Plans of the wire-based strategies take the announced size: 64 KiB before any call."""
    results = record(world_of(request, layout), name, layout)
    assert mismatches(planned(name, layout, results, first_call=True), results, 0) == []


@pytest.mark.parametrize("layout", [TP2PP2, DP2_SEED], ids=lambda x: x.describe())
def test_direct_plan_equals_trace_with_leaves_sent_alone(request, layout):
    """With a 1 KiB threshold the multimodal batch has leaves on both paths: the plan lists
    the message, then one broadcast per large leaf, first call and steady state."""
    opts = {"direct_min_bytes": 1024}
    results = record(world_of(request, layout), "direct", layout, flag=True, **opts)
    for call in (0, 1):
        plan = planned("direct", layout, results, first_call=call == 0, **opts)
        alone = [c for c in plan.comms if c.what == "leaf"]
        assert 0 < len(alone) < len(results[0]["leaf_bytes"]) * layout.dp
        assert mismatches(plan, results, call) == []


def test_spec_of_matches_what_the_codec_packs():
    from strategies.core.packer import pack

    for flag in (False, True):
        dp = make_batch("multimodal", flag)
        spec = spec_of(dp)
        _, header = pack(dp.batch, dp.non_tensor_batch if flag else None)
        # header_bytes folds in the codec's 64-byte leaf padding, so the plans' message size
        # (header + tensors + the non-tensor blob's padded room) is exactly what pack lays out.
        assert spec.message_bytes == header.total_bytes
        assert spec.n_tensors == len(header.entries)
        assert spec.tensor_bytes == sum(e.nbytes for e in header.entries)
        assert sum(spec.dtype_bytes) == spec.tensor_bytes
        assert spec.pickle_bytes == len(pickle.dumps(dp.batch))
        assert torch.bfloat16 in {e.dtype for e in header.entries}


def test_a_settled_strategy_records_its_collectives_in_its_last_timed_call(world4):
    """A budget its first call already spent (``time_budget_s`` below any call) leaves every
    strategy one warm-up call: its collectives are then recorded in its last timed call, the
    same count and check a steady warm-up call gives."""
    from harness.job.execute import run_job
    from harness.job.spec import JobSpec

    def job(budget):
        spec = JobSpec(
            "header", TP2PP2, batch_size=8, seq_len=64, iters=6, warmup=2,
            references=("shm", "pickled"), time_budget_s=budget,
        )  # fmt: skip
        return run_job(world4, spec)

    settled, steady = job(1e-9), job(None)
    for record in (settled, steady):
        assert record["correct"], record
    assert settled["collectives_per_call"] == steady["collectives_per_call"] == 2
    for name in ("shm", "pickled"):
        counted = settled["references"][name]["collectives_per_call"]
        assert counted == steady["references"][name]["collectives_per_call"], name
