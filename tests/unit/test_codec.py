"""Tier 1 (no process group): the binary header and flat-buffer packing the header-based
strategies share; round trips for every dtype and layout, and corrupt or oversized headers.
"""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import torch
from batchgen import (
    DTYPE_NAMES,
    BatchSpec,
    LeafSpec,
    batch_problems,
    batch_specs,
    build_batch,
    raw_bytes,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from strategies.core import parts
from strategies.core.header_format import (
    ALIGN,
    DEFAULT_MAX_BYTES,
    DIRECT,
    DTYPES,
    KIND_DENSE,
    MAX_KEYS,
    MAX_NDIM,
    PREFIX_BYTES,
    Entry,
    HeaderError,
    align,
    decode_header,
    encode_header,
    peek_total,
    read_header,
)
from strategies.core.packer import RECENT_PACKS, SHRINK_ABOVE, Packer, layout_entries, pack
from strategies.core.parts import blob_room, decode_non_tensor, encode_non_tensor
from strategies.core.trace import WORK
from strategies.core.unpacker import unpack
from strategies.core.wire import PAGE, RECENT_CALLS, Wire

FAST = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def leaves(td: TensorDict) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    return [
        (k if isinstance(k, tuple) else (k,), t)
        for k, t in td.items(include_nested=True, leaves_only=True)
    ]


def test_every_listed_dtype_has_a_code():
    names = {str(d).removeprefix("torch.") for d in DTYPES}
    assert names == set(DTYPE_NAMES)  # the same list the random batches draw from


# -- round trips -----------------------------------------------------------------------------
@FAST
@given(spec=batch_specs(big=False), b=st.integers(0, 5), next_expect=st.integers(0, 2**40))
def test_header_round_trip(spec: BatchSpec, b: int, next_expect: int):
    dp = build_batch(spec, b, seed=b)
    blob = pickle.dumps(dp.non_tensor_batch) if spec.broadcast_non_tensor else None
    entries, data_bytes, span = layout_entries(dp.batch, 0, None if blob is None else len(blob))
    raw = encode_header((b,), entries, data_bytes, span, next_expect)
    assert len(raw) % ALIGN == 0
    header = decode_header(raw)
    assert header.batch_size == (b,)
    assert header.entries == tuple(entries)
    assert header.data_bytes == data_bytes
    assert header.header_len == len(raw)
    assert header.next_expect == next_expect
    assert header.non_tensor == span
    assert peek_total(raw[:PREFIX_BYTES]) == len(raw) + data_bytes
    for e, (key, t) in zip(entries, leaves(dp.batch)):
        assert e.key == key and e.dtype == t.dtype and e.shape == tuple(t.shape)
        assert e.nbytes == t.numel() * t.element_size()  # the view's bytes, not its storage
        assert e.offset % ALIGN == 0


@FAST
@given(spec=batch_specs(big=False), b=st.integers(0, 5))
def test_flat_fast_path_is_the_general_walk(spec: BatchSpec, b: int):
    """message_parts' shortcut for flat dense batches returns exactly what tensordict's walk
    returns (same keys, kinds and tensor objects, in order), and steps aside for the rest."""
    td = build_batch(spec, b, seed=b + 7).batch
    walked = parts._walk_parts(td, 0)
    fast = parts._flat_dense_parts(td)
    flat_dense = all(len(k) == 1 and kind == KIND_DENSE for k, kind, _, _ in walked)
    if fast is None:
        assert not flat_dense or any(type(t) is not torch.Tensor for *_, t in walked)
        return
    assert flat_dense
    assert [(k, kind, aux) for k, kind, aux, _ in fast] == [
        (k, kind, aux) for k, kind, aux, _ in walked
    ]
    assert all(a is w for (*_, a), (*_, w) in zip(fast, walked))


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(lambda: TensorDict({"y": torch.ones(2, 3)}, batch_size=[2]), id="nested-td"),
        pytest.param(
            lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
            id="jagged",
        ),
        pytest.param(
            lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), id="strided-nested"
        ),
        pytest.param(lambda: torch.nn.Parameter(torch.ones(2, 3)), id="tensor-subclass"),
    ],
)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_flat_fast_path_steps_aside(value):
    td = TensorDict({"x": torch.zeros(2, 4)}, batch_size=[2])
    td["z"] = value()
    assert parts._flat_dense_parts(td) is None
    td_obj = TensorDict({"x": torch.zeros(2, 4)}, batch_size=[2])
    td_obj.set_non_tensor("note", "text")
    assert parts._flat_dense_parts(td_obj) is None


