"""Tier 2 (real gloo worlds): ROLL's lazy fetch (``RemoteBatch``: a stage fetches only the fields
it reads) as the ``fields`` option of the strategies whose readers read ranges of the leader's
message (``mooncake``, ``nixl``, ``self_load``: ``strategies.core.engine_store``; and
``independent_fetch``, out of its node store). A receiver gets
exactly the named fields, bit for bit, and reads only their bytes; the leader keeps its whole
batch; a field the batch lacks fails every rank at once, naming it and the batch's fields; a job
records the fields and the bytes each receiver moved, and checks what the stage asked for.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batchgen import batch_problems
from tensordict import TensorDict
from test_engines import where_available
from test_interop import PAYLOADS
from verl_support import receiver_entry, verl_modules

import strategies
from harness.job.execute import run_job
from harness.job.spec import JobSpec
from strategies.core.layout import Layout
from strategies.core.trace import Recorder

LAYOUT = Layout(tp=2, pp=2)
NAMES = where_available("mooncake", "nixl", "self_load", "independent_fetch")


def _needs_network(world, name: str) -> None:
    if getattr(strategies.get_class(name), "listens", False) and not world.private_network:
        pytest.skip("the forked world has no network of its own here (not root)")


def batch(b: int = 4) -> strategies.DataProto:
    gen = torch.Generator().manual_seed(7)
    td = TensorDict(
        {
            "input_ids": torch.randint(0, 50_000, (b, 512), generator=gen),
            "log_probs": torch.randn(b, 512, generator=gen),
            "rewards": torch.randn(b, generator=gen),
            "nested": {"mask": torch.ones(b, 512, dtype=torch.bool), "pos": torch.arange(b)},
        },
        [b],
    )
    texts = np.array([f"prompt {i}" for i in range(b)], dtype=object)
    return strategies.DataProto(td, {"prompt": texts}, {strategies.NON_TENSOR_FLAG: True})


def lazy_calls(ctx, name: str, fields: list[str]) -> dict:
    """Two calls of ``name`` with ``fields``: per rank, the keys it got, whether each is exact,
    its non-tensor batch, and the bytes it copied in the second call."""
    groups = ctx.groups_for(LAYOUT)
    s = strategies.get(name, groups, fields=fields)
    mine = batch()
    for _ in range(2):
        with Recorder() as rec:
            out = s.get_data_input(mine.entry_state(groups.is_leader))
    keys = sorted(
        ".".join(k) if isinstance(k, tuple) else k
        for k in out.batch.keys(include_nested=True, leaves_only=True)
    )
    exact = all(torch.equal(out.batch[k], mine.batch[k]) for k in out.batch.keys(True, True))
    return {
        "keys": keys,
        "exact": exact,
        "prompt": list(out.non_tensor_batch.get("prompt", [])),
        "copied": rec.work["copied_bytes"],
    }


@pytest.mark.parametrize("name", NAMES)
def test_a_stage_gets_the_fields_it_reads_and_moves_only_their_bytes(world4, name):
    _needs_network(world4, name)
    full = world4.run(lazy_calls, name, [], what="every field")
    some = world4.run(lazy_calls, name, ["log_probs", "nested.mask"], what="two fields")
    everything = ["input_ids", "log_probs", "nested.mask", "nested.pos", "rewards"]
    assert some[0]["keys"] == everything, "the leader keeps its whole batch"
    picked = mine_bytes = 4 * 512 * 4 + 4 * 512  # log_probs (float32) and the mask (bool)
    for rank in range(1, 4):
        assert full[rank]["keys"] == everything and full[rank]["exact"]
        assert some[rank]["keys"] == ["log_probs", "nested.mask"], some[rank]
        assert some[rank]["exact"] and some[rank]["prompt"] == [f"prompt {i}" for i in range(4)]
        # the header and the non-tensor blob come too, the other leaves do not
        assert mine_bytes <= some[rank]["copied"] < full[rank]["copied"] - 4 * 512 * 8 + picked


def unknown_field(ctx, name: str) -> str:
    groups = ctx.groups_for(LAYOUT)
    s = strategies.get(name, groups, fields=["log_probs", "values"])
    try:
        s.get_data_input(batch().entry_state(groups.is_leader))
    except Exception as exc:  # noqa: BLE001 -- what each rank raised is the answer
        return f"{type(exc).__name__}: {exc}"
    return "returned"


@pytest.mark.parametrize("name", NAMES)
def test_a_field_the_batch_lacks_fails_every_rank_naming_it(world4, name):
    _needs_network(world4, name)
    said = world4.run(unknown_field, name, what="an unknown field")
    for line in said:
        assert "'values'" in line and "input_ids" in line, said


def test_a_job_records_the_fields_and_checks_what_the_stage_asked_for(world4):
    spec = JobSpec(
        "self_load", LAYOUT, batch_size=8, seq_len=64, iters=2, warmup=2,
        options={"fields": ["input_ids"]}, references=("floor",),
    )  # fmt: skip
    record = run_job(world4, spec)
    assert record["correct"], record.get("error")
    assert record["options"] == {"fields": ["input_ids"]}
    whole = run_job(world4, JobSpec("self_load", LAYOUT, batch_size=8, seq_len=64, iters=2))
    assert record["copied_bytes_receiver"] < whole["copied_bytes_receiver"] / 2


def verl_lazy_calls(ctx, name: str, payload: str, fields: list[str]) -> list[str]:
    """Two calls of ``name`` reading ``fields`` of a verl object: every way a receiver's batch
    differs from the leader's named fields (its non-tensor batch and meta_info whole); the
    leader keeps its whole object."""
    groups = ctx.groups_for(LAYOUT)
    s = strategies.get(name, groups, fields=fields)
    problems = []
    for call in range(2):
        expected = PAYLOADS[payload](3, call)
        entry = PAYLOADS[payload](3, call) if groups.is_leader else receiver_entry(expected)
        out = s.get_data_input(entry)
        if not groups.is_leader:
            kept = type(expected)(
                batch=expected.batch.select(*fields),
                non_tensor_batch=expected.non_tensor_batch,
                meta_info=expected.meta_info,
            )
            expected = kept
        problems += batch_problems(expected, out, groups.is_leader, f"rank {ctx.rank} {call}")
    return problems


@pytest.mark.parametrize("payload", ["verl_dataproto_flag", "verl_worker_payload"])
@pytest.mark.parametrize("name", NAMES)
def test_a_stage_reads_some_fields_of_verl_objects(world4, name, payload):
    """verl's own DataProto (its non-tensor arrays flagged) and its worker payload (jagged
    NestedTensor and NonTensorData leaves): a reader of two fields gets exactly them, a jagged
    one whole, with the non-tensor batch and meta_info."""
    verl_modules()  # skip here, before any rank imports verl
    _needs_network(world4, name)
    said = world4.run(verl_lazy_calls, name, payload, ["input_ids", "position_ids"])
    assert [p for problems in said for p in problems] == []
