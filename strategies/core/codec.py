"""The compact header and flat-buffer packing that the header-based strategies share.

A message is one uint8 buffer: a binary header (keys, dtypes, shapes, offsets; no pickle of
tensor data) followed by every tensor's bytes at 64-byte-aligned offsets, all dtypes in one
buffer. Receivers decode the header, refuse anything corrupt or oversized before allocating,
and return zero-copy views into the buffer.

A leaf travels as one or more parts (``message_parts``): a dense tensor as itself; a jagged
NestedTensor (``layout=torch.jagged``) as its values, offsets and (when present) lengths, each
an entry of its own kind, rebuilt as a jagged NestedTensor on arrival; a NonTensorData /
NonTensorStack leaf as its pickle, an entry flagged KIND_OBJECT (like the non_tensor_batch
blob), unpickled on arrival.
"""

from __future__ import annotations

import math
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict

from strategies.core.contract import is_non_tensor_leaf, leaves
from strategies.core.trace import WORK

MAGIC = b"BCB1"
VERSION = 3
"""2: every entry carries its kind (dense, jagged part, pickled non-tensor leaf); 3: the
non_tensor_batch blob pickles 1-D object arrays as lists (``encode_non_tensor``)."""
ALIGN = 64
DEFAULT_MAX_BYTES = 16 << 30  # receivers refuse headers that claim more than this
MAX_NDIM = 32
MAX_KEYS = 1 << 16
DIRECT = (1 << 64) - 1
"""Offset of an entry whose bytes are not in the message: the leaf travels in a broadcast of
its own, straight from the sender's tensor (strategies/direct.py)."""

DTYPES: tuple[torch.dtype, ...] = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
)
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}
ITEMSIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in DTYPES}

KIND_DENSE, KIND_VALUES, KIND_OFFSETS, KIND_LENGTHS, KIND_OBJECT = range(5)
"""What an entry holds: a dense leaf; the values, offsets or lengths of a jagged leaf (the
values entry's ``aux`` is its ragged dim); or the pickle of a non-tensor leaf."""
KIND_NAMES = ("dense", "values", "offsets", "lengths", "object")

_PREFIX = struct.Struct("<4sHHIQQ")  # magic, version, flags, header_len, data_bytes, next_expect
NEXT_EXPECT_OFFSET = 20  # byte offset of next_expect in the prefix
FLAG_NON_TENSOR = 1


class HeaderError(ValueError):
    """A header that is corrupt, unsupported or larger than the receiver accepts."""


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def dtype_code(dtype: torch.dtype, key, rank: int) -> int:
    code = DTYPE_CODE.get(dtype)
    if code is None:
        raise HeaderError(
            f"rank {rank}: batch[{key!r}] has dtype {dtype}, which the header cannot carry; "
            f"supported: {', '.join(str(d).removeprefix('torch.') for d in DTYPES)}"
        )
    return code


@dataclass(frozen=True)
class Entry:
    """One tensor in the message."""

    key: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the data region
    nbytes: int
    kind: int = KIND_DENSE
    aux: int = 0  # the ragged dim of a jagged leaf's values entry


@dataclass(frozen=True)
class Header:
    """Decoded header: what the data region holds."""

    batch_size: tuple[int, ...]
    entries: tuple[Entry, ...]
    data_bytes: int
    header_len: int  # bytes before the data region (aligned)
    next_expect: int
    non_tensor: tuple[int, int] | None  # (offset, nbytes) of the pickled non_tensor_batch

    @property
    def total_bytes(self) -> int:
        return self.header_len + self.data_bytes


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own elements as flat uint8 (copies only when its layout requires).

    ``reshape(-1)`` of a one-element strided view keeps a stride != 1, which ``view(uint8)``
    refuses; one element may take any stride, so it is re-strided in place.
    """
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    flat = t.reshape(-1)
    if flat.stride(0) != 1:  # only a single element can be "contiguous" with another stride
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


# Dtypes gloo and NCCL reduce/broadcast natively; others (int16, ...) travel as their bytes.
_NATIVE = {
    torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
}  # fmt: skip


def transportable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a uint8 view of its bytes when the backends cannot carry its dtype
    (gloo raises 'Invalid scalar type' for int16). Sender and receiver apply the same rule to
    contiguous tensors, so the bytes land where they belong."""
    return t if t.dtype in _NATIVE else as_bytes(t)


