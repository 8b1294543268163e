"""Tier 2 (real gloo worlds): shm's early signal on one node. The leader signals once the header
and the non-tensor blob are in, copies the leaves, then completes the message: where its node
has a core per rank, by writing its completion word, which the receivers poll (no second
wake-up on a socket, ``RingReader.wait_complete``); elsewhere by a socket message. Every call is
bit-exact on every rank either way, a leader failure after the early signal reaches every
reader (not a timeout), and a host with fewer cores than ranks (this one: 4 ranks) polls only
where a test forces it (``forced_polls``).
"""

from __future__ import annotations

import gc
import platform

import numpy as np
import pytest
import torch
from batchgen import batch_problems
from tensordict import TensorDict

import strategies
import strategies.core.node_channel as node_channel
from strategies.core.layout import Layout
from strategies.core.node_signals import POLL_STORE_ORDER, polls

pytestmark = pytest.mark.world

LAYOUT = Layout(tp=2, pp=2)
SIZES = (1, 4, 64, 1, 300, 2)
"""Rows per call: messages from a page to a few hundred KiB, the structure changing with them."""
HANG_S = 60.0
"""A fault test's world reports a rank silent this long as hung. No test reads a clock: a reader
that learnt of the leader's failure raises its text (``LeaderFailed``); one that would wait for
its channel's timeout (the replica group's, far longer) fails the test as hung instead."""


def sized(seed: int, b: int) -> strategies.DataProto:
    gen = torch.Generator().manual_seed(seed)
    td = TensorDict({"ids": torch.randint(0, 9, (b, 257), generator=gen)}, [b])
    texts = np.array([f"p {seed}-{i}" * (i % 7) for i in range(b)], dtype=object)
    return strategies.DataProto(td, {"prompt": texts}, {strategies.NON_TENSOR_FLAG: True})


def forced_polls(force: bool) -> None:
    """Make this rank's node leader have its readers poll (``force``), whatever the host's
    cores, or restore the host's own rule (a world's ranks outlive the test)."""
    node_channel.polls = (lambda poll_us, ranks: bool(poll_us)) if force else polls


def poll_job(ctx, force: bool):
    """``SIZES`` twice on shm (polling forced when ``force``); per call "exact" or what went
    wrong, this rank's count of completions read from the word, and its ``poll_s``."""
    forced_polls(force)
    try:
        strategy = strategies.get("shm", ctx.groups_for(LAYOUT))
    finally:
        forced_polls(False)
    outcomes = []
    for seed, b in enumerate(SIZES * 2):
        want = sized(seed, b)
        entry = sized(seed, b) if strategy.groups.is_leader else want.entry_state(False)
        try:
            out = strategy.get_data_input(entry)
            problems = batch_problems(want, out, strategy.groups.is_leader, f"call {seed}")
            outcomes.append("; ".join(problems) or "exact")
        except Exception as exc:  # noqa: BLE001 -- the test reads every rank's outcome
            outcomes.append(f"{type(exc).__name__}: {exc}")
        out = entry = None
        gc.collect()
        torch.distributed.barrier()
    return outcomes, strategy.channel.polled_count, strategy.channel.poll_s


FORCEABLE = pytest.mark.skipif(
    platform.machine() not in POLL_STORE_ORDER,
    reason="the completion word is read only on machines whose stores keep their order (x86)",
)


@FORCEABLE
def test_a_receiver_that_polls_goes_on_at_the_word_and_every_call_is_exact(world4):
    """Polling (forced): every receiver takes every completion from the word (it polls until
    the word or its socket says something: no clock decides), and every call is exact on
    every rank."""
    results = world4.run(poll_job, True, timeout_s=60)
    calls = len(SIZES) * 2
    for rank, (outcomes, polled, _) in enumerate(results):
        assert outcomes == ["exact"] * calls, (rank, outcomes)
        assert polled == (calls if rank else 0), (rank, polled)


def test_a_node_polls_only_where_each_of_its_ranks_has_a_core(world4):
    """Unforced: the node leader's rule decides (on this 2-core host with 4 ranks: no reader
    polls, a poll would take the core a rank needs), and every call is exact either way."""
    results = world4.run(poll_job, False, timeout_s=60)
    rule = polls(2000, 4)
    for rank, (outcomes, polled, poll_s) in enumerate(results):
        assert outcomes == ["exact"] * (len(SIZES) * 2), (rank, outcomes)
        if rank:
            assert (poll_s is not None) == rule, (rank, poll_s, rule)
            assert (polled > 0) == rule, (rank, polled, rule)


