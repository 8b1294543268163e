"""Tier 2 (real gloo worlds): shm's receivers poll the completion word of a message signalled
early instead of waiting for a second signal on their socket (``RingReader.wait_complete``).
Every call stays bit-exact on every rank whether a receiver polled, and a host with fewer cores
than ranks (this one: 4 ranks) never polls unless a job forces it, as these tests do.
"""

from __future__ import annotations

import gc
import types

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import strategies
from strategies.core.layout import Layout
from strategies.core.node_channel import ranks_on_node
from strategies.core.node_signals import check_poll_option, polls

pytestmark = pytest.mark.world

LAYOUT = Layout(tp=2, pp=2)
SIZES = (1, 4, 64, 1, 300, 2)
"""Rows per call: messages from a page to a few hundred KiB, the structure changing with them."""


def sized(seed: int, b: int) -> strategies.DataProto:
    gen = torch.Generator().manual_seed(seed)
    td = TensorDict({"ids": torch.randint(0, 9, (b, 257), generator=gen)}, [b])
    texts = np.array([f"p {seed}-{i}" * (i % 7) for i in range(b)], dtype=object)
    return strategies.DataProto(td, {"prompt": texts}, {strategies.NON_TENSOR_FLAG: True})


def poll_job(ctx, poll_s: float | None):
    """``SIZES`` twice on shm (``poll_s`` forced on every rank when given); per call "exact" or
    what went wrong, this rank's count of polled completions, and whether it polls unforced."""
    strategy = strategies.get("shm", ctx.groups_for(LAYOUT))
    unforced = strategy.channel.poll_s
    if poll_s is not None:
        strategy.channel.poll_s = poll_s
    outcomes = []
    for seed, b in enumerate(SIZES * 2):
        want = sized(seed, b)
        entry = sized(seed, b) if strategy.groups.is_leader else want.entry_state(False)
        try:
            out = strategy.get_data_input(entry)
            exact = all(torch.equal(out.batch[k], want.batch[k]) for k in want.batch.keys())
            exact = exact and list(out.non_tensor_batch["prompt"]) == list(
                want.non_tensor_batch["prompt"]
            )
            outcomes.append("exact" if exact else "wrong")
        except Exception as exc:  # noqa: BLE001 -- the test reads every rank's outcome
            outcomes.append(f"{type(exc).__name__}: {exc}")
        out = entry = None
        gc.collect()
        torch.distributed.barrier()
    return outcomes, strategy.channel.polled_count, unforced


def test_a_receiver_that_polls_goes_on_at_the_word_and_every_call_is_exact(world4):
    """Forced to poll (for as long as it takes: the word or the socket ends it, not a clock),
    every receiver takes every completion from the word, and the completions left in its
    socket are skipped: every call is exact on every rank."""
    results = world4.run(poll_job, 60.0, timeout_s=60)
    calls = len(SIZES) * 2
    for rank, (outcomes, polled, _) in enumerate(results):
        assert outcomes == ["exact"] * calls, (rank, outcomes)
        assert polled == (calls if rank else 0), (rank, polled)


def test_a_node_with_fewer_cores_than_ranks_does_not_poll(world4):
    """Unforced, on a host with fewer cores than the world's 4 ranks: no receiver polls (a
    poll would take the core a rank needs), and the socket's completions keep every call exact."""
    results = world4.run(poll_job, None, timeout_s=60)
    for rank, (outcomes, polled, unforced) in enumerate(results):
        assert outcomes == ["exact"] * (len(SIZES) * 2), (rank, outcomes)
        if not polls(2000, 4):
            assert unforced is None and polled == 0, (rank, unforced, polled)


@pytest.mark.parametrize("value", ["2ms", -1, 1.5, True], ids=repr)
def test_a_poll_option_that_is_not_microseconds_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"shm: poll_us must be microseconds .* got "):
        check_poll_option(value)


def test_polling_needs_a_core_per_rank_and_a_time():
    assert not polls(None, 1) and not polls(0, 1)
    assert not polls(2000, 1 << 20)  # more ranks than any host has cores


def test_ranks_on_node_counts_the_world_on_this_node():
    groups = types.SimpleNamespace(rank=2, replica_ranks=(0, 1, 2, 3), node_of=(0, 0, 1, 1, 1))
    assert ranks_on_node(groups) == 3
