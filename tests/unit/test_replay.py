"""Tier 1 (no process group): the leader's plan per structure. A batch of a structure packed
before replays that pack (``Packer.replay``: no layout, header or view made again) and its
message is byte for byte what a fresh packer makes of it, whatever was packed in between; the
one-pass ``parts_and_structure`` is exactly ``message_parts`` then ``structure``.
"""

from __future__ import annotations

import numpy as np
import torch
from batchgen import BatchSpec, batch_specs, build_batch, raw_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from strategies.core.packer import NO_DIRECT, Packer, pack
from strategies.core.parts import message_parts, parts_and_structure, structure

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(spec=batch_specs(), b=st.integers(1, 5))
def test_parts_and_structure_is_parts_then_structure(spec: BatchSpec, b: int):
    td = build_batch(spec, b, seed=b).batch
    got_parts, got_shape = parts_and_structure(td)
    want = message_parts(td)
    assert [p[:3] for p in got_parts] == [p[:3] for p in want]
    assert all(torch.equal(raw_bytes(a[3]), raw_bytes(w[3])) for a, w in zip(got_parts, want))
    assert got_shape == structure(td, want)


def batch(rows: int, seed: int, keys=("ids", "mask"), text: int = 4):
    gen = torch.Generator().manual_seed(seed)
    td = TensorDict(
        {k: torch.randint(0, 1000, (rows, 3 + i), generator=gen) for i, k in enumerate(keys)},
        [rows],
    )
    prompts = np.array([f"p{seed}-{'x' * (text + i)}" for i in range(rows)], dtype=object)
    return td, {"prompt": prompts}


class Leader:
    """What ``PackedStrategy`` hands its packer: one structure object per structure (its
    ``checked_parts``) and a next_expect (``stamp``) that the test moves."""

    def __init__(self) -> None:
        self.packer = Packer()
        self.shapes: dict = {}
        self.stamp = 0

    def pack(self, td, nt) -> list[bytes]:
        parts, shape = parts_and_structure(td)
        shape = self.shapes.setdefault(shape, shape)
        buf, header, fill = self.packer.pack(td, nt, self.stamp, parts=parts, shape=shape)
        fill(header.total_bytes)
        return meaningful(buf, header)


def fresh(td, nt, stamp: int) -> list[bytes]:
    buf, header = pack(td, nt, next_expect=stamp)
    return meaningful(buf, header)


def meaningful(buf: torch.Tensor, header) -> list[bytes]:
    """The message's bytes that carry something: the header, every entry's bytes, the blob's
    whole room (its zeros included); not the alignment padding between them, which no
    receiver reads."""
    raw = bytes(buf[: header.total_bytes].numpy())
    at = header.header_len
    spans = [(0, at)] + [(at + e.offset, at + e.offset + e.nbytes) for e in header.entries]
    if header.non_tensor is not None:
        off, room = header.non_tensor
        spans.append((at + off, at + off + room))
    return [raw[a:b] for a, b in spans]


def test_a_repeated_structure_replays_and_its_message_is_a_fresh_packers():
    """Structures cycling A, B, A, A, C, B with new values and prompts of new lengths every
    call, and a stamp that changes once: every message equals a fresh packer's, byte for byte,
    and each call after a structure's first (in the same buffer, same stamp) is a replay."""
    leader = Leader()
    shapes = {"A": (4, ("ids", "mask")), "B": (7, ("ids", "mask")), "C": (4, ("ids", "pos"))}
    plan = ["A", "B", "A", "A", "C", "B", "A", "A"]
    replays = []
    for call, name in enumerate(plan):
        rows, keys = shapes[name]
        td, nt = batch(rows, seed=call, keys=keys, text=call % 3)
        leader.stamp = 4096 if call < 6 else 8192  # the wire's next size moves once
        before = leader.packer.replays_done
        got = leader.pack(td, nt)
        replays.append(leader.packer.replays_done - before)
        assert got == fresh(td, nt, leader.stamp), f"call {call} ({name}) differs"
    # B outgrows A's buffer, and the new buffer forgets A: A replays from its third call on;
    # B's second call replays with C's header written over its own; a new stamp: packed anew,
    # then replayed again.
    assert replays == [0, 0, 0, 1, 0, 1, 0, 1]


def test_an_equal_structure_object_replays_from_its_second_pack():
    """A structure validated again (it was forgotten, so its caller made a new object equal to
    the old one) replays from its own second pack on, as the first object did."""
    packer = Packer()
    td, nt = batch(3, seed=0)
    parts, first = parts_and_structure(td)
    second = parts_and_structure(td)[1]
    assert second == first and second is not first
    for shape in (first, first, second, second):
        buf, header, fill = packer.pack(td, nt, parts=parts, shape=shape)
        fill(header.total_bytes)
    assert packer.replays_done == 2


def test_a_reallocated_buffer_forgets_every_replay():
    packer = Packer()
    small, nt = batch(2, seed=1)
    parts, shape = parts_and_structure(small)
    for _ in range(2):
        buf, header, fill = packer.pack(small, nt, parts=parts, shape=shape)
        fill(header.total_bytes)
    assert packer.replays_done == 1
    large, nt_large = batch(4096, seed=2)
    buf, header, fill = packer.pack(large, nt_large, shape=parts_and_structure(large)[1])
    fill(header.total_bytes)
    assert packer.replay(shape, NO_DIRECT, None, 0, 0, small.device) is None
