"""Tier 1 (no process group): ``auto``'s decision — the header every rank decodes describes
the leader's batch as ``spec_of`` does, ties go by preference, and on the emulated clusters it
picks the strategies the committed emulated table measured fastest.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness.payload import generated
from strategies.auto import CANDIDATES, TIE, choose, pick, spec_of_header
from strategies.core.layout import Layout
from strategies.core.packer import pack
from strategies.core.parts import blob_room
from strategies.core.plan import spec_of

TP2PP2 = Layout(tp=2, pp=2)


@pytest.mark.parametrize("payload", ["rl_rollout", "multimodal"])
@pytest.mark.parametrize("flag", [False, True])
def test_spec_of_header_is_spec_of_the_batch(payload, flag):
    dp = generated.make(payload, 3, 64, seed=1, broadcast_non_tensor=flag)
    _, header = pack(dp.batch, dp.non_tensor_batch if flag else None)
    exact = spec_of(dp)
    from_header = spec_of_header(header)
    # Everything but the pickle size of the tensors, which no candidate sends, and the
    # non-tensor blob's length, of which the header keeps the room (parts.blob_room).
    room = blob_room(exact.non_tensor_bytes) if flag else exact.non_tensor_bytes
    assert from_header == replace(
        exact, pickle_bytes=from_header.pickle_bytes, pickle_exact=False, non_tensor_bytes=room
    )


def test_ties_go_by_preference_and_a_clear_winner_wins():
    assert pick({"direct": 1.0, "flat": 1.0 + TIE / 2}) == "flat"
    assert pick({"direct": 1.0, "flat": 1.0 + 2 * TIE}) == "direct"
    assert pick({"scatter_allgather": 1.0, "pp_first": 3.0}) == "scatter_allgather"
    assert list(CANDIDATES)[:2] == ["flat", "direct"]


def test_auto_picks_what_the_emulated_table_measured_fastest():
    """results/reference_emulated: rl_rollout B=720 S=512 on tp2pp2 over two nodes; shm (the
    message once across, in stripes from each rank of the leader's node, then shared memory
    in each node) wins on both link layouts; of the collective strategies alone pp_first wins
    with one link per node, scatter_allgather (half the message on each rank's own link) with
    one link per GPU."""
    spec = spec_of(generated.make("rl_rollout", 720, 512, seed=0))
    assert choose(TP2PP2, spec, "emulated") == "shm"
    assert choose(TP2PP2, spec, "emulated_rails") == "shm"
    network = tuple(c for c in CANDIDATES if c != "shm")
    assert choose(TP2PP2, spec, "emulated", network) == "pp_first"
    assert choose(TP2PP2, spec, "emulated_rails", network) == "scatter_allgather"


def test_auto_on_one_host_hands_the_batch_over_in_shared_memory():
    """On one host (the calibrated ``local`` preset) shm's signals cost less than any
    collective once the batch's bytes count (a tiny batch is a race between the signal and
    α, which a calibration on a loaded host can tip either way); without it, auto sends one
    hop at every size."""
    network = tuple(c for c in CANDIDATES if c != "shm")
    for batch_size in (3, 128, 768):
        spec = spec_of(generated.make("rl_rollout", batch_size, 512, seed=0))
        assert choose(TP2PP2, spec) in (("shm",) if batch_size > 3 else ("shm", "flat", "direct"))
        assert choose(TP2PP2, spec, candidates=network) in ("direct", "flat")


def test_a_batch_on_a_device_prices_shms_staging_copies():
    """On GPUs shm stages the message through host memory: its plan then carries one D2H on
    the leader and one H2D per receiver, and over NVLink (h200_ib) a collective wins."""
    import strategies

    spec = spec_of(generated.make("rl_rollout", 356, 512, seed=0))
    plan = strategies.get_class("shm").plan(Layout(tp=8), spec, stage=True)
    assert plan.leader.d2h_bytes == plan.receiver.h2d_bytes == spec.message_bytes
    assert choose(Layout(tp=8), spec, "h200_ib", device="cuda") != "shm"


def test_the_next_shape_is_predicted_from_what_followed_it_last_time():
    """auto prices the shape the next call will move: a constant stream predicts itself, a
    repeating pattern is predicted exactly from its second period on, and a new shape
    predicts itself; the table stays bounded however many shapes a stream brings."""
    from strategies.auto import NextShape

    constant = NextShape()
    assert [constant.observe("a") for _ in range(3)] == ["a", "a", "a"]

    pattern = NextShape()
    seen = [pattern.observe(k) for k in "abcabcabc"]
    # First period: nothing followed these yet, each predicts itself; then the pattern.
    assert seen[:3] == ["a", "b", "c"] and seen[3:] == list("bcabca")
    assert pattern.observe("z") == "z"  # a shape never seen before
    assert pattern.observe("a") == "b"  # the pattern resumes

    endless = NextShape()
    for k in range(10 * NextShape.KEEP):
        endless.observe(k)
    assert len(endless.follows) == NextShape.KEEP


def test_a_shape_is_the_same_class_whoever_packed_it_and_whatever_its_strings():
    """auto's shape key: the leaves' keys, dtypes and shapes. ``direct`` takes large leaves out
    of the message (other offsets move) and the non-tensor blob's size follows the data; the
    class is the same either way, and a different row count is another class."""
    from strategies.auto import shape_key
    from strategies.core.packer import Packer

    a = generated.make("rl_rollout", 3, 64, seed=1, broadcast_non_tensor=True)
    b = generated.make("rl_rollout", 3, 64, seed=2, broadcast_non_tensor=True)
    _, ha = pack(a.batch, a.non_tensor_batch)
    _, hb = pack(b.batch, b.non_tensor_batch)
    _, hd, _ = Packer().pack(a.batch, a.non_tensor_batch, direct=frozenset({0}))
    assert hd.entries != ha.entries  # the offsets moved
    assert shape_key(ha) == shape_key(hb) == shape_key(hd)
    c = generated.make("rl_rollout", 4, 64, seed=1, broadcast_non_tensor=True)
    assert shape_key(pack(c.batch, c.non_tensor_batch)[1]) != shape_key(ha)
