"""Tier 2 (real gloo worlds): the shm leader's plan per structure. A batch whose structure and
blob room its slot packed before is copied and signalled with nothing else (``Shm._replay``),
and every call is bit-exact on every rank whatever changes between calls: the values, the
prompts, a blob past its room, a second structure in turn, a leader failure in the middle.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import strategies
from strategies.core.layout import Layout

pytestmark = pytest.mark.world

LAYOUT = Layout(tp=2, pp=2)


def same(out, want) -> bool:
    return all(torch.equal(out.batch[k], want.batch[k]) for k in want.batch.keys()) and list(
        out.non_tensor_batch["prompt"]
    ) == list(want.non_tensor_batch["prompt"])


def flat(seed: int, keys=("ids", "mask"), b: int = 4, prompt=None) -> strategies.DataProto:
    """A flat batch (verl's and ROLL's kind) of ``keys``; ``prompt`` replaces the prompts."""
    gen = torch.Generator().manual_seed(seed)
    td = TensorDict({k: torch.randint(0, 9, (b, 33), generator=gen) for k in keys}, [b])
    texts = np.array([f"p {seed}-{i}" for i in range(b)], dtype=object)
    if prompt is not None:
        texts[0] = prompt
    return strategies.DataProto(td, {"prompt": texts}, {strategies.NON_TENSOR_FLAG: True})


def unpicklable():
    return lambda: 0  # a local function: pickle refuses it


REPLAY_PLAN = (
    [("same", s, None) for s in range(9)]  # one structure: replayed once the ring is warm
    + [("same", 9, "long " * 200)]  # a blob past its room: packed anew
    + [("same", 10, "unpicklable")]  # the leader fails in its plan: every rank hears it
    + [("same", s, None) for s in range(11, 17)]
    + [("alt" if s % 2 else "same", s, None) for s in range(17, 29)]  # two, in turn
)


def replay_job(ctx, options: dict):
    """``REPLAY_PLAN`` on shm; per call "exact", "wrong" or the error, and the leader's count
    of replayed calls."""
    strategy = strategies.get("shm", ctx.groups_for(LAYOUT), **options)
    outcomes = []
    for kind, seed, prompt in REPLAY_PLAN:
        keys = ("ids", "pos") if kind == "alt" else ("ids", "mask")
        text = unpicklable() if prompt == "unpicklable" else prompt
        want = flat(seed, keys, prompt=text)
        entry = (
            flat(seed, keys, prompt=text) if strategy.groups.is_leader else want.entry_state(False)
        )
        try:
            out = strategy.get_data_input(entry)
            outcomes.append("exact" if same(out, want) else "wrong")
        except Exception as exc:  # noqa: BLE001 -- the test reads every rank's outcome
            outcomes.append(f"{type(exc).__name__}: {exc}")
        # A receiver's entry is its batch: both go, so its views of the slot are released
        # before the leader's next turn (the barrier) and the ring's slots turn in order.
        out = entry = None
        gc.collect()
        torch.distributed.barrier()
    return outcomes, strategy.replayed


@pytest.mark.parametrize("options", [{}, {"early_min_bytes": None}], ids=str)
def test_a_repeated_structure_replays_its_plan_and_every_call_is_exact(world4, options):
    """The leader's plan per structure: batches of a structure seen before, in a slot that
    holds its plan, are copied and signalled with nothing else, bit-exact on every rank; a blob
    past its room and a change of structure are packed anew (two structures in turn each
    keep their plan); a leader failure in the middle reaches every rank as the leader's and
    the calls after it replay again."""
    results = world4.run(replay_job, options, timeout_s=60)
    failing = next(i for i, (_, _, p) in enumerate(REPLAY_PLAN) if p == "unpicklable")
    for rank, (outcomes, _) in enumerate(results):
        wrong = [i for i, o in enumerate(outcomes) if o != "exact" and i != failing]
        assert not wrong, f"rank {rank}: calls {wrong}: {[outcomes[i] for i in wrong]}"
        want = "pickl" if rank == 0 else "LeaderFailed: "
        assert want in outcomes[failing], (rank, outcomes[failing])
    # The ring turns 0, 1, 2 (every release is in before the next call): each slot packs the
    # structure anew once (calls 0-2); 3-8 replay; 9's blob is past the room; 10 fails (its
    # slot's plan stays, the failure batch takes the next slot); 11 packs slot 0 anew (the
    # long blob's room), 12-16 replay; of 17-28 the second structure is new in each slot once.
    replayed = results[0][1]
    assert replayed == 6 + 5 + 9, f"the leader replayed {replayed} of {len(REPLAY_PLAN)} calls"
    assert all(res[1] == 0 for res in results[1:]), "a receiver replays nothing"