Part = tuple  # (key, kind, aux, tensor): one entry of the message


def message_parts(batch: TensorDict, rank: int = 0) -> list[Part]:
    """Every piece the message carries, in leaf order: ``(key, kind, aux, tensor)``. A
    non-tensor leaf is pickled here (its bytes as a uint8 tensor)."""
    flat = _flat_dense_parts(batch)
    return flat if flat is not None else _walk_parts(batch, rank)


def _walk_parts(batch: TensorDict, rank: int) -> list[Part]:
    """``message_parts`` by tensordict's own walk over every leaf (any batch)."""
    out: list[Part] = []
    for key, value in leaves(batch):
        name = key if len(key) > 1 else key[0]
        if is_non_tensor_leaf(value):
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            WORK["pickled_bytes"] += len(blob)
            out.append((key, KIND_OBJECT, 0, torch.frombuffer(bytearray(blob), dtype=torch.uint8)))
        elif value.is_nested:
            if value.layout != torch.jagged:
                raise HeaderError(
                    f"rank {rank}: batch[{name!r}] is a nested tensor with layout "
                    f"{value.layout}; the header carries dense tensors and layout=torch.jagged"
                )
            # The offsets come last: the entry that tells a receiver the leaf is complete.
            out.append((key, KIND_VALUES, value._ragged_idx, value.values()))
            if value.lengths() is not None:
                out.append((key, KIND_LENGTHS, 0, value.lengths()))
            out.append((key, KIND_OFFSETS, 0, value.offsets()))
        else:
            out.append((key, KIND_DENSE, 0, value))
    return out


def _flat_dense_parts(batch) -> list[Part] | None:
    """``message_parts`` of a TensorDict whose every entry is a plain dense tensor at the top
    level (an RL batch as verl and ROLL build it), read from its key->tensor dict; None for
    anything else (nested TensorDicts, jagged or strided nested tensors, non-tensor leaves,
    tensor subclasses, other TensorDict types), which takes the general walk. The result is
    the general walk's (a property test holds them equal), at a fraction of its cost:
    tensordict's generic iteration is most of the leader's Python per call for a flat batch,
    and every microsecond of Python on a rank costs several of wall time when ranks share
    cores."""
    if type(batch) is not TensorDict:
        return None
    entries = getattr(batch, "_tensordict", None)
    if type(entries) is not dict:
        return None
    out: list[Part] = []
    for key, value in entries.items():
        if type(value) is not torch.Tensor or value.is_nested or type(key) is not str:
            return None
        out.append(((key,), KIND_DENSE, 0, value))
    return out


def encode_non_tensor(non_tensor_batch: dict[str, np.ndarray]) -> bytes:
    """The non_tensor_batch blob: one pickle of the dict, with every 1-D object array (the
    prompts, uids and per-sample dicts RL frameworks carry) as the list of its elements.
    Pickling an object ndarray goes through numpy's reduce machinery, a fixed cost that
    dominated small batches; a list pickles in C, element by element, the same objects."""
    return pickle.dumps(
        {
            k: a.tolist() if type(a) is np.ndarray and a.dtype == object and a.ndim == 1 else a
            for k, a in non_tensor_batch.items()
        },
        protocol=pickle.HIGHEST_PROTOCOL,
    )


def decode_non_tensor(raw) -> dict[str, np.ndarray]:
    """``encode_non_tensor`` undone (``raw``: any bytes-like object, read in place): a list
    becomes a 1-D object array holding exactly its elements (``fromiter`` never reads a
    list-valued element as another dimension, as ``np.array`` would)."""
    out = pickle.loads(raw)
    for k, v in out.items():
        if type(v) is list:
            out[k] = np.fromiter(v, dtype=object, count=len(v))
    return out