@FAST
@given(spec=batch_specs(big=False), b=st.integers(0, 5))
def test_pack_unpack_round_trip_bit_exact(spec: BatchSpec, b: int):
    dp = build_batch(spec, b, seed=b + 1)
    nt = dp.non_tensor_batch if spec.broadcast_non_tensor else None
    before = WORK["packed_bytes"]
    buf, header = pack(dp.batch, nt, next_expect=12345, rank=3)
    total = header.total_bytes
    assert WORK["packed_bytes"] - before == total
    # Only each leaf's own elements are packed, whatever storage it views.
    expected_data = 0
    for _, t in leaves(dp.batch):
        expected_data = align(expected_data + t.numel() * t.element_size())
    if nt is not None:
        expected_data = align(expected_data + blob_room(len(encode_non_tensor(nt))))
    assert header.data_bytes == expected_data
    assert buf.dtype == torch.uint8 and buf.numel() >= total
    assert read_header(buf[:total], DEFAULT_MAX_BYTES, 3) == header
    td, non_tensor = unpack(buf[:total], header)
    got = type(dp)(td, non_tensor if non_tensor is not None else {}, dp.meta_info)
    receiver_view = not spec.broadcast_non_tensor
    assert batch_problems(dp, got, is_leader=not receiver_view, where="unpack") == []
    if nt is None:
        assert non_tensor is None
    # Zero-copy: every received leaf is a view into the buffer.
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for _, t in leaves(td):
        if t.numel():
            assert lo <= t.data_ptr() < hi


def test_views_pack_only_their_own_bytes():
    parent = torch.arange(1 << 20, dtype=torch.float32).view(1024, 1024)  # 4 MiB storage
    td = TensorDict(
        {
            "window": parent[10:14, 100:103],  # 4×3 view with a storage offset
            "column": parent[:4, 7],  # strided, non-contiguous
            "expanded": torch.ones(1, 5).expand(4, 5),  # stride 0
            "t": parent[:12].view(12, 1024)[:, :4].reshape(4, 3, 4).transpose(1, 2),
        },
        batch_size=[4],
    )
    buf, header = pack(td, None)
    assert header.data_bytes == align(48) + align(16) + align(80) + align(192)
    assert header.total_bytes < 1024
    td2, _ = unpack(buf, header)
    for key in td.keys():
        assert torch.equal(td2[key], td[key]), key
        assert td2[key].is_contiguous()


def test_pack_reuses_a_large_enough_buffer():
    td = TensorDict({"x": torch.arange(8)}, batch_size=[8])
    out = torch.empty(4096, dtype=torch.uint8)
    buf, _ = pack(td, None, out=out)
    assert buf.data_ptr() == out.data_ptr()
    small = torch.empty(8, dtype=torch.uint8)
    buf2, header = pack(td, None, out=small, min_capacity=1000)
    assert buf2.data_ptr() != small.data_ptr() and buf2.numel() >= 1000
    assert torch.equal(unpack(buf2, header)[0]["x"], td["x"])


def test_many_dtypes_in_one_buffer_keep_every_bit():
    spec = BatchSpec(
        tuple(
            LeafSpec((name,), name, (3,), kind)
            for name, kind in zip(
                [str(d).removeprefix("torch.") for d in DTYPES],
                ["contiguous", "strided", "view", "expanded", "transposed", "view"] * 2,
            )
        )
    )
    dp = build_batch(spec, 5, seed=0)
    buf, header = pack(dp.batch, None)
    td, _ = unpack(buf, header)
    for key, t in leaves(dp.batch):
        assert td[key].dtype == t.dtype
        assert torch.equal(raw_bytes(td[key]), raw_bytes(t)), key
    assert torch.isnan(dp.batch["float64"]).any()  # the specials really are in there
    assert torch.isinf(dp.batch["float64"]).any()


