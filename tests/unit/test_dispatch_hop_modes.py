"""The edge_stages and chain dispatch modes without Ray or a process group: their names and
floors, which ranks Ray hands the chunk to and which must hold it (against the layout's own
coordinates, up to a 16,384-rank layout), their hops' plan, their price, and the driver's
check of every rank's answer (naming rank and key)."""

from __future__ import annotations

import pytest

from harness.job.dispatch import _Driver, _verify
from harness.job.dispatch_modes import DispatchMode, with_floors
from harness.job.spec import JobSpec
from harness.model.dispatch_prices import RayCostConf, price_mode
from harness.model.dispatch_ranks import holding_ranks, hop_plan, ray_ranks, rdt_plan
from harness.payload import generated
from strategies.core.cluster import ClusterConf, LinkConf
from strategies.core.layout import Layout
from strategies.core.plan import spec_of

RAY = RayCostConf(name="t", put_call_us=1000, put_gbytes_per_s=1.0, get_call_us=2000,
                  get_gbytes_per_s=0.5, call_us=300, call_per_actor_us=100)  # fmt: skip
TWO_PER_NODE = ClusterConf(name="two", gpus_per_node=2, inter=LinkConf(500, 0.125), cpu_cores=0)
SPEC = spec_of(generated.make("rl_rollout", 4, 64, 0, None))


def test_names_parse_and_each_family_gets_its_floor():
    for name in ("edge_stages", "edge_stages:raw", "chain", "chain:raw"):
        assert DispatchMode.parse(name).name == name
    assert DispatchMode.parse("chain:raw").raw and DispatchMode.parse("chain").strategy is None
    names = [m.name for m in with_floors(["edge_stages", "chain", "leader:header"])]
    assert names == ["edge_stages", "chain", "leader:header", "leader:floor", "edge_stages:raw",
                     "chain:raw"]  # fmt: skip
    with pytest.raises(ValueError, match="'chain:fast'.*expected 'leader:<strategy>'.*'chain'"):
        DispatchMode.parse("chain:fast")
    with pytest.raises(ValueError, match="named more than once"):
        with_floors(["edge_stages", "edge_stages"])


@pytest.mark.parametrize(
    "layout", [Layout(pp=4, tp=2, dp=2), Layout(pp=1, tp=2, cp=2), Layout(tp=8, cp=2, pp=8, dp=128)]
)
def test_who_gets_the_chunk_through_ray_and_who_holds_it(layout):
    coords = [layout.coords(r) for r in range(layout.world_size)]
    edge = [c["pp"] in (0, layout.pp - 1) for c in coords]
    first = [c["tp"] == 0 and c["cp"] == 0 for c in coords]
    edges = ray_ranks("edge_stages", layout)
    assert len(edges) == layout.dp
    assert sorted(r for rep in edges for r in rep) == [
        r for r in range(layout.world_size) if edge[r] and first[r]
    ]
    assert all(len(rep) == (2 if layout.pp > 1 else 1) for rep in edges)
    assert holding_ranks("edge_stages", layout) == [r for r in range(layout.world_size) if edge[r]]
    assert ray_ranks("chain", layout) == [[lead] for lead in layout.leaders()]
    assert holding_ranks("chain", layout) == list(range(layout.world_size))
    with pytest.raises(ValueError, match="expected one of"):
        ray_ranks("ring", layout)


def test_the_hops_plans_name_every_group():
    lay = Layout(pp=4, tp=2, dp=2)
    edge = hop_plan("edge_stages", lay, SPEC, raw=False)
    # Two edge stages × two replicas, each TP group sending the size then the pickle at once.
    assert len(edge.comms) == 8 and edge.steps == 2
    assert {c.ranks for c in edge.comms} == {(0, 1), (2, 3), (12, 13), (14, 15)}
    chain = hop_plan("chain", Layout(pp=4, tp=2), SPEC, raw=True)
    # Stage 0's TP group, then stage k -> k + 1 for each of the two pipelines.
    assert [c.ranks for c in chain.comms] == [(0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6),
                                              (5, 7)]  # fmt: skip
    assert [c.step for c in chain.comms] == [0, 1, 1, 2, 2, 3, 3]
    assert hop_plan("chain", Layout(), SPEC, raw=False).comms == []


def test_prices_cross_what_each_mode_sends_between_nodes():
    n = SPEC.tensor_bytes + SPEC.non_tensor_bytes
    lay = Layout(pp=2, tp=2)  # stage 0 on node 0, stage 1 on node 1
    edge = price_mode("edge_stages:raw", lay, SPEC, TWO_PER_NODE, RAY)
    # Ray pulls the object to rank 2's node once; each stage's broadcast stays on its node.
    assert edge.mode == "edge_stages:raw" and edge.cross_node_bytes == n
    chain = price_mode("chain:raw", lay, SPEC, TWO_PER_NODE, RAY)
    # Nothing crosses through Ray (the leader is on node 0); both stage-1 ranks are sent it.
    assert chain.cross_node_bytes == 2 * n and chain.broadcast_s > 0
    leader = price_mode("leader:floor", lay, SPEC, TWO_PER_NODE, RAY)
    assert (chain.put_s, chain.get_s, chain.transfer_s) == (
        leader.put_s, leader.get_s, leader.transfer_s)  # fmt: skip
    deep = price_mode("edge_stages", Layout(pp=4, tp=2), SPEC, TWO_PER_NODE, RAY)
    assert deep.cross_node_bytes == n  # node 3 (the last stage) only; nodes 1 and 2 get none
    with pytest.raises(ValueError, match="expected leader:<strategy>, or all_ranks"):
        price_mode("edge_stages:fast", lay, SPEC, TWO_PER_NODE, RAY)


