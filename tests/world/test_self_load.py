"""Tier 2 (real gloo worlds): what ``self_load`` promises beyond the contract every strategy's
tests check. The leader records the batch once and again only when it changed (a tensor written
in place, a leaf replaced, other non-tensor contents), so every receiver always reads the batch
it was handed; warm and cold reads are exact; the record has no name on disk and its file goes
with the instance; a directory that cannot hold it is refused where the strategy is built, on
every rank.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import strategies
from strategies.core.layout import Layout

LAYOUT = Layout(tp=2, pp=2)


def batch(seed: int, b: int = 4) -> strategies.DataProto:
    gen = torch.Generator().manual_seed(seed)
    td = TensorDict(
        {
            "x": torch.randn(b, 300, generator=gen),
            "nested": {"ids": torch.randint(0, 50_000, (b, 17), generator=gen)},
        },
        [b],
    )
    texts = np.array([f"prompt {seed}-{i}" for i in range(b)], dtype=object)
    return strategies.DataProto(td, {"prompt": texts}, {strategies.NON_TENSOR_FLAG: True})


def _records_open(pid: int) -> int:
    """How many unnamed temporary files process ``pid`` holds open."""
    fds = f"/proc/{pid}/fd"
    n = 0
    for fd in os.listdir(fds):
        try:
            target = os.readlink(f"{fds}/{fd}")
        except OSError:
            continue
        n += target.startswith("/") and "(deleted)" in target and "/#" in target
    return n


def changing_job(ctx, cache: str) -> dict:
    """Six calls on one instance, the batch changed between some of them the ways a caller can
    change it; per rank: every call exact, the records the leader made, the unnamed files the
    leader held open while the instance lived and once it went (beyond those open before)."""
    groups = ctx.groups_for(LAYOUT)
    gc.collect()
    before = _records_open(os.getpid())  # earlier tests' instances may still be alive
    s = strategies.get("self_load", groups, cache=cache)
    made = []
    original = s._write_record

    def counting(b):
        made.append(1)
        original(b)

    s._write_record = counting
    mine = batch(1)
    exact = []

    def call():
        # Every rank makes the same changes to its own ``mine``: a receiver's is what to expect.
        out = s.get_data_input(mine.entry_state(groups.is_leader))
        exact.append(
            torch.equal(out.batch["x"], mine.batch["x"])
            and torch.equal(out.batch["nested", "ids"], mine.batch["nested", "ids"])
            and list(out.non_tensor_batch["prompt"]) == list(mine.non_tensor_batch["prompt"])
        )

    call()
    call()  # unchanged: no new record
    mine.batch["x"].add_(1)  # written in place: its version counter moves
    call()
    mine.batch["nested", "ids"] = torch.zeros(4, 17, dtype=torch.int64)  # a leaf replaced
    call()
    mine.non_tensor_batch["prompt"][0] = "changed"  # numpy has no version: the pickle differs
    call()
    call()
    held = _records_open(os.getpid())
    s = original = None  # the closures hold their cells: the instance goes with these
    gc.collect()
    return {
        "exact": exact,
        "records": len(made) if groups.is_leader else None,
        "held": held - before,
        "left": _records_open(os.getpid()) - before,
    }


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_every_change_to_the_batch_is_recorded_and_read_exactly(world4, cache):
    results = world4.run(changing_job, cache, what="self_load calls")
    for rank, r in enumerate(results):
        assert r["exact"] == [True] * 6, (rank, r["exact"])
    assert results[0]["records"] == 4, "a record per change, none for an unchanged batch"
    assert results[0]["held"] == 1 and results[0]["left"] == 0
    assert all(r["held"] == 0 for r in results[1:]), "a receiver kept the record open"


def refused_directory(ctx, directory: str) -> str:
    groups = ctx.groups_for(LAYOUT)
    try:
        strategies.get("self_load", groups, directory=directory)
    except Exception as exc:  # noqa: BLE001 -- what each rank raised is the answer
        return f"{type(exc).__name__}: {exc}"
    return "built"


@pytest.mark.parametrize("where", ["no-such-directory", "a-file", "/proc"])
def test_a_directory_that_cannot_hold_the_record_is_refused_on_every_rank(world4, tmp_path,
                                                                        where):  # fmt: skip
    """Refused where the strategy is built, before any collective, each rank naming itself
    and the directory: a job records it as refused instead of failing at its first call."""
    (tmp_path / "a-file").write_text("")
    directory = where if where.startswith("/") else str(tmp_path / where)
    said = world4.run(refused_directory, directory, what="self_load, bad directory")
    assert all(line.startswith("Unsupported: ") for line in said), said
    assert all(directory in line and "O_TMPFILE" in line for line in said), said
    assert all(f"rank {r}:" in line for r, line in enumerate(said)), said
