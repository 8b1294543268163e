"""Moving one packed message (header + data) over a group in one broadcast in steady state.

Receivers cannot size a buffer before they know the message, which normally costs a separate
header broadcast. Here every rank instead posts a first broadcast of ``expect`` bytes, a size
all ranks agree on because it came in the previous call's header; the leader packs the header
and as much data as fits into it. A message that does not fit sends its remainder in a second
broadcast, sized from the header, and the header of every call tells all ranks the size to
expect next time: the smallest of the last ``RECENT_CALLS`` messages. A small batch within that
many calls of another small one posts the small size whatever came between, and a large one
after small ones pays one broadcast more, never a large first message; only a stream that had
settled on one large size (``RECENT_CALLS`` calls in a row) posts it for a small batch, once.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from strategies.core.header_format import (
    DEFAULT_MAX_BYTES,
    Header,
    read_header,
    read_prefix,
    stamp_next_expect,
)
from strategies.core.phase_clock import CLOCK

PAGE = 4096
# A first message this large goes out in SEGMENTS async broadcasts, so the leader packs
# segment i+1 while segment i is on the wire; below it, one broadcast costs less. Two, not
# more: gloo runs a group's collectives on two worker threads, so two segments keep both busy
# while more only queue, each paying its own round (the floor's chunks2 method shows the same).
PIPELINE_MIN_BYTES = 4 << 20
SEGMENTS = 2
RECENT_CALLS = 4
"""The first message is sized for the smallest of this many recent messages: a stream that
alternates shapes (long and short sequences, a small eval batch between training batches)
posts its small size, and a stream that settles on one shape posts that shape again within
this many calls."""


def segments(first: int) -> list[tuple[int, int]]:
    """Byte ranges of the first message's broadcasts; both sides derive them from ``first``."""
    if first < PIPELINE_MIN_BYTES:
        return [(0, first)]
    step = -(-first // SEGMENTS // PAGE) * PAGE
    return [(a, min(a + step, first)) for a in range(0, first, step)]


def check_initial_bytes(initial_bytes: int) -> None:
    """Refuse a first-message size smaller than one header page, naming it."""
    if initial_bytes < PAGE:
        raise ValueError(f"initial_bytes must be >= {PAGE} (one header page), got {initial_bytes}")


class Wire:
    """Per-rank state of the speculative protocol; one per strategy instance."""

    def __init__(
        self,
        device: torch.device,
        rank: int,
        initial_bytes: int = 64 << 10,
        eager_max_bytes: int = 256 << 20,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        check_initial_bytes(initial_bytes)
        self.device = device
        self.rank = rank
        self.initial_bytes = initial_bytes
        self.eager_max_bytes = eager_max_bytes
        self.max_bytes = max_bytes
        self.expect = initial_bytes
        self.recent: deque[int] = deque(maxlen=RECENT_CALLS)  # the last calls' message bytes
        self._next: tuple[int, int] = (-1, 0)  # (total, next_expect) of this call, once asked
        self._headers: dict = {}  # last decoded header, by its raw bytes

    def next_expect(self, total: int) -> int:
        """Leader's size for the next call's first message, from this message's ``total`` and
        the last ones': the smallest of the last ``RECENT_CALLS`` (``fits``). Pure: a replayed
        call computes the same value. A leader asks twice a call (the header, then ``agree``):
        the second answer is the first's."""
        last_total, last_next = self._next
        if total == last_total:
            return last_next
        window = (*self.recent, total)[-RECENT_CALLS:]
        nxt = min(self.fits(n) for n in window)
        self._next = (total, nxt)
        return nxt

    def fits(self, total: int) -> int:
        """The first message that holds a ``total``-byte message: plus 1/64 headroom (at most
        64 KiB), page-rounded. Every byte of headroom is sent each call, so it stays small; a
        batch that outgrows it costs one extra broadcast. Above ``eager_max_bytes``: the
        initial size (the rest follows, sized from the header)."""
        if total > self.eager_max_bytes:
            return self.initial_bytes
        guess = total + min(total // 64, 64 << 10)
        return max(self.initial_bytes, (guess + PAGE - 1) // PAGE * PAGE)

    def stamp(self, buf: torch.Tensor, total: int) -> None:
        """Write next_expect into a packed buffer's header (leader, before sending)."""
        stamp_next_expect(buf, self.next_expect(total))

    def send(self, buf: torch.Tensor, total: int, group, src: int, fill=None) -> None:
        """Source side; ``buf`` holds (or, with ``fill``, will hold) the message in [:total]
        and has capacity >= expect. ``fill(upto)`` packs the bytes before ``upto``."""
        first = self.expect
        parts = segments(first)
        handles = []
        before = CLOCK.switch("signal")  # a fill inside switches to the copy and back
        for a, b in parts:
            if fill is not None:
                fill(min(b, total))
            if len(parts) == 1:
                dist.broadcast(buf[a:b], src=src, group=group)
            else:
                handles.append(dist.broadcast(buf[a:b], src=src, group=group, async_op=True))
        for h in handles:
            h.wait()
        if total > first:
            if fill is not None:
                fill(total)
            dist.broadcast(buf[first:total], src=src, group=group)
        CLOCK.switch(before)

    def recv(self, group, src: int) -> tuple[torch.Tensor, Header]:
        """Receiver side; returns a buffer with capacity >= max(total, expect), so it can be
        forwarded on the next hop unchanged."""
        first = self.expect
        buf = torch.empty(first, dtype=torch.uint8, device=self.device)
        parts = segments(first)
        if len(parts) == 1:
            dist.broadcast(buf, src=src, group=group)
        else:
            handles = [
                dist.broadcast(buf[a:b], src=src, group=group, async_op=True) for a, b in parts
            ]
            for h in handles:
                h.wait()
        prefix = read_prefix(buf, self.max_bytes, self.rank)
        total = prefix.total_bytes
        if total > first:
            full = torch.empty(total, dtype=torch.uint8, device=self.device)
            full[:first].copy_(buf)
            dist.broadcast(full[first:total], src=src, group=group)
            buf = full
        return buf, read_header(buf, self.max_bytes, self.rank, self._headers, prefix)

    def finish(self, next_expect: int, total: int) -> None:
        """End of a call on every rank of the replica: remember this message's ``total`` and
        adopt the size the leader announced."""
        self.recent.append(total)
        self._next = (-1, 0)  # the window moved
        nxt = next_expect
        if nxt < PAGE or nxt > self.eager_max_bytes:
            nxt = self.initial_bytes
        self.expect = nxt
