"""Tier 3 (real gloo world): no carry-over between calls. A stream that alternates a large and
a small batch arrives bit for bit on every rank, and a small call after a large one posts a
small first broadcast (sizes read from the trace, never timed).
"""

from __future__ import annotations

import pytest
from batchgen import batch_problems

import strategies
from harness.payload import generated
from strategies.auto import CANDIDATES
from strategies.core.layout import Layout
from strategies.core.plan import spec_of
from strategies.core.trace import Recorder

LAYOUT = Layout(tp=2, pp=2)
LARGE_B, SMALL_B, SEQ_LEN = 200, 3, 512  # rl_rollout: 4.5 MiB and 69 KiB
SIZES = [SMALL_B, LARGE_B, SMALL_B, LARGE_B, SMALL_B, LARGE_B, SMALL_B]
"""Small first: a first call has no history, and a wire that has seen only one size (a stream
settled on it) posts that size once for a small batch (strategies/core/wire.py)."""
STRATEGIES = ("header", "flat", "auto", "scatter_allgather", "pp_first", "direct", "shm")
"""shm posts no broadcast at all: its first message counts as 0 bytes."""
OPTIONS = {"auto": {"candidates": [c for c in CANDIDATES if c != "shm"]}}
"""auto among the strategies on the wire (on one host it would choose shm): its choices share
one ``Wire``, the state a call can inherit from the call before."""


def alternating_job(ctx, name: str) -> dict:
    """Every call with fresh data; per call, this rank's problems and first broadcast."""
    groups = ctx.groups_for(LAYOUT)
    strategy = strategies.get(name, groups, **OPTIONS.get(name, {}))
    problems, first_bytes = [], []
    for call, b in enumerate(SIZES):
        expected = generated.make("rl_rollout", b, SEQ_LEN, seed=call)
        sent = generated.make("rl_rollout", b, SEQ_LEN, seed=call) if groups.is_leader else expected
        with Recorder() as rec:
            out = strategy.get_data_input(sent.entry_state(groups.is_leader))
        where = f"{name}: rank {ctx.rank} call {call} (B={b})"
        problems += batch_problems(expected, out, groups.is_leader, where)
        first_bytes.append(next((c.nbytes for c in rec.comms if c.kind == "broadcast"), 0))
    return {"rank": ctx.rank, "problems": problems, "first_bytes": first_bytes}


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_small_call_after_a_large_one_posts_a_small_first_message(world4, name):
    results = world4.run(alternating_job, name)
    assert [p for r in results for p in r["problems"]] == []
    small_bytes = spec_of(generated.make("rl_rollout", SMALL_B, SEQ_LEN, seed=0)).message_bytes
    for r in results:
        for call, b in enumerate(SIZES):
            if call and b == SMALL_B:  # each follows a large call
                assert r["first_bytes"][call] <= 2 * small_bytes, (r["rank"], call, r)


def auto_served(ctx, cluster: str, sizes: list[int]) -> dict:
    """Per call, the candidate that served it and this rank's problems."""
    groups = ctx.groups_for(LAYOUT)
    auto = strategies.get("auto", groups, cluster=cluster, **OPTIONS["auto"])
    problems, served = [], []
    for call, b in enumerate(sizes):
        expected = generated.make("rl_rollout", b, SEQ_LEN, seed=call)
        out = auto.get_data_input(expected.entry_state(groups.is_leader))
        problems += batch_problems(expected, out, groups.is_leader, f"auto call {call} (B={b})")
        served.append(auto.served)
    return {"rank": ctx.rank, "problems": problems, "served": served}


def test_auto_serves_each_call_of_a_repeating_pattern_with_that_shapes_choice(world4):
    """Alternating shapes whose choices differ (on the emulated rails preset: flat for 2 rows,
    scatter_allgather for 128): once each shape has been followed once (from the second call
    of the second period on), each call is served by the choice for its own shape, on every
    rank alike, not by the previous call's (the old behaviour: wrong on every call)."""
    from strategies.auto import choose

    sizes = [2, 128] * 4
    wire = tuple(OPTIONS["auto"]["candidates"])  # shm's stripes win both shapes on rails
    own = {b: choose(LAYOUT, spec_of(generated.make("rl_rollout", b, SEQ_LEN, 0)), "emulated_rails",
                     wire) for b in set(sizes)}  # fmt: skip
    assert own[2] != own[128], own  # the preset must tell them apart for this to test anything
    results = world4.run(auto_served, "emulated_rails", sizes)
    assert [p for r in results for p in r["problems"]] == []
    assert len({tuple(r["served"]) for r in results}) == 1, "ranks must agree on every call"
    served = results[0]["served"]
    assert served[3:] == [own[b] for b in sizes[3:]], served