# -- unsupported dtypes ------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:.*quantize_per_tensor")
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(4, 2, dtype=torch.float8_e4m3fn),
        lambda: torch.zeros(4, dtype=torch.uint16),
        lambda: torch.quantize_per_tensor(torch.zeros(4, 2), 0.1, 0, torch.quint8),
    ],
    ids=["float8_e4m3fn", "uint16", "quint8"],
)
def test_unsupported_dtype_names_key_and_rank(make):
    t = make()
    flat = TensorDict({"ok": torch.zeros(4), "odd": t}, batch_size=[4])
    with pytest.raises(HeaderError) as err:
        pack(flat, None, rank=5)
    msg = str(err.value)
    assert "rank 5" in msg and "batch['odd']" in msg and str(t.dtype) in msg
    assert "supported: bool, uint8" in msg
    nested = TensorDict({"outer": {"inner": t}}, batch_size=[4])
    with pytest.raises(HeaderError, match=r"batch\[\('outer', 'inner'\)\]"):
        pack(nested, None, rank=5)


# -- corrupt headers ---------------------------------------------------------------------------
def sample_header(non_tensor: bool = False) -> tuple[bytes, list[Entry], int]:
    td = TensorDict(
        {"a": torch.zeros(4, 3), "n": {"b": torch.zeros(4, dtype=torch.int16)}}, batch_size=[4]
    )
    entries, data_bytes, span = layout_entries(td, 0, 10 if non_tensor else None)
    return encode_header((4,), entries, data_bytes, span), entries, data_bytes


def patch_prefix(raw: bytes, **fields) -> bytes:
    names = ("magic", "version", "flags", "header_len", "data_bytes", "next_expect")
    values = dict(zip(names, struct.unpack_from("<4sHHIQQ", raw)))
    values.update(fields)
    return struct.pack("<4sHHIQQ", *(values[n] for n in names)) + raw[PREFIX_BYTES:]


def expect_error(raw: bytes, match: str, max_bytes: int = DEFAULT_MAX_BYTES):
    with pytest.raises(HeaderError, match=match) as err:
        decode_header(raw, max_bytes=max_bytes, rank=7)
    assert "rank 7" in str(err.value)


def test_bad_magic():
    raw, _, _ = sample_header()
    expect_error(b"XXXX" + raw[4:], "corrupt header .magic")


def test_bad_version():
    raw, _, _ = sample_header()
    expect_error(patch_prefix(raw, version=9), "header version 9")


@pytest.mark.parametrize("cut", [0, 1, PREFIX_BYTES - 1])
def test_truncated_prefix(cut):
    raw, _, _ = sample_header()
    expect_error(raw[:cut], "header truncated")


def test_truncated_body():
    raw, _, _ = sample_header()
    expect_error(raw[: len(raw) - ALIGN], "header truncated")


def test_header_len_not_aligned_or_too_small():
    raw, _, _ = sample_header()
    expect_error(patch_prefix(raw, header_len=PREFIX_BYTES + 3), "header_len")
    expect_error(patch_prefix(raw, header_len=8), "header_len")


def test_fields_running_past_the_header():
    td = TensorDict({f"k{i}": torch.zeros(2) for i in range(8)}, batch_size=[2])
    entries, data_bytes, _ = layout_entries(td)
    raw = encode_header((2,), entries, data_bytes, None)
    assert len(raw) > 128
    expect_error(patch_prefix(raw, header_len=64), "runs past 64 bytes")


def test_offsets_out_of_range():
    raw, entries, data_bytes = sample_header()
    moved = [entries[0], Entry(entries[1].key, entries[1].dtype, entries[1].shape, 4096, 8)]
    expect_error(encode_header((4,), moved, data_bytes, None), r"spans bytes 4096\.\.4104")
    shrunk = encode_header((4,), entries, ALIGN, None)  # the data region no longer fits
    expect_error(shrunk, r"batch\[\('n', 'b'\)\] spans bytes")