def layout_entries(
    batch: TensorDict,
    rank: int = 0,
    non_tensor_nbytes: int | None = None,
    direct: frozenset[int] = frozenset(),
    parts: list[Part] | None = None,
) -> tuple[list[Entry], int, tuple[int, int] | None]:
    """Offsets for every part (``message_parts``) and the optional non-tensor blob; returns
    (entries, data_bytes, non_tensor span). Parts whose index is in ``direct`` get offset
    DIRECT and no space."""
    entries: list[Entry] = []
    offset = 0
    parts = message_parts(batch, rank) if parts is None else parts
    for i, (key, kind, aux, t) in enumerate(parts):
        dtype_code(t.dtype, key if len(key) > 1 else key[0], rank)
        n = nbytes_of(t)
        if i in direct:
            entries.append(Entry(key, t.dtype, tuple(t.shape), DIRECT, n, kind, aux))
            continue
        entries.append(Entry(key, t.dtype, tuple(t.shape), offset, n, kind, aux))
        offset = align(offset + n)
    span = None
    if non_tensor_nbytes is not None:
        span = (offset, non_tensor_nbytes)
        offset = align(offset + non_tensor_nbytes)
    return entries, offset, span


def encode_header(
    batch_size: tuple[int, ...],
    entries: list[Entry],
    data_bytes: int,
    non_tensor: tuple[int, int] | None,
    next_expect: int = 0,
) -> bytes:
    body = bytearray()
    body += struct.pack("<B", len(batch_size))
    body += struct.pack(f"<{len(batch_size)}Q", *batch_size)
    body += struct.pack("<I", len(entries))
    for e in entries:
        body += struct.pack("<B", len(e.key))
        for part in e.key:
            raw = part.encode()
            body += struct.pack("<H", len(raw)) + raw
        body += struct.pack("<BBBB", e.kind, e.aux, DTYPE_CODE[e.dtype], len(e.shape))
        body += struct.pack(f"<{len(e.shape)}Q", *e.shape)
        body += struct.pack("<Q", e.offset)
    if non_tensor is not None:
        body += struct.pack("<QQ", *non_tensor)
    header_len = align(_PREFIX.size + len(body))
    flags = FLAG_NON_TENSOR if non_tensor is not None else 0
    prefix = _PREFIX.pack(MAGIC, VERSION, flags, header_len, data_bytes, next_expect)
    return (prefix + bytes(body)).ljust(header_len, b"\0")


