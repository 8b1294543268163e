"""Tier 1 (no process group): jagged NestedTensor and NonTensorData/NonTensorStack leaves
through the header codec: every dtype, empty components, nested keys, with and without
lengths; what arrives equals what was packed component by component, and the exact plan
spec (``spec_of``) matches the message the codec builds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batchgen import DTYPE_NAMES, _values, batch_problems
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from strategies import DataProto
from strategies.core.header_format import HeaderError, read_header
from strategies.core.packer import pack
from strategies.core.plan import spec_of
from strategies.core.unpacker import unpack

KEY_PARTS = st.text(alphabet="abjz_π", min_size=1, max_size=4)


def jagged_leaf(dtype: str, lengths: list[int], tail: tuple[int, ...], holes: bool, seed: int):
    """A jagged leaf of ``dtype``; ``holes``: built from offsets and lengths, so its rows
    leave gaps in the values (a non-contiguous jagged tensor)."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    if holes:
        starts = np.cumsum([0] + [n + 1 for n in lengths])
        values = _values((int(starts[-1]), *tail), dt, g)
        offsets = torch.tensor(starts, dtype=torch.int64)
        return torch.nested.nested_tensor_from_jagged(
            values, offsets, lengths=torch.tensor(lengths, dtype=torch.int64)
        )
    rows = [_values((n, *tail), dt, g) for n in lengths]
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


@st.composite
def jagged_batches(draw) -> DataProto:
    b = draw(st.integers(1, 4))
    nested: dict = {}
    for i in range(draw(st.integers(1, 3))):
        key = tuple(draw(st.lists(KEY_PARTS, min_size=1, max_size=3)))
        key = (*key[:-1], f"{key[-1]}{i}")  # unique leaf names
        leaf = jagged_leaf(
            draw(st.sampled_from(DTYPE_NAMES)),
            draw(st.lists(st.integers(0, 4), min_size=b, max_size=b)),
            tuple(draw(st.lists(st.integers(1, 3), max_size=2))),
            draw(st.booleans()),
            draw(st.integers(0, 1000)),
        )
        node = nested
        for part in key[:-1]:
            node = node.setdefault(f"n_{part}", {})
        node[key[-1]] = leaf
    nested["dense"] = torch.arange(b * 2, dtype=torch.int64).view(b, 2)
    nested["note"] = NonTensorData(draw(st.text(max_size=5)), batch_size=[b])
    nested["ids"] = NonTensorStack(*[f"u{i}" for i in range(b)])
    return DataProto(TensorDict(nested, batch_size=[b]), {}, {"step": 1})


@settings(max_examples=60, deadline=None)
@given(dp=jagged_batches())
def test_jagged_and_non_tensor_leaves_round_trip(dp):
    buf, header = pack(dp.batch, None)
    assert header.total_bytes == spec_of(dp).message_bytes
    decoded = read_header(buf, 1 << 30, rank=1)
    td, _ = unpack(buf, decoded)
    got = DataProto(td, {}, dict(dp.meta_info))
    assert batch_problems(dp, got, is_leader=False, where="rank 1") == []


def test_a_strided_nested_leaf_is_refused_naming_it():
    strided = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])  # layout=torch.strided
    td = TensorDict({"s": strided}, batch_size=[2])
    with pytest.raises(HeaderError, match=r"rank 3: batch\['s'\] is a nested tensor with layout"):
        pack(td, None, rank=3)


def test_a_forged_offsets_length_is_refused():
    leaf = jagged_leaf("float32", [1, 2], (), False, 0)
    buf, header = pack(TensorDict({"j": leaf}, batch_size=[2]), None)
    raw = bytes(buf[: header.header_len].numpy())
    forged = raw.replace(b"\x03\x00\x00\x00\x00\x00\x00\x00", b"\x02\x00\x00\x00\x00\x00\x00\x00")
    with pytest.raises(HeaderError, match=r"expected offsets of length B\+1=3"):
        read_header(torch.frombuffer(bytearray(forged), dtype=torch.uint8), 1 << 30, rank=1)