def test_misaligned_offset():
    _, entries, data_bytes = sample_header()
    bad = [Entry(entries[0].key, entries[0].dtype, entries[0].shape, 8, 48)]
    expect_error(encode_header((4,), bad, data_bytes, None), "spans bytes 8")


def test_unknown_dtype_code_and_too_many_dims():
    raw, _, _ = sample_header()
    # After the prefix: bdim(1) B(8) n_keys(4) n_parts(1) len(2) 'a'(1) kind(1) aux(1) code(1)
    # ndim(1)
    kind_at = PREFIX_BYTES + 1 + 8 + 4 + 1 + 2 + 1
    bad_kind = raw[:kind_at] + bytes([200]) + raw[kind_at + 1 :]
    expect_error(bad_kind, "unknown entry kind 200")
    code_at = kind_at + 2
    bad_code = raw[:code_at] + bytes([200]) + raw[code_at + 1 :]
    expect_error(bad_code, "unknown dtype code 200")
    bad_ndim = raw[: code_at + 1] + bytes([MAX_NDIM + 1]) + raw[code_at + 2 :]
    expect_error(bad_ndim, f"claims {MAX_NDIM + 1} dims")


def test_too_many_keys():
    raw, _, _ = sample_header()
    at = PREFIX_BYTES + 1 + 8
    bad = raw[:at] + struct.pack("<I", MAX_KEYS + 1) + raw[at + 4 :]
    expect_error(bad, f"{MAX_KEYS + 1} keys")


def test_leading_dim_must_be_b():
    _, entries, data_bytes = sample_header()
    expect_error(encode_header((5,), entries, data_bytes, None), "expected leading dim B=5")


def test_undecodable_key():
    raw, _, _ = sample_header()
    at = PREFIX_BYTES + 1 + 8 + 4 + 1 + 2  # the single byte of key 'a'
    expect_error(raw[:at] + b"\xff" + raw[at + 1 :], "corrupt header")


def test_non_tensor_blob_past_the_region():
    raw, entries, data_bytes = sample_header(non_tensor=True)
    assert decode_header(raw).non_tensor is not None
    bad = encode_header((4,), entries, data_bytes, (data_bytes - 8, 64))
    expect_error(bad, "non-tensor blob runs past")


# -- oversized headers are refused before anything is allocated --------------------------------
def test_claims_more_than_max_bytes():
    raw, _, data_bytes = sample_header()
    expect_error(raw, "more than the maximum this receiver accepts", max_bytes=data_bytes)
    huge = patch_prefix(raw, data_bytes=1 << 60)
    with pytest.raises(HeaderError, match=r"rank 2: header claims \d+ bytes.*raise max_bytes"):
        peek_total(huge[:PREFIX_BYTES], rank=2)
    with pytest.raises(HeaderError, match="rank 2: header claims"):
        read_header(torch.frombuffer(bytearray(huge), dtype=torch.uint8), 1 << 30, 2)


def test_wire_refuses_oversized_message_before_allocating(monkeypatch):
    """A receiver learns the size from the first broadcast and must refuse a message larger
    than max_bytes without allocating a buffer for it."""
    raw, _, _ = sample_header()
    claim = patch_prefix(raw, data_bytes=1 << 40)
    first = 64 << 10

    def fake_broadcast(tensor, src=None, group=None, **kwargs):
        tensor[: len(claim)].copy_(torch.frombuffer(bytearray(claim), dtype=torch.uint8))

    sizes: list[int] = []
    real_empty = torch.empty

    def spy_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        sizes.append(t.numel())
        return t

    monkeypatch.setattr("strategies.core.wire.dist.broadcast", fake_broadcast)
    monkeypatch.setattr(torch, "empty", spy_empty)
    wire = Wire(torch.device("cpu"), rank=6, initial_bytes=first, max_bytes=1 << 30)
    with pytest.raises(HeaderError, match="rank 6: header claims"):
        wire.recv(group=None, src=0)
    assert sizes and max(sizes) <= first