def peek_total(prefix: bytes, max_bytes: int = DEFAULT_MAX_BYTES, rank: int = 0) -> int:
    """Header length + data bytes from the fixed prefix, validated before any allocation."""
    if len(prefix) < _PREFIX.size:
        raise HeaderError(f"rank {rank}: header truncated ({len(prefix)} < {_PREFIX.size} bytes)")
    magic, version, _, header_len, data_bytes, _ = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise HeaderError(f"rank {rank}: corrupt header (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise HeaderError(f"rank {rank}: header version {version}, expected {VERSION}")
    if header_len < _PREFIX.size or header_len % ALIGN:
        raise HeaderError(f"rank {rank}: corrupt header (header_len {header_len})")
    if data_bytes + header_len > max_bytes:
        raise HeaderError(
            f"rank {rank}: header claims {data_bytes + header_len} bytes, more than the "
            f"maximum this receiver accepts ({max_bytes} bytes; raise max_bytes to allow it)"
        )
    return header_len + data_bytes


def decode_header(raw: bytes, max_bytes: int = DEFAULT_MAX_BYTES, rank: int = 0) -> Header:
    """Parse and check a header; every inconsistency raises HeaderError naming the rank."""
    total = peek_total(raw, max_bytes, rank)
    _, _, flags, header_len, data_bytes, next_expect = _PREFIX.unpack_from(raw)
    if len(raw) < header_len:
        raise HeaderError(f"rank {rank}: header truncated ({len(raw)} < {header_len} bytes)")
    read = _HeaderReader(raw, header_len, rank)
    try:
        (bdim,) = read.take("<B")
        batch_size = read.take(f"<{bdim}Q")
        (n_keys,) = read.take("<I")
        if n_keys > MAX_KEYS:
            raise HeaderError(f"rank {rank}: corrupt header ({n_keys} keys > {MAX_KEYS})")
        entries = []
        direct_bytes = 0  # leaves that follow the message in broadcasts of their own
        for _ in range(n_keys):
            entry = _read_entry(read, batch_size, data_bytes)
            if entry.offset == DIRECT:
                direct_bytes += entry.nbytes
                if total + direct_bytes > max_bytes:
                    raise HeaderError(
                        f"rank {rank}: the message ({total} bytes) and its separately sent "
                        f"leaves ({direct_bytes} bytes so far) exceed max_bytes={max_bytes}"
                    )
            entries.append(entry)
        non_tensor = None
        if flags & FLAG_NON_TENSOR:
            non_tensor = read.take("<QQ")
            if non_tensor[0] + non_tensor[1] > data_bytes:
                raise HeaderError(f"rank {rank}: non-tensor blob runs past the data region")
    except (struct.error, UnicodeDecodeError) as exc:
        raise HeaderError(f"rank {rank}: corrupt header ({exc})") from exc
    assert total == header_len + data_bytes
    return Header(
        tuple(batch_size), tuple(entries), data_bytes, header_len, next_expect, non_tensor
    )


class _HeaderReader:
    """Reads a header's fields in order, never past its declared length."""

    def __init__(self, raw: bytes, header_len: int, rank: int) -> None:
        self.raw, self.header_len, self.rank = raw, header_len, rank
        self.pos = _PREFIX.size

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > self.header_len:
            raise HeaderError(
                f"rank {self.rank}: corrupt header (field runs past {self.header_len} bytes)"
            )
        out = struct.unpack_from(fmt, self.raw, self.pos)
        self.pos += size
        return out


def _read_entry(read: _HeaderReader, batch_size, data_bytes: int) -> Entry:
    """One leaf's entry: its key parts, kind, dtype, shape and offset, each checked."""
    rank = read.rank
    (n_parts,) = read.take("<B")
    parts = []
    for _ in range(n_parts):
        (n,) = read.take("<H")
        (raw_part,) = read.take(f"<{n}s")
        parts.append(raw_part.decode())
    key = tuple(parts)
    kind, aux, code, ndim = read.take("<BBBB")
    if kind >= len(KIND_NAMES):
        raise HeaderError(f"rank {rank}: batch[{key!r}] has unknown entry kind {kind}")
    if code >= len(DTYPES):
        raise HeaderError(f"rank {rank}: batch[{key!r}] has unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise HeaderError(f"rank {rank}: batch[{key!r}] claims {ndim} dims > {MAX_NDIM}")
    shape = read.take(f"<{ndim}Q")
    (offset,) = read.take("<Q")
    dtype = DTYPES[code]
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if offset != DIRECT and (offset % ALIGN or offset + nbytes > data_bytes):
        raise HeaderError(
            f"rank {rank}: batch[{key!r}] spans bytes {offset}..{offset + nbytes} of a "
            f"{data_bytes}-byte data region"
        )
    _check_entry_shape(key, kind, shape, batch_size, rank)
    return Entry(key, dtype, tuple(shape), offset, nbytes, kind, aux)


def _check_entry_shape(key, kind: int, shape, batch_size, rank: int) -> None:
    """A dense leaf leads with B; a jagged leaf's offsets hold B+1 values, its lengths B."""
    if not batch_size:
        return
    b = batch_size[0]
    want = {KIND_DENSE: b, KIND_OFFSETS: b + 1, KIND_LENGTHS: b}.get(kind)
    if want is not None and (not shape or shape[0] != want):
        what = "leading dim" if kind == KIND_DENSE else f"{KIND_NAMES[kind]} of length"
        raise HeaderError(
            f"rank {rank}: batch[{key!r}] has shape {list(shape)}; expected {what} "
            f"{'B' if want == b else 'B+1'}={want}"
        )


def pack(
    batch: TensorDict,
    non_tensor_batch: dict[str, np.ndarray] | None,
    out: torch.Tensor | None = None,
    next_expect: int = 0,
    min_capacity: int = 0,
    rank: int = 0,
    cache: dict | None = None,
) -> tuple[torch.Tensor, Header]:
    """Pack header + every leaf into one uint8 buffer (reusing ``out`` when large enough).

    Views and non-contiguous tensors copy only their own elements (never the parent storage).
    Returns the buffer (capacity may exceed the message; the message is buf[:total]).
    ``cache`` (a dict the caller keeps) remembers the layout and destination views of the
    last structure, so a steady stream of same-shaped batches skips that work.
    """
    out, header, fill = pack_deferred(
        batch, non_tensor_batch, out, next_expect, min_capacity, rank, cache
    )
    fill(header.total_bytes)
    return out, header


def pack_deferred(
    batch: TensorDict,
    non_tensor_batch: dict[str, np.ndarray] | None,
    out: torch.Tensor | None = None,
    next_expect: int | Callable[[int], int] = 0,
    min_capacity: int = 0,
    rank: int = 0,
    cache: dict | None = None,
    direct: frozenset[int] = frozenset(),
    parts: list[Part] | None = None,
    shape: tuple | None = None,
):
    """Like ``pack``, but only the header is written; returns (buffer, header, fill) where
    ``fill(upto)`` copies every leaf that starts before byte ``upto``, so a sender can put the
    first part of a large message on the wire while it packs the rest. A new buffer gets 1/4
    spare capacity, so slowly growing batches do not reallocate every call. Leaves whose index
    is in ``direct`` are described in the header but not packed (the caller sends them);
    ``parts`` are the batch's ``message_parts`` (and ``shape`` its ``structure``) when the
    caller has them already. ``next_expect`` may be a function of the message's total bytes
    (the wire's guess for the next call), so the cached header carries it.

    With a ``cache``, a buffer whose header bytes are already these is not written again:
    only the caller writes into the buffers it hands back in."""
    blob = None
    if non_tensor_batch is not None:
        blob = encode_non_tensor(non_tensor_batch)
    leaves = message_parts(batch, rank) if parts is None else parts
    cache = {} if cache is None else cache
    entries, tensor_end = _cached_layout(cache, batch, leaves, direct, rank, shape)
    span = None
    data_bytes = tensor_end
    if blob is not None:
        span = (tensor_end, len(blob))
        data_bytes = align(tensor_end + len(blob))
    raw, header_len, nxt = _cached_header(cache, batch, entries, data_bytes, span, next_expect)
    total = header_len + data_bytes
    device = batch.device if batch.device is not None else _leaf_device(leaves)
    capacity = max(total, min_capacity)
    if out is None or out.numel() < capacity or out.device != device:
        out = torch.empty(capacity + capacity // 4, dtype=torch.uint8, device=device)
    if cache.get("header_in") is not out:  # a buffer that holds these header bytes keeps them
        out[:header_len].copy_(raw)
        cache["header_in"] = out
    dst, src_index, starts = _cached_views(cache, out, entries, header_len)
    sources = [leaves[i][3] for i in src_index]
    blob_at = header_len + span[0] if blob is not None else total
    fill = _filler(out, dst, sources, starts, blob, blob_at)
    header = Header(tuple(batch.batch_size), tuple(entries), data_bytes, header_len, nxt, span)
    WORK["packed_bytes"] += total
    if blob is not None:
        WORK["pickled_bytes"] += len(blob)
    return out, header, fill


def structure(batch: TensorDict, parts: list[Part]) -> tuple:
    """What fixes a message's layout: the batch's type and size, and each part's key, kind,
    dtype, shape and device. Equal structures pack into equal headers. Each part's class and
    layout come last: they do not change the header, but a leaf of another kind (sparse, a
    subclass) with the same dtype and shape is a new structure, which the leader validates."""
    return (
        type(batch),
        tuple(batch.batch_size),
        tuple(
            (k, kind, aux, t.dtype, t.shape, t.device, type(t), t.layout)
            for k, kind, aux, t in parts
        ),
    )


def _cached_header(cache: dict, batch, entries, data_bytes: int, span, next_expect):
    """(raw header bytes as a uint8 tensor, its length, the next_expect it carries), encoded
    again only when the sizes change; ``next_expect`` may be a function of the message's
    total bytes. A new next_expect patches the cached bytes and marks every buffer stale."""
    raw_key = (data_bytes, span)
    if cache.get("raw_key") != raw_key:  # same structure and sizes: the same header bytes
        raw = encode_header(tuple(batch.batch_size), entries, data_bytes, span, 0)
        raw = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        cache.update(raw_key=raw_key, raw=raw, stamped=0, header_in=None)
    raw = cache["raw"]
    nxt = next_expect(len(raw) + data_bytes) if callable(next_expect) else next_expect
    if cache["stamped"] != nxt:
        stamp_next_expect(raw, nxt)
        cache.update(stamped=nxt, header_in=None)
    return raw, len(raw), nxt


def stamp_next_expect(buf: torch.Tensor, value: int) -> None:
    """Write ``value`` into the next_expect field of the header at the front of ``buf``."""
    raw = torch.frombuffer(bytearray(struct.pack("<Q", value)), dtype=torch.uint8)
    buf[NEXT_EXPECT_OFFSET : NEXT_EXPECT_OFFSET + 8].copy_(raw)


def _cached_layout(cache: dict, batch: TensorDict, leaves, direct, rank: int, shape=None):
    """(entries, end of the tensor region): laid out again only when the structure changes
    (``shape``: the batch's ``structure``, when the caller has it already)."""
    signature = (structure(batch, leaves) if shape is None else shape, direct)
    if cache.get("signature") != signature:
        entries, tensor_end, _ = layout_entries(batch, rank, None, direct, leaves)
        cache.clear()
        cache.update(signature=signature, entries=entries, tensor_end=tensor_end)
    return cache["entries"], cache["tensor_end"]


def _cached_views(cache: dict, out: torch.Tensor, entries, header_len: int):
    """Destination views of every packed entry in ``out`` (made again only for a new buffer
    or header length), the entries' indices and their start bytes."""
    views_key = (out.data_ptr(), header_len)
    if cache.get("views_key") != views_key:
        dst, src_index, starts = [], [], []
        for i, e in enumerate(entries):
            if e.nbytes and e.offset != DIRECT:
                start = header_len + e.offset
                dst.append(out[start : start + e.nbytes].view(e.dtype).view(e.shape))
                src_index.append(i)
                starts.append(start)
        cache.update(views_key=views_key, dst=dst, src_index=src_index, starts=starts)
    return cache["dst"], cache["src_index"], cache["starts"]


def _filler(out: torch.Tensor, dst, sources, starts, blob: bytes | None, blob_at: int):
    """``fill(upto)``: copy every leaf (and the blob) that starts before byte ``upto`` and is
    not copied yet."""
    done = 0
    blob_done = blob is None

    def fill(upto: int) -> None:
        nonlocal done, blob_done
        end = done
        while end < len(dst) and starts[end] < upto:
            end += 1
        if end > done:
            # One C++ call for these copies; non-contiguous sources copy only their elements.
            torch._foreach_copy_(dst[done:end], sources[done:end])
            done = end
        if not blob_done and blob_at < upto:
            if out.device.type == "cpu":  # straight from the bytes: no tensor made of them
                out.numpy()[blob_at : blob_at + len(blob)] = np.frombuffer(blob, np.uint8)
            else:
                out[blob_at : blob_at + len(blob)].copy_(
                    torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                )
            blob_done = True

    return fill


def _leaf_device(parts: list[Part]) -> torch.device:
    for *_, t in parts:
        return t.device
    return torch.device("cpu")


def _assemble(entry: Entry, t: torch.Tensor, pending: dict):
    """The leaf an entry completes, or None while a jagged leaf still waits for its offsets
    (its last part); ``pending`` keeps its parts meanwhile."""
    if entry.kind == KIND_DENSE:
        return t
    if entry.kind == KIND_OBJECT:
        WORK["unpickled_bytes"] += entry.nbytes
        return pickle.loads(t.cpu().numpy().tobytes())
    pending[entry.kind] = t
    if entry.kind == KIND_VALUES:
        pending["ragged"] = entry.aux
    if entry.kind != KIND_OFFSETS:
        return None
    return _jagged(pending)


def _jagged(pending: dict) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(
        pending[KIND_VALUES],
        pending[KIND_OFFSETS],
        lengths=pending.get(KIND_LENGTHS),
        jagged_dim=pending["ragged"],
    )


def unpack(
    buf: torch.Tensor,
    header: Header,
    td_device: torch.device | None = None,
    direct: list[torch.Tensor] = (),
) -> tuple[TensorDict, dict[str, np.ndarray] | None]:
    """Zero-copy views of every tensor in ``buf``; the non-tensor blob is unpickled. Entries
    at offset DIRECT take the tensors in ``direct``, in order."""
    data = buf[header.header_len : header.total_bytes]
    views = _views(data, header)
    received = iter(direct)
    nested: dict = {}
    flat = True
    jagged: dict = {}  # key -> parts of a jagged leaf seen so far
    for e, t in zip(header.entries, views):
        if t is None:
            t = next(received)
        node = nested
        for part in e.key[:-1]:
            node = node.setdefault(part, {})
            flat = False
        if e.kind != KIND_DENSE:
            flat = False
            t = _assemble(e, t, jagged.setdefault(e.key, {}))
            if t is None:
                continue
        node[e.key[-1]] = t
    if flat and td_device is None:
        # The header was validated above: skip TensorDict's per-key checks, the slow part.
        td = TensorDict._new_unsafe(nested, batch_size=torch.Size(header.batch_size))
    else:
        td = TensorDict(nested, batch_size=list(header.batch_size), device=td_device)
    non_tensor = None
    if header.non_tensor is not None:
        off, n = header.non_tensor
        blob = data[off : off + n]
        raw = blob.numpy() if blob.device.type == "cpu" else blob.cpu().numpy()
        non_tensor = decode_non_tensor(raw)
        WORK["unpickled_bytes"] += n
    return td, non_tensor


def _views(data: torch.Tensor, header: Header) -> list[torch.Tensor | None]:
    """Every packed entry as a view of ``data`` (None for entries sent on their own): one
    typed view of the region per dtype, then one ``as_strided`` per entry. Offsets are
    64-byte aligned and the region's length too, so every dtype divides both."""
    typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
    out: list[torch.Tensor | None] = []
    for dtype, shape, strides, offset in _view_plan(header):
        if dtype is None:
            out.append(None)
            continue
        base = typed.get(dtype)
        if base is None:
            view = data.view(dtype)
            base = typed[dtype] = (view, view.storage_offset())
        out.append(base[0].as_strided(shape, strides, base[1] + offset))
    return out


def _view_plan(header: Header) -> list[tuple]:
    """Per entry: (dtype, shape, contiguous strides, offset in elements), or Nones for an
    entry sent on its own; cached for the header that is live (one at a time in steady
    state, where ``read_header`` hands back the same Header object every call)."""
    cached = _PLANS.get(id(header))
    if cached is not None and cached[0] is header:
        return cached[1]
    plan = []
    for e in header.entries:
        if e.offset == DIRECT:
            plan.append((None, None, None, None))
            continue
        strides, step = [], 1
        for d in reversed(e.shape):
            strides.append(step)
            step *= max(d, 1)
        plan.append(
            (e.dtype, tuple(e.shape), tuple(reversed(strides)), e.offset // ITEMSIZE[e.dtype])
        )
    _PLANS.clear()
    _PLANS[id(header)] = (header, plan)
    return plan


_PLANS: dict = {}


def read_header(
    buf: torch.Tensor,
    max_bytes: int,
    rank: int,
    cache: dict | None = None,
    prefix: bytes | None = None,
) -> Header:
    """Decode the header at the front of a (possibly CUDA) buffer; ``prefix``: its first
    PREFIX_BYTES, when the caller has read them and checked them with ``peek_total``."""
    if prefix is None:
        prefix = host_bytes(buf, _PREFIX.size)
        peek_total(prefix, max_bytes, rank)
    header_len = _PREFIX.unpack_from(prefix)[3]
    if header_len > buf.numel():
        raise HeaderError(
            f"rank {rank}: header of {header_len} bytes does not fit the {buf.numel()}-byte message"
        )
    raw = host_bytes(buf, header_len)
    if cache is not None:
        # Steady state: the same structure every call, so the same header bytes.
        hit = cache.get(raw)
        if hit is not None:
            return hit
        cache.clear()
        cache[raw] = decode_header(raw, max_bytes, rank)
        return cache[raw]
    return decode_header(raw, max_bytes, rank)


def host_bytes(buf: torch.Tensor, n: int) -> bytes:
    """The first ``n`` bytes of a uint8 buffer as ``bytes`` (a CPU buffer is read in place)."""
    if buf.device.type == "cpu":
        return buf.numpy()[:n].tobytes()
    return buf[:n].cpu().numpy().tobytes()


PREFIX_BYTES = _PREFIX.size
