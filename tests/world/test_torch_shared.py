"""Tier 2 (real gloo worlds), and a unit check or two: what ``torch_shared`` promises beyond the
contract every strategy's tests check. Receivers' tensors are views of shared memory, not
copies; the leader's batch is never touched and pays a fresh shared copy each call; ranks that
do not share an authkey get the leader's; a replica across nodes is refused on every rank.
"""

from __future__ import annotations

import os
from dataclasses import replace
from multiprocessing import current_process

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import strategies
from strategies.core.contract import Unsupported
from strategies.core.layout import Layout
from strategies.core.plan import spec_of
from strategies.core.process_groups import ProcessGroups
from strategies.core.trace import Recorder
from strategies.torch_shared import _SHARER, TorchShared, refusal, start_sharer, waiting

LAYOUT = Layout(tp=2, pp=2)


def batch(seed: int, b: int = 4) -> strategies.DataProto:
    gen = torch.Generator().manual_seed(seed)
    td = TensorDict(
        {
            "x": torch.randn(b, 300, generator=gen),
            "t": torch.randn(7, b, generator=gen).t(),  # a transposed view
            "nested": {"ids": torch.randint(0, 50_000, (b, 17), generator=gen)},
        },
        [b],
    )
    texts = np.array([f"prompt {seed}-{i}" for i in range(b)], dtype=object)
    return strategies.DataProto(td, {"prompt": texts}, {strategies.NON_TENSOR_FLAG: True})


def shared_job(ctx, calls: int, own_authkey: bool):
    """``calls`` calls of the same batch object (as the harness hands it). ``own_authkey``:
    each rank draws its own authkey first, as under torchrun. Returns, per rank: calls exact,
    whether every received tensor is shared, the leader's batch untouched (storages not
    shared, values the same), copied bytes per call, and this rank's authkey."""
    if own_authkey:
        current_process().authkey = os.urandom(32)
    groups = ctx.groups_for(LAYOUT)
    strategy = strategies.get("torch_shared", groups)
    want = batch(1)
    mine = batch(1) if groups.is_leader else None
    exact = shared = 0
    copied = []
    for _ in range(calls):
        entry = mine if groups.is_leader else want.entry_state(False)
        with Recorder() as rec:
            out = strategy.get_data_input(entry)
        copied.append(rec.work["copied_bytes"])
        keys = want.batch.keys(include_nested=True, leaves_only=True)
        exact += all(torch.equal(out.batch.get(k), want.batch.get(k)) for k in keys) and list(
            out.non_tensor_batch["prompt"]
        ) == list(want.non_tensor_batch["prompt"])
        shared += all(out.batch.get(k).is_shared() for k in keys)
        torch.distributed.barrier()
    untouched = None
    if groups.is_leader:
        keys = want.batch.keys(include_nested=True, leaves_only=True)
        untouched = not any(mine.batch.get(k).is_shared() for k in keys) and all(
            torch.equal(mine.batch.get(k), want.batch.get(k)) for k in keys
        )
    return {
        "leader": groups.is_leader,
        "exact": exact,
        "shared": shared,
        "untouched": untouched,
        "copied": copied,
        "payload": spec_of(want).tensor_bytes,
        "authkey": start_sharer() if groups.is_leader else bytes(current_process().authkey),
        # While the receivers hold their batches: torch's files are unlinked at birth, and
        # the sharer listens on an abstract Unix address (no socket file under /tmp).
        "named": [n for n in os.listdir("/dev/shm") if n.startswith("torch_")],
        "address": _SHARER._address if groups.is_leader else None,
    }


@pytest.mark.world
@pytest.mark.parametrize("own_authkey", [True, False], ids=["own_keys", "forked_key"])
def test_receivers_view_shared_memory_and_the_leader_pays_a_fresh_copy(world4, own_authkey):
    results = world4.run(shared_job, 3, own_authkey, what="torch_shared")
    leader = next(r for r in results if r["leader"])
    for r in results:
        assert r["exact"] == 3, r
        assert r["authkey"] == leader["authkey"], "every rank holds the leader sharer's authkey"
        if not r["leader"]:
            assert r["shared"] == 3, "a receiver's tensors are views of shared memory"
    assert leader["named"] == [], "a shared storage is listed in /dev/shm"
    assert leader["address"][:1] in ("\0", b"\0"), leader["address"]  # bytes: abstract
    assert leader["untouched"], "the caller's batch was moved into shared memory or changed"
    # Every call copies the payload once into fresh shared storages, the same batch or not.
    assert leader["copied"] == [leader["payload"]] * 3


def fds_job(ctx, calls: int):
    """Open descriptors on this rank after ``calls`` calls with nothing held, twice over: a
    call leaves no descriptor behind (the sharer closes each once its receiver took it)."""
    groups = ctx.groups_for(LAYOUT)
    strategy = strategies.get("torch_shared", groups)
    counts = []
    for _ in range(2):
        for seed in range(calls):
            want = batch(seed)
            out = strategy.get_data_input(want if groups.is_leader else want.entry_state(False))
            del out
        torch.distributed.barrier()
        counts.append(len(os.listdir("/proc/self/fd")))
    torch.distributed.barrier()  # every receiver took its descriptors before the leader looks
    waiting_fds = waiting() if groups.is_leader else 0
    return counts, waiting_fds


@pytest.mark.world
def test_calls_leave_no_descriptor_behind(world4):
    for counts, untaken in world4.run(fds_job, 5, what="torch_shared fds"):
        assert counts[1] <= counts[0], counts
        assert untaken == 0, "a descriptor is still waiting in the leader's resource sharer"


def groups_of(replica: tuple[int, ...], node_of: tuple[int, ...], rank: int = 0) -> ProcessGroups:
    g = ProcessGroups(None, None, None, replica, replica, replica, 0, rank, rank=rank)
    return replace(g, node_of=node_of)


def test_a_replica_across_nodes_is_refused_naming_its_ranks_and_shm():
    why = refusal(groups_of((0, 1, 2, 3), (0, 0, 1, 1)))
    assert why is not None and "[0, 1] | [2, 3]" in why and "use shm" in why, why
    with pytest.raises(Unsupported, match="span 2 nodes"):
        TorchShared(groups_of((0, 1, 2, 3), (0, 0, 1, 1), rank=2))


def test_a_replica_on_one_node_is_served():
    assert refusal(groups_of((0, 1, 2, 3), (0, 0, 0, 0))) is None
    assert refusal(groups_of((0, 1), ())) is None
