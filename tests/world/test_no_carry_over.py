"""Tier 3 (real gloo world): no carry-over between calls. A stream that alternates a large and
a small batch arrives bit for bit on every rank, and a small call after a large one posts a
small first broadcast (sizes read from the trace, never timed).
"""

from __future__ import annotations

import pytest
from batchgen import batch_problems

import strategies
from harness.run import payloads
from strategies.core.layout import Layout
from strategies.core.plan import spec_of
from strategies.core.trace import Recorder

LAYOUT = Layout(tp=2, pp=2)
LARGE_B, SMALL_B, SEQ_LEN = 200, 3, 512  # rl_rollout: 4.5 MiB and 69 KiB
SIZES = [SMALL_B, LARGE_B, SMALL_B, LARGE_B, SMALL_B, LARGE_B, SMALL_B]
"""Small first: a first call has no history, and a wire that has seen only one size (a stream
settled on it) posts that size once for a small batch (strategies/core/wire.py)."""
STRATEGIES = ("header", "flat", "auto", "scatter_allgather", "pp_first", "direct")


def alternating_job(ctx, name: str) -> dict:
    """Every call with fresh data; per call, this rank's problems and first broadcast."""
    groups = ctx.groups_for(LAYOUT)
    strategy = strategies.get(name, groups)
    problems, first_bytes = [], []
    for call, b in enumerate(SIZES):
        expected = payloads.make("rl_rollout", b, SEQ_LEN, seed=call)
        sent = payloads.make("rl_rollout", b, SEQ_LEN, seed=call) if groups.is_leader else expected
        with Recorder() as rec:
            out = strategy.get_data_input(sent.entry_state(groups.is_leader))
        where = f"{name}: rank {ctx.rank} call {call} (B={b})"
        problems += batch_problems(expected, out, groups.is_leader, where)
        first_bytes.append(next(c.nbytes for c in rec.comms if c.kind == "broadcast"))
    return {"rank": ctx.rank, "problems": problems, "first_bytes": first_bytes}


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_small_call_after_a_large_one_posts_a_small_first_message(world4, name):
    results = world4.run(alternating_job, name)
    assert [p for r in results for p in r["problems"]] == []
    small_bytes = spec_of(payloads.make("rl_rollout", SMALL_B, SEQ_LEN, seed=0)).message_bytes
    for r in results:
        for call, b in enumerate(SIZES):
            if call and b == SMALL_B:  # each follows a large call
                assert r["first_bytes"][call] <= 2 * small_bytes, (r["rank"], call, r)
