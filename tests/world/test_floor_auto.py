"""Tier 2 (real gloo worlds): every raw method of the floor moves the leader's bytes exactly
and as its plan says; ``auto`` ships batches exactly, every rank agrees on its choice, and its
steady-state collectives are its chosen strategy's plan.
"""

from __future__ import annotations

import pytest
import torch

import strategies
from harness.job.verification import digest
from harness.payload import generated
from strategies.auto import choose, layout_of_groups
from strategies.core.layout import SEED_ORDER, Layout
from strategies.core.plan import spec_of
from strategies.core.trace import Recorder
from strategies.core.wire import RECENT_CALLS
from strategies.floor import Floor

pytestmark = pytest.mark.world

TP2PP2 = Layout(tp=2, pp=2)
DP2 = Layout(dp=2, pp=2, tp=2)
DP2_SEED = Layout(dp=2, pp=2, tp=2, order=SEED_ORDER)


def _floor_job(ctx, layout: Layout, batch_size: int) -> dict:
    groups = ctx.groups_for(layout)
    full = generated.make("rl_rollout", batch_size, 256, seed=groups.leader)
    entry = full.entry_state(groups.is_leader)
    out = {}
    for label, options in Floor.variants(layout).items():
        floor = strategies.get("floor", groups, **options)
        floor.prepare(entry)
        floor.get_data_input(entry)
        with Recorder() as rec:
            floor.get_data_input(entry)
        sent = floor.received if groups.is_leader else None
        out[label] = {
            "comms": [(c.kind, c.ranks, c.root, c.nbytes) for c in rec.comms],
            "received": floor.received.clone(),
            "sent": sent,
        }
    return {"rank": ctx.rank, "leader": groups.leader, "spec": spec_of(full), "out": out}


@pytest.mark.parametrize("layout", [TP2PP2, DP2_SEED], ids=lambda x: x.describe())
@pytest.mark.parametrize("batch_size", [1, 20])  # below one chunk page; several pages per chunk
def test_every_floor_method_is_exact_and_planned(request, layout, batch_size):
    world = request.getfixturevalue("world4" if layout.world_size == 4 else "world8")
    results = world.run(_floor_job, layout, batch_size)
    labels = set(Floor.variants(layout))
    assert {
        "floor",
        "floor:chunks2",
        "floor:chunks4",
        "floor:seed_hops",
        "floor:pp_first",
        "floor:shm",
    } == labels
    sent = {r["rank"]: r["out"] for r in results}
    for r in results:
        for label, got in r["out"].items():
            expected = sent[r["leader"]][label]["sent"]
            assert torch.equal(got["received"], expected), (label, r["rank"])
            options = Floor.variants(layout)[label]
            plan = Floor.plan(layout, r["spec"], **options)
            want = [(c.kind, c.ranks, c.root, c.nbytes) for c in plan.for_rank(r["rank"])]
            assert got["comms"] == want, (label, r["rank"])


def test_floor_refuses_an_unknown_method():
    with pytest.raises(
        ValueError, match="option 'method' must be one of 'one', 'chunks'.*got 'ring'"
    ):
        Floor(None, method="ring")
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        Floor(None, method="chunks", chunks=0)


def _auto_job(ctx, layout: Layout, sizes: list[int], flag: bool) -> dict:
    groups = ctx.groups_for(layout)
    auto = strategies.get("auto", groups)
    derived = layout_of_groups(groups)
    choices, digests, comms, served, held = [], [], [], [], []
    for batch_size in sizes:
        full = generated.make("rl_rollout", batch_size, 256, seed=7, broadcast_non_tensor=flag)
        with Recorder() as rec:
            out = auto.get_data_input(full.entry_state(groups.is_leader))
        digests.append(digest(out, flag))
        comms.append([(c.kind, c.ranks, c.root, c.nbytes) for c in rec.comms])
        choices.append(auto.choice)
        served.append(auto.served)
        # A candidate other than the next call's keeps no pack buffer (``set_aside``).
        held.append(sorted(
            n for n, s in auto.built.items()
            if n != auto.choice and getattr(getattr(s, "packer", None), "buffer", None) is not None
        ))  # fmt: skip
    return {
        "rank": ctx.rank,
        "choices": choices,
        "digests": digests,
        "comms": comms,
        "served": served,
        "held": held,
        "specs": [spec_of(generated.make("rl_rollout", b, 256, 7, flag)) for b in sizes],
        "groups_match": [
            derived.group_of("tp-cp", ctx.rank) == list(groups.tp_cp_ranks),
            derived.group_of("pp", ctx.rank) == list(groups.pp_ranks),
        ],
    }


@pytest.mark.parametrize("layout", [TP2PP2, DP2, DP2_SEED], ids=lambda x: x.describe())
@pytest.mark.parametrize("flag", [False, True], ids=["tensors_only", "non_tensor"])
def test_auto_is_exact_agrees_and_follows_its_choice(request, layout, flag):
    world = request.getfixturevalue("world4" if layout.world_size == 4 else "world8")
    # A shape change serves one call with the previous choice; the wire's first message is
    # steady once the last RECENT_CALLS calls were all of this shape.
    sizes = [2, 2] + [40] * (RECENT_CALLS + 2) + [1]
    results = world.run(_auto_job, layout, sizes, flag)
    by_rank = {r["rank"]: r for r in results}
    for r in results:
        assert all(r["groups_match"]), r["rank"]
        leader = by_rank[layout.group_of("tp-cp-pp", r["rank"])[0]]
        assert r["digests"] == leader["digests"], r["rank"]
        assert r["choices"] == results[0]["choices"]  # every rank, every call: one decision
        assert r["held"] == [[]] * len(sizes), r["rank"]
    assert len(set(results[0]["served"])) > 1, results[0]["served"]  # a switch was checked
    # Call i + 1 is served by the choice made from call i's batch; in steady state (the last
    # RECENT_CALLS calls of this shape) its collectives are that strategy's plan.
    for i in (RECENT_CALLS + 2, RECENT_CALLS + 3):
        spec = results[0]["specs"][i]
        chosen = results[0]["choices"][i - 1]
        assert chosen == choose(layout, spec)
        plan = strategies.get_class("auto").plan(layout, spec)
        assert plan.strategy == chosen
        for r in results:
            want = [(c.kind, c.ranks, c.root, c.nbytes) for c in plan.for_rank(r["rank"])]
            assert r["comms"][i] == want, (i, r["rank"])