def _answers(drv: _Driver, holders) -> list:
    meta = drv.global_batch.meta_info
    return [(0, (drv.expected[d], meta) if r in holders else None)
            for r, d in enumerate(drv.replica_of)]  # fmt: skip


def test_the_driver_checks_every_rank_that_must_hold_the_chunk_and_no_other():
    lay = Layout(pp=4)  # ranks 0..3 are the stages; 1 and 2 the middle ones
    drv = _Driver.build(JobSpec("", lay, dispatch="edge_stages", modes=("edge_stages",),
                                batch_size=2, seq_len=16))  # fmt: skip
    mode = DispatchMode.parse("edge_stages")
    assert drv.sources["edge_stages"] == {0, 3} and drv.holders["edge_stages"] == {0, 3}
    assert _verify(drv, mode, _answers(drv, {0, 3})) == []
    assert _verify(drv, mode, _answers(drv, {0, 1, 3})) == [
        "edge_stages: rank 1: holds data, but a middle pipeline stage gets none"
    ]
    assert _verify(drv, mode, _answers(drv, {0})) == [
        "edge_stages: rank 3: holds no chunk, expected chunk 0"
    ]
    out = _answers(drv, range(4))
    wrong = dict(drv.expected[0], keys=dict(drv.expected[0]["keys"]))
    wrong["keys"]["advantages"] = (*wrong["keys"]["advantages"][:2], "0" * 32)
    out[2] = (0, (wrong, drv.global_batch.meta_info))
    assert _verify(drv, DispatchMode.parse("chain"), out) == [
        "chain: rank 2: key 'advantages' values differ from the leader's"
    ]
    raw = [(0, drv.expected_raw[0]) for _ in range(4)]
    raw[1] = (0, "f" * 32)
    assert _verify(drv, DispatchMode.parse("chain:raw"), raw) == [
        "chain:raw: rank 1: received bytes differ from chunk 0"
    ]


def test_rdt_lends_from_each_leader_to_its_replica_one_receiver_after_another():
    """``rdt`` (Ray Direct Transport): Ray hands the leader the chunk, the leader sends each
    tensor to each other rank of its replica point to point, every replica at once; every rank
    holds it. Its floor sends the flat bytes as one tensor."""
    assert [m.name for m in with_floors(["rdt"])] == ["rdt", "rdt:raw"]
    assert DispatchMode.parse("rdt:raw").raw
    lay = Layout(tp=2, pp=2, dp=2)
    assert ray_ranks("rdt", lay) == [[lead] for lead in lay.leaders()]
    assert holding_ranks("rdt", lay) == list(range(lay.world_size))
    plan = rdt_plan(lay, SPEC, raw=False)
    leaves = len(SPEC.leaf_nbytes()[0])
    assert len(plan.comms) == lay.dp * (lay.replica_size - 1) * leaves
    assert plan.steps == (lay.replica_size - 1) * leaves  # one receiver, one leaf at a time
    assert {c.ranks for c in plan.comms} == {
        (rep[0], r) for rep in lay.replica_groups() for r in rep[1:]
    }
    assert sum(c.nbytes for c in plan.comms) == lay.dp * (lay.replica_size - 1) * SPEC.tensor_bytes
    raw = rdt_plan(lay, SPEC, raw=True)
    assert {c.nbytes for c in raw.comms} == {SPEC.tensor_bytes + SPEC.non_tensor_bytes}
    rdt = price_mode("rdt", Layout(pp=2, tp=2), SPEC, TWO_PER_NODE, RAY)
    leader = price_mode("leader:header", Layout(pp=2, tp=2), SPEC, TWO_PER_NODE, RAY)
    # The same way to the leader; then stage 1's two ranks are sent every tensor across nodes.
    assert (rdt.put_s, rdt.transfer_s) == (leader.put_s, leader.transfer_s)
    assert rdt.cross_node_bytes == 2 * SPEC.tensor_bytes and rdt.broadcast_s > 0


def test_cgraph_carries_each_chunk_through_its_leader_with_no_task_and_no_store():
    """``cgraph`` (a Ray Compiled Graph): the chunk through the input channel to the leader,
    through the leader's output channel to every rank; no call round, nothing crosses a node."""
    assert [m.name for m in with_floors(["cgraph"])] == ["cgraph", "cgraph:raw"]
    lay = Layout(tp=2, pp=2)
    assert ray_ranks("cgraph", lay) == [[0]] and holding_ranks("cgraph", lay) == [0, 1, 2, 3]
    n = SPEC.tensor_bytes + SPEC.non_tensor_bytes
    cost = price_mode("cgraph", lay, SPEC, TWO_PER_NODE, RAY)
    assert cost.call_s == 0 and cost.transfer_s == 0 and cost.cross_node_bytes == 0
    assert cost.put_s == pytest.approx(2 * RAY.put_s(n, False))  # the driver's, the leader's
    raw = price_mode("cgraph:raw", lay, SPEC, TWO_PER_NODE, RAY)
    assert raw.mode == "cgraph:raw" and raw.total_s < cost.total_s
