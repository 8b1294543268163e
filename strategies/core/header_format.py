"""The message header's byte format: its fixed prefix, its entries, and the one reader of it.

A message is one uint8 buffer: a binary header (batch size, then per entry its key, kind,
dtype, shape and offset; no pickle of tensor data) followed by the data region, every entry at
a 64-byte-aligned offset. ``encode_header`` writes it; ``read_prefix`` checks the fixed prefix
(sizes, before any allocation) and ``read_header`` decodes the whole header from a (possibly
CUDA) buffer; every strategy that receives a header reads it through these two. Anything
corrupt, unsupported or larger than the receiver accepts raises ``HeaderError`` naming the rank.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from strategies.core.recent import remember

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


@dataclass(frozen=True)
class Prefix:
    """The header's fixed first ``PREFIX_BYTES``, checked: what a receiver sizes buffers by."""

    flags: int
    header_len: int
    data_bytes: int
    next_expect: int

    @property
    def total_bytes(self) -> int:
        return self.header_len + self.data_bytes


def parse_prefix(prefix: bytes, max_bytes: int = DEFAULT_MAX_BYTES, rank: int = 0) -> Prefix:
    """The fixed prefix of a header, validated before any allocation."""
    if len(prefix) < _PREFIX.size:
        raise HeaderError(f"rank {rank}: header truncated ({len(prefix)} < {_PREFIX.size} bytes)")
    magic, version, flags, header_len, data_bytes, next_expect = _PREFIX.unpack_from(prefix)
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
    return Prefix(flags, header_len, data_bytes, next_expect)


def peek_total(prefix: bytes, max_bytes: int = DEFAULT_MAX_BYTES, rank: int = 0) -> int:
    """Header length + data bytes from the fixed prefix, validated before any allocation."""
    return parse_prefix(prefix, max_bytes, rank).total_bytes


def read_prefix(buf: torch.Tensor, max_bytes: int, rank: int) -> Prefix:
    """The checked prefix of the header at the front of a (possibly CUDA) uint8 buffer."""
    return parse_prefix(host_bytes(buf, _PREFIX.size), max_bytes, rank)


def decode_header(raw: bytes, max_bytes: int = DEFAULT_MAX_BYTES, rank: int = 0) -> Header:
    """Parse and check a header; every inconsistency raises HeaderError naming the rank."""
    prefix = parse_prefix(raw, max_bytes, rank)
    total = prefix.total_bytes
    flags, header_len, data_bytes = prefix.flags, prefix.header_len, prefix.data_bytes
    if len(raw) < header_len:
        raise HeaderError(f"rank {rank}: header truncated ({len(raw)} < {header_len} bytes)")
    read = _Fields(raw, header_len, rank)
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
        tuple(batch_size), tuple(entries), data_bytes, header_len, prefix.next_expect, non_tensor
    )


class _Fields:
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


def _read_entry(read: _Fields, batch_size, data_bytes: int) -> Entry:
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


def stamp_next_expect(buf: torch.Tensor, value: int) -> None:
    """Write ``value`` into the next_expect field of the header at the front of ``buf``."""
    raw = torch.frombuffer(bytearray(struct.pack("<Q", value)), dtype=torch.uint8)
    buf[NEXT_EXPECT_OFFSET : NEXT_EXPECT_OFFSET + 8].copy_(raw)


def read_header(
    buf: torch.Tensor,
    max_bytes: int,
    rank: int,
    cache: dict | None = None,
    prefix: Prefix | None = None,
) -> Header:
    """Decode the header at the front of a (possibly CUDA) buffer; ``prefix``: its
    ``read_prefix``, when the caller has it already. ``cache`` (a dict the caller keeps)
    holds the headers of the last ``RECENT_SHAPES`` shapes decoded, by their bytes: batches of
    a shape seen recently send the same header bytes again, and only those are ever returned
    from it."""
    return read_header_bytes(buf, max_bytes, rank, cache, prefix)[1]


def read_header_bytes(
    buf: torch.Tensor,
    max_bytes: int,
    rank: int,
    cache: dict | None = None,
    prefix: Prefix | None = None,
) -> tuple[bytes, Header]:
    """``read_header``, with the header's bytes as they arrived (a caller that keeps them
    reads them once)."""
    if prefix is None:
        prefix = read_prefix(buf, max_bytes, rank)
    header_len = prefix.header_len
    if header_len > buf.numel():
        raise HeaderError(
            f"rank {rank}: header of {header_len} bytes does not fit the {buf.numel()}-byte message"
        )
    raw = host_bytes(buf, header_len)
    if cache is None:
        return raw, decode_header(raw, max_bytes, rank)
    hit = cache.get(raw)
    if hit is None:
        hit = decode_header(raw, max_bytes, rank)
        remember(cache, raw, hit)
    return raw, hit


def host_bytes(buf: torch.Tensor, n: int) -> bytes:
    """The first ``n`` bytes of a uint8 buffer as ``bytes`` (a CPU buffer is read in place)."""
    if buf.device.type == "cpu":
        return buf.numpy()[:n].tobytes()
    return buf[:n].cpu().numpy().tobytes()


PREFIX_BYTES = _PREFIX.size