def early_fault_job(ctx, force: bool):
    """Three calls; in the second the leader's copy of the leaves raises after the early
    signal went out. The outcome of each call on this rank; polling forced when ``force``."""
    groups = ctx.groups_for(LAYOUT)
    forced_polls(force)
    try:
        strategy = strategies.get("shm", groups)
    finally:
        forced_polls(False)
    return copy_fault_calls(strategy, fail_call=1)


def copy_fault_calls(strategy, fail_call: int) -> list[str]:
    """Three calls on ``strategy``; in call ``fail_call`` every copy the leader makes raises.
    Per call on this rank: "exact", what differs, or the error raised (with its notes)."""
    groups = strategy.groups
    outcomes = []
    real = torch._foreach_copy_

    def faulty(*args, **kwargs):
        raise RuntimeError("injected copy failure")

    for seed in range(3):
        want = sized(seed, 4)
        entry = sized(seed, 4) if groups.is_leader else want.entry_state(False)
        if seed == fail_call and groups.is_leader:
            torch._foreach_copy_ = faulty
        try:
            out = strategy.get_data_input(entry)
            problems = batch_problems(want, out, groups.is_leader, f"call {seed}")
            outcomes.append("; ".join(problems) or "exact")
            del out
        except Exception as exc:  # noqa: BLE001 -- the test looks at every rank's outcome
            notes = " | ".join(getattr(exc, "__notes__", ()))
            outcomes.append(f"{type(exc).__name__}: {exc} | {notes}")
        finally:
            torch._foreach_copy_ = real
        torch.distributed.barrier()
    return outcomes


@pytest.mark.parametrize(
    "force", [False, pytest.param(True, marks=FORCEABLE)], ids=["socket", "polled"]
)
def test_a_leader_that_fails_after_its_early_signal_reaches_every_reader(world4, force):
    """The readers took the early signal and decode the blob; the leader's copy of the leaves
    fails: every reader raises the leader's error (not a timeout; a reader polling the
    completion word stops at the abort in its socket), and the next call is exact everywhere
    (the channel stayed in step)."""
    results = world4.run(early_fault_job, force, timeout_s=HANG_S)
    leader = results[0]
    assert leader[0] == "exact" and "injected copy failure" in leader[1], leader
    for rank, outcomes in enumerate(results):
        assert outcomes[0] == "exact" and outcomes[2] == "exact", (rank, outcomes)
        if rank:
            assert outcomes[1].startswith("LeaderFailed: "), (rank, outcomes)
            assert "injected copy failure" in outcomes[1], (rank, outcomes)


def unshippable_job(ctx, early: int | None, fail_call: int):
    """Three calls on shm (``early_min_bytes=early``); in call ``fail_call`` every copy the
    leader makes raises, so the failure batch it ships in its batch's place cannot be copied
    either. The outcome of each call on this rank."""
    strategy = strategies.get("shm", ctx.groups_for(LAYOUT), early_min_bytes=early)
    return copy_fault_calls(strategy, fail_call)


@pytest.mark.parametrize("fail_call", [0, 1], ids=["first-call", "later-call"])
@pytest.mark.parametrize("early", [None, 0], ids=["whole", "early"])
def test_a_failure_the_leader_cannot_ship_reaches_every_reader(world4, early, fail_call):
    """The leader's copies fail for a whole call, the failure batch's too: a failure that is
    not shipped leaves no reader waiting (for the gloo timeout): each raises the leader's
    error, told through its socket (the channel is then closed, and every later call
    says so on every rank) or, signalled early, by the abort of the message it was reading
    (the channel stays in step: the next call is exact)."""
    results = world4.run(unshippable_job, early, fail_call, timeout_s=HANG_S)
    leader = results[0]
    assert all(o == "exact" for o in leader[:fail_call]), leader
    assert "injected copy failure" in leader[fail_call], leader
    abandoned = "no receiver is left waiting" in leader[fail_call]
    for rank, outcomes in enumerate(results):
        assert all(o == "exact" for o in outcomes[:fail_call]), (rank, outcomes)
        if rank:
            assert outcomes[fail_call].startswith("LeaderFailed: "), (rank, outcomes)
            assert "injected copy failure" in outcomes[fail_call], (rank, outcomes)
        for later in outcomes[fail_call + 1 :]:
            if abandoned:
                assert "closed on an earlier call" in later, (rank, outcomes)
                assert "could not be shipped: RuntimeError: injected copy failure" in later
            else:
                assert later == "exact", (rank, outcomes)