def test_wire_next_expect_and_finish():
    wire = Wire(torch.device("cpu"), 0, initial_bytes=64 << 10, eager_max_bytes=1 << 20)
    assert wire.next_expect(100) == 64 << 10
    n = 200_000
    guess = wire.next_expect(n)
    headroom = min(n // 64, 64 << 10)  # small: every byte of headroom is sent every call
    assert guess % PAGE == 0 and n + headroom <= guess < n + headroom + PAGE
    assert wire.next_expect((1 << 20) + 1) == 64 << 10  # too large to post eagerly
    wire.finish(1 << 30, 100)
    assert wire.expect == 64 << 10
    wire.finish(8192, 100)
    assert wire.expect == 8192
    with pytest.raises(ValueError, match="initial_bytes must be >= 4096"):
        Wire(torch.device("cpu"), 0, initial_bytes=100)


def test_wire_sizes_the_first_message_for_the_smallest_recent_call():
    """No carry-over: after a large message the next first message is sized for the smallest
    of the last RECENT_CALLS, so alternating shapes post the small one; a stream that stays
    large posts its size again once the small one has left the window."""
    wire = Wire(torch.device("cpu"), 0)
    large, small = 22 << 20, 70 << 10
    for total in (large, small):
        wire.finish(wire.next_expect(total), total)
    assert wire.next_expect(large) == wire.fits(small) < 2 * small  # small after large: small
    for _ in range(RECENT_CALLS - 1):
        wire.finish(wire.next_expect(large), large)
        assert wire.expect == wire.fits(small)  # each large call pays one broadcast more
    wire.finish(wire.next_expect(large), large)
    assert wire.expect == wire.fits(large)  # settled on large: one broadcast again


def test_a_held_buffer_shrinks_back_after_a_large_batch():
    """Peak memory follows the recent batches: a buffer sized for one large batch is made
    again at the small size once RECENT_PACKS small batches have passed, and a stream that
    alternates keeps the large one (no reallocation per call)."""
    packer = Packer()
    large = TensorDict({"x": torch.arange(1 << 18)}, batch_size=[1 << 18])  # 2 MiB
    small = TensorDict({"x": torch.arange(64)}, batch_size=[64])
    for td in (large, small, large, small):
        buf, header, fill = packer.pack(td, None)
        fill(header.total_bytes)
        assert torch.equal(unpack(buf, header)[0]["x"], td["x"])
    big_capacity = packer.buffer.numel()
    assert big_capacity >= large["x"].numel() * 8  # alternating: the large buffer stays
    for _ in range(RECENT_PACKS):
        buf, header, fill = packer.pack(small, None)
        fill(header.total_bytes)
        assert torch.equal(unpack(buf, header)[0]["x"], small["x"])
    need = header.total_bytes
    assert packer.buffer.numel() <= SHRINK_ABOVE * need < big_capacity
    buf, header, fill = packer.pack(large, None)  # and it grows again when needed
    fill(header.total_bytes)
    assert torch.equal(unpack(buf, header)[0]["x"], large["x"])


# -- leaves that travel on their own (strategies/direct.py) -------------------------------------
def test_direct_leaves_are_described_but_not_packed():
    td = TensorDict(
        {"small": torch.arange(4.0), "big": torch.arange(4 * 300).view(4, 300), "s": torch.ones(4)},
        batch_size=[4],
    )
    buf, header, fill = Packer().pack(td, {"t": "x"}, direct=frozenset({1}))
    fill(header.total_bytes)
    offsets = [e.offset for e in header.entries]
    assert offsets[1] == DIRECT and offsets[0] != DIRECT != offsets[2]
    # The message holds only the small leaves and the blob; big is on its own.
    assert header.data_bytes < td["big"].numel() * 8
    decoded = decode_header(bytes(buf[: header.header_len].numpy()))
    assert decoded.entries == header.entries
    out, nt = unpack(buf, decoded, direct=[td["big"].clone()])
    assert list(out.keys()) == ["small", "big", "s"]  # the leader's order
    for key in td.keys():
        assert torch.equal(out[key], td[key]), key
    assert nt == {"t": "x"}


def test_direct_leaves_count_against_max_bytes():
    td = TensorDict({"big": torch.zeros(4, 1024)}, batch_size=[4])
    buf, header, _ = Packer().pack(td, None, direct=frozenset({0}))
    raw = bytes(buf[: header.header_len].numpy())
    expect_error(raw, "separately sent leaves", max_bytes=header.total_bytes + 1000)
    assert decode_header(raw, max_bytes=header.total_bytes + 4 * 1024 * 4).entries


def test_non_tensor_blob_round_trips_object_arrays_exactly():
    ragged = np.empty(3, dtype=object)
    ragged[:] = [[1, 2], [3, 4], [5, 6]]  # list elements of equal length: np.array would stack
    mixed = np.empty(4, dtype=object)
    mixed[:] = [{"pixel": np.arange(3)}, None, "π ∑ 为什么", (1, "a")]
    grid = np.empty((2, 2), dtype=object)  # 2-D object arrays keep their own pickle
    grid[:] = [["a", "b"], ["c", "d"]]
    nt = {
        "uid": np.array(["a", "b", "c"], dtype=object),
        "ragged": ragged,
        "mixed": mixed,
        "grid": grid,
        "score": np.arange(6, dtype=np.float16).reshape(3, 2),
        "strided": np.array(list("abcdef"), dtype=object)[::2],
    }
    got = decode_non_tensor(memoryview(encode_non_tensor(nt)))
    assert list(got) == list(nt)
    for k, a in nt.items():
        assert type(got[k]) is np.ndarray and got[k].dtype == a.dtype and got[k].shape == a.shape
    assert got["ragged"][1] == [3, 4] and got["mixed"][2] == "π ∑ 为什么"
    assert np.array_equal(got["mixed"][0]["pixel"], np.arange(3))
    assert got["mixed"][1] is None and got["mixed"][3] == (1, "a")
    assert got["grid"].tolist() == grid.tolist() and got["strided"].tolist() == ["a", "c", "e"]
    assert np.array_equal(got["score"], nt["score"])


def test_a_batch_whose_prompts_change_keeps_its_header():
    """The header keeps the non-tensor blob's room, not its length (``parts.blob_room``): two
    steps whose prompts differ by a few bytes pack into the same header bytes (the leader's
    encoded header, the receivers' decoded one and shm's guess all hold), both unpack exactly,
    and the room past the blob is zeros, whatever the buffer held before."""
    td = TensorDict({"ids": torch.arange(6).reshape(3, 2)}, [3])
    steps = [{"prompt": np.array(["solve x", "prove y", f"why {'z' * k}"], dtype=object)}
             for k in (1, 9)]  # fmt: skip
    lengths = [len(encode_non_tensor(nt)) for nt in steps]
    assert lengths[0] != lengths[1] and blob_room(lengths[0]) == blob_room(lengths[1])
    packer, raws = Packer(), []
    for nt in steps:
        buf, header, fill = packer.pack(td, nt)
        buf[header.header_len :].fill_(0xFF)  # what an earlier message left
        fill(header.total_bytes)
        raws.append(bytes(buf[: header.header_len].numpy()))
        _, got = unpack(buf[: header.total_bytes], header)
        assert list(got["prompt"]) == list(nt["prompt"])
        (off, room), own = header.non_tensor, len(encode_non_tensor(nt))
        tail = buf[header.header_len + off + own : header.header_len + off + room]
        assert room == blob_room(own) and len(tail) == room - own and not tail.any()
    assert raws[0] == raws[1]


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 4095, 65536, 65537, 1 << 20, 3_000_001])
def test_blob_room_holds_the_blob_and_is_its_own_room(n):
    room = blob_room(n)
    assert room >= max(n, parts.BLOB_MIN_ROOM) and blob_room(room) == room
    assert room <= max(2 * n, parts.BLOB_MIN_ROOM) and (n <= 65536 or room <= n * 1.125 + 1)
