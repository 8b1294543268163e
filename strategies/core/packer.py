"""Packing a batch into one message: where each part goes (``layout_entries``) and a ``Packer``
that owns the leader's send buffer and what it remembers of the last batch's layout.

Views and non-contiguous tensors copy only their own elements (never the parent storage). The
buffer's capacity may exceed the message; the message is ``buffer[:header.total_bytes]``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

import numpy as np
import torch
from tensordict import TensorDict

from strategies.core.header_format import (
    DIRECT,
    Entry,
    Header,
    align,
    dtype_code,
    encode_header,
    stamp_next_expect,
)
from strategies.core.parts import (
    Part,
    blob_room,
    encode_non_tensor,
    message_parts,
    nbytes_of,
    structure,
)
from strategies.core.phase_clock import CLOCK
from strategies.core.recent import remember
from strategies.core.trace import WORK

RECENT_PACKS = 4
"""A held buffer is sized for the largest of this many recent messages, not the largest ever."""
NO_DIRECT = frozenset()
"""No leaf travels on its own (every leaf is in the message)."""
SHRINK_ABOVE = 2
"""A held buffer more than this many times the largest recent need is released and made again
at the size of the one being packed: peak memory follows the recent batches."""


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


def pack(
    batch: TensorDict,
    non_tensor_batch: dict[str, np.ndarray] | None,
    out: torch.Tensor | None = None,
    next_expect: int = 0,
    min_capacity: int = 0,
    rank: int = 0,
) -> tuple[torch.Tensor, Header]:
    """Pack header + every leaf into one uint8 buffer (reusing ``out`` when large enough);
    returns the buffer and the header. A one-off ``Packer``: nothing is remembered."""
    out, header, fill = Packer(out).pack(batch, non_tensor_batch, next_expect, min_capacity, rank)
    fill(header.total_bytes)
    return out, header


@dataclass(eq=False)
class _Layout:
    """Where a batch structure's entries go (fixed by its ``structure`` and direct leaves), and
    what was made from it: its encoded headers and its destination views in the buffer."""

    signature: tuple
    entries: list[Entry]
    tensor_end: int  # end of the tensor region, before the non-tensor blob
    headers: dict = field(default_factory=dict)
    """(data bytes, non-tensor span) -> ``_HeaderBytes``, the recent ones."""
    views: dict = field(default_factory=dict)
    """(buffer's data_ptr, header length) -> ``_Views`` in the packer's current buffer."""


@dataclass(eq=False)
class _HeaderBytes:
    """The encoded header of one layout and message size, with the next_expect it carries."""

    sizes: tuple  # (data_bytes, non-tensor span)
    raw: torch.Tensor
    stamped: int = 0
    header: Header | None = None
    """The decoded ``Header`` these bytes stand for, made once per next_expect stamped."""

    def decoded(self, layout: _Layout, batch, header_len: int) -> Header:
        """``header``, made anew only when the stamp changed (the layout's structure fixes the
        batch size, ``sizes`` the data bytes and the span)."""
        if self.header is None or self.header.next_expect != self.stamped:
            data_bytes, span = self.sizes
            self.header = Header(tuple(batch.batch_size), tuple(layout.entries), data_bytes,
                                 header_len, self.stamped, span)  # fmt: skip
        return self.header


@dataclass(frozen=True)
class _Views:
    """Destination views of every packed entry in one buffer at one header length."""

    dst: list[torch.Tensor]
    src_index: list[int]  # the entry (and part) each view is for
    starts: list[int]  # its first byte in the buffer


@dataclass(eq=False)
class _Replay:
    """What the last pack of a structure made, to pack the next batch of the same structure
    and blob room into the same buffer without looking anything up again (``Packer.pack``):
    the header is in the buffer already, the destination views are made."""

    shape: tuple | None
    direct: frozenset[int]
    room: int | None
    """The non-tensor blob's room (None: no blob)."""
    out: torch.Tensor
    host: memoryview | None
    """The buffer's bytes, on the host (None on a device)."""
    total: int
    held: _HeaderBytes
    """The header's bytes (written into the buffer again when another pack wrote its own)."""
    header: Header
    views: _Views
    blob_at: int


class Packer:
    """The leader's send buffer and what stays the same between batches of one structure.

    Batches of a structure seen recently (``RECENT_SHAPES``) reuse its layout, encoded header
    and destination views, and header bytes a buffer already holds are not written again: only
    the packer writes into its buffer.
    """

    def __init__(
        self,
        buffer: torch.Tensor | None = None,
        allocate: Callable[[int, torch.device], torch.Tensor] | None = None,
    ) -> None:
        self.buffer = buffer
        self.allocate = allocate or _empty
        """Makes a new buffer of (capacity, device): torch.empty, or a shared segment (shm)."""
        self._layouts: dict[tuple, _Layout] = {}  # signature -> layout, the recent ones
        self._header_in: tuple | None = None  # (buffer, header bytes, stamp) it holds
        self._replays: dict[int, _Replay] = {}
        """id(structure) -> the last pack of that structure object, the recent ones. Keyed by
        identity (``PackedStrategy.checked_parts`` hands out one object per structure): no
        hash of a structure per call, and the record holds its structure, so no other object
        can take its id while it is kept."""
        self.recent_needs: deque[int] = deque(maxlen=RECENT_PACKS)  # bytes each pack needed
        self.replays_done = 0
        """Packs that replayed an earlier one (``replay``)."""

    def pack(
        self,
        batch: TensorDict,
        non_tensor_batch: dict[str, np.ndarray] | None,
        next_expect: int | Callable[[int], int] = 0,
        min_capacity: int | Callable[[int], int] = 0,
        rank: int = 0,
        direct: frozenset[int] = frozenset(),
        parts: list[Part] | None = None,
        shape: tuple | None = None,
        blob: bytes | None = None,
    ) -> tuple[torch.Tensor, Header, Filler]:
        """Write the header only; returns (buffer, header, fill) where ``fill(upto)`` copies
        every leaf that starts before byte ``upto``, so a sender can put the first part of a
        large message on the wire while it packs the rest. Leaves whose index is in ``direct``
        are described in the header but not packed (the caller sends them); ``parts`` are the
        batch's ``message_parts`` (and ``shape`` its ``structure``) when the caller has them
        already. ``next_expect`` may be a function of the message's total bytes (the wire's
        guess for the next call), so the remembered header carries it, and ``min_capacity``
        too (the room a caller needs past the message). ``blob``: ``non_tensor_batch`` encoded
        already (``parts.encode_non_tensor``), when the caller has it."""
        if blob is None and non_tensor_batch is not None:
            blob = encode_non_tensor(non_tensor_batch)
        parts = message_parts(batch, rank) if parts is None else parts
        device = batch.device if batch.device is not None else _leaf_device(parts)
        last = self.replay(shape, direct, blob, next_expect, min_capacity, device)
        if last is not None:
            return last.out, last.header, self.filler(last, parts, blob)
        return self._pack_anew(
            batch, parts, blob, device, direct, rank, shape,
            next_expect=next_expect, min_capacity=min_capacity,
        )  # fmt: skip

    def replay(
        self,
        shape: tuple | None,
        direct: frozenset[int],
        blob: bytes | None,
        next_expect: int | Callable[[int], int],
        min_capacity: int | Callable[[int], int],
        device: torch.device,
    ) -> _Replay | None:
        """The last pack of the structure object ``shape`` into this buffer, when this message
        is laid out as it was (the same ``direct`` leaves and blob room), still fits the buffer
        (``_keeps``: the growth and shrink rules of ``_room_for`` hold) and carries the same
        stamp: its views are made and its header is encoded (and rewritten only where another
        structure's pack wrote its own), so only the leaves and the blob are left to copy.
        None otherwise (nothing written). Counts the message as packed when it hands the
        record out: the caller copies the leaves and the blob next."""
        last = self._replays.get(id(shape))
        if (
            last is None
            or last.shape is not shape
            or last.direct != direct
            or last.room != (None if blob is None else blob_room(len(blob)))
        ):
            return None
        out, capacity = self.buffer, _capacity(last.total, min_capacity)
        if out is not last.out or not self._keeps(out, capacity, device):
            return None
        nxt = next_expect(last.total) if callable(next_expect) else next_expect
        held = last.held
        if nxt != held.stamped or nxt != last.header.next_expect:
            return None
        self.recent_needs.append(capacity)
        written = self._header_in
        if written is None or written[0] is not out or written[1] is not held or written[2] != nxt:
            out[: held.raw.numel()].copy_(held.raw)  # another structure's pack wrote its own
            self._header_in = (out, held, nxt)
        WORK["packed_bytes"] += last.total
        if blob is not None:
            WORK["pickled_bytes"] += len(blob)
        self.replays_done += 1
        return last

    def _pack_anew(
        self,
        batch: TensorDict,
        parts: list[Part],
        blob: bytes | None,
        device: torch.device,
        direct: frozenset[int],
        rank: int,
        shape: tuple | None,
        *,
        next_expect: int | Callable[[int], int],
        min_capacity: int | Callable[[int], int],
    ) -> tuple[torch.Tensor, Header, Filler]:
        """``pack`` of a batch ``replay`` does not cover: the layout, header and views of its
        structure (made once while recent), the header written where the buffer does not hold
        it."""
        layout = self._laid_out(batch, parts, direct, rank, shape)
        span = None
        data_bytes = layout.tensor_end
        if blob is not None:
            span = (layout.tensor_end, blob_room(len(blob)))  # the room: see blob_room
            data_bytes = align(layout.tensor_end + span[1])
        held = self._encoded(batch, layout, data_bytes, span, next_expect)
        raw, nxt = held.raw, held.stamped
        header_len = raw.numel()
        total = header_len + data_bytes
        out = self._room_for(_capacity(total, min_capacity), device)
        written = self._header_in
        if written is None or written[0] is not out or written[1] is not held or written[2] != nxt:
            out[:header_len].copy_(raw)  # a buffer that holds these header bytes keeps them
            self._header_in = (out, held, nxt)
        views = self._views_in(out, layout, header_len)
        host = memoryview(out.numpy()) if out.device.type == "cpu" else None
        blob_at = header_len + span[0] if blob is not None else total
        header = held.decoded(layout, batch, header_len)
        # The record holds the caller's own structure object, the one its id keys (an equal
        # object the layout was first made from would never match ``replay``'s identity test).
        last = _Replay(shape, direct, span and span[1], out, host, total, held, header, views,
                       blob_at)  # fmt: skip
        if shape is not None:  # no structure object: nothing a later call could name
            remember(self._replays, id(shape), last)
        WORK["packed_bytes"] += total
        if blob is not None:
            WORK["pickled_bytes"] += len(blob)
        return out, header, self.filler(last, parts, blob)

    def filler(self, last: _Replay, parts: list[Part], blob: bytes | None) -> Filler:
        """The ``Filler`` of a message laid out as ``last`` with this batch's leaves and blob."""
        sources = [parts[i][3] for i in last.views.src_index]
        return Filler(last.out, last.views.dst, sources, last.views.starts, blob, last.blob_at,
                      last.room, last.host)  # fmt: skip

    def forget(self) -> None:
        """Drop the buffer and everything cached about it (its owner took it back)."""
        self.buffer = self._header_in = None
        self._replays.clear()
        for layout in self._layouts.values():
            layout.views.clear()

    def _room_for(self, capacity: int, device: torch.device) -> torch.Tensor:
        """The buffer, reallocated unless it ``_keeps`` a message of ``capacity`` bytes; a new
        buffer gets 1/4 spare capacity, so slowly growing batches do not reallocate every
        call."""
        out = self.buffer
        kept = out is not None and self._keeps(out, capacity, device)
        self.recent_needs.append(capacity)
        if not kept:
            # Released before the new one is made (views of it included): one at a time.
            out = None
            self.forget()
            out = self.allocate(capacity + capacity // 4, device)
            self.buffer = out
        return out

    def _keeps(self, out: torch.Tensor, capacity: int, device: torch.device) -> bool:
        """Whether ``out`` takes the next message of ``capacity`` bytes: large enough, on
        ``device``, and, once it has been held across a pack (a buffer handed in is used as it
        is), not more than ``SHRINK_ABOVE`` times the largest of the recent needs
        (``RECENT_PACKS``, this one included)."""
        if out.numel() < capacity or out.device != device:
            return False
        needs = self.recent_needs
        if not needs:
            return True
        window = islice(needs, 1 if len(needs) == needs.maxlen else 0, None)  # this one joins
        return out.numel() <= SHRINK_ABOVE * max(capacity, max(window, default=0))

    def _laid_out(self, batch, parts: list[Part], direct, rank: int, shape) -> _Layout:
        """The layout of this structure (``shape``: the batch's ``structure``, when the caller
        has it already), made once while it is among the recent ones."""
        signature = (structure(batch, parts) if shape is None else shape, direct)
        layout = self._layouts.get(signature)
        if layout is None:
            entries, tensor_end, _ = layout_entries(batch, rank, None, direct, parts)
            layout = _Layout(signature, entries, tensor_end)
        remember(self._layouts, signature, layout)
        return layout

    def _encoded(self, batch, layout: _Layout, data_bytes: int, span, next_expect) -> _HeaderBytes:
        """The layout's header for these sizes, encoded once while it is recent, with the
        next_expect it carries (a new one patches the bytes in place)."""
        sizes = (data_bytes, span)
        held = layout.headers.get(sizes)
        if held is None:
            raw = encode_header(tuple(batch.batch_size), layout.entries, data_bytes, span, 0)
            held = _HeaderBytes(sizes, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            remember(layout.headers, sizes, held)
        nxt = next_expect(held.raw.numel() + data_bytes) if callable(next_expect) else next_expect
        if held.stamped != nxt:
            stamp_next_expect(held.raw, nxt)
            held.stamped = nxt
        return held

    def _views_in(self, out: torch.Tensor, layout: _Layout, header_len: int) -> _Views:
        """Destination views of every packed entry of ``layout`` in ``out`` (the current
        buffer: ``forget`` drops them with it), made once per layout and header length."""
        key = (out.data_ptr(), header_len)
        views = layout.views.get(key)
        if views is None:
            dst, src_index, starts = [], [], []
            for i, e in enumerate(layout.entries):
                if e.nbytes and e.offset != DIRECT:
                    start = header_len + e.offset
                    dst.append(out[start : start + e.nbytes].view(e.dtype).view(e.shape))
                    src_index.append(i)
                    starts.append(start)
            views = _Views(dst, src_index, starts)
            remember(layout.views, key, views)
        return views


class Filler:
    """``fill(upto)``: copy every leaf (and the blob) that starts before byte ``upto`` and is
    not copied yet; ``fill.blob()`` writes the non-tensor blob now, ahead of the leaves (a
    reader can decode it while they are copied). The blob's room past its own bytes
    (``parts.blob_room``) is zeroed: nothing of an earlier message or of the allocator's
    memory travels in it."""

    def __init__(
        self, out: torch.Tensor, dst, sources, starts, blob: bytes | None, blob_at: int, room=0,
        host: memoryview | None = None,
    ):  # fmt: skip
        self.out, self.dst, self.sources, self.starts = out, dst, sources, starts
        self._blob, self.blob_at, self.room = blob, blob_at, room or 0
        self.host = host
        """``out``'s bytes when it is in host memory (the blob is written through it)."""
        self.done = 0  # leaves copied so far, in order

    def __call__(self, upto: int) -> None:
        before = CLOCK.switch("copy")
        try:
            end = max(self.done, bisect_left(self.starts, upto))  # the leaves before upto
            if end > self.done:
                # One C++ call for these copies; non-contiguous sources copy only their elements.
                torch._foreach_copy_(self.dst[self.done : end], self.sources[self.done : end])
                self.done = end
            if self._blob is not None and self.blob_at < upto:
                self.blob()
        finally:  # a failed copy: what follows (shipping the failure) is not copying
            CLOCK.switch(before)

    def blob(self) -> None:
        blob, self._blob = self._blob, None
        if blob is None:
            return
        before = CLOCK.switch("copy")
        try:
            write_blob(self.out, self.host, self.blob_at, blob, self.room)
        finally:
            CLOCK.switch(before)


def write_blob(out: torch.Tensor, host: memoryview | None, at: int, blob: bytes, room: int) -> None:
    """The non-tensor blob into ``out`` at byte ``at``, and zeros over the rest of its
    ``room`` (``parts.blob_room``): nothing of an earlier message or of the allocator's memory
    travels in it. On the host through ``host`` (``out``'s bytes, when the caller has them):
    straight from the bytes, no tensor or array made of them."""
    end = at + len(blob)
    stop = max(end, at + room)
    if out.device.type != "cpu":
        out[at:end].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        out[end:stop].zero_()
        return
    host = host if host is not None else memoryview(out.numpy())
    host[at:end] = blob
    if stop - end <= len(_ZEROS):
        host[end:stop] = _ZEROS[: stop - end]
    else:
        out[end:stop].zero_()


_ZEROS = memoryview(bytes(4096))
"""Zeros for a blob's room past its bytes (larger rooms are zeroed by torch)."""


def _capacity(total: int, min_capacity: int | Callable[[int], int]) -> int:
    """The room a message of ``total`` bytes needs: itself, or the caller's minimum past it."""
    return max(total, min_capacity(total) if callable(min_capacity) else min_capacity)


def _empty(capacity: int, device: torch.device) -> torch.Tensor:
    return torch.empty(capacity, dtype=torch.uint8, device=device)


def _leaf_device(parts: list[Part]) -> torch.device:
    for *_, t in parts:
        return t.device
    return torch.device("cpu")
