"""Shared machinery of the header-based strategies: pack on the leader, move the message with
a ``Wire``, unpack as views. Not a strategy itself (no ``STRATEGY``).
"""

from __future__ import annotations

import torch

from strategies.base import ContractError, DataProto, Strategy
from strategies.codec import (
    DEFAULT_MAX_BYTES,
    Header,
    HeaderError,
    encode_error,
    pack_deferred,
    unpack,
)
from strategies.wire import Wire


class PackedStrategy(Strategy):
    """Options (all strategies built on it):

    - ``initial_bytes`` (64 KiB): first-message size before any call has announced one;
    - ``eager_max_bytes`` (256 MiB): largest first message a receiver will post;
    - ``max_bytes`` (16 GiB): receivers refuse a header that claims more than this.
    """

    def __init__(
        self,
        groups,
        initial_bytes: int = 64 << 10,
        eager_max_bytes: int = 256 << 20,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        super().__init__(groups)
        self.wire = Wire(groups.device, groups.rank, initial_bytes, eager_max_bytes, max_bytes)
        self._pack_buf: torch.Tensor | None = None  # leader's send buffer, reused across calls
        self._pack_cache: dict = {}  # layout + destination views of the last batch structure
        self._fill = None

    def pack(self, batch: DataProto) -> tuple[torch.Tensor, Header, int]:
        """Leader: pack into the reused buffer; returns (buffer, header, total bytes).

        A batch that breaks the contract becomes an error message instead, which travels the
        same hops, so every rank raises (``complete``) rather than waiting forever.
        """
        try:
            batch.validate(self.groups.rank)
            return self._pack(batch)
        except (ContractError, HeaderError) as exc:
            raw = encode_error(str(exc))
            size = max(len(raw), self.wire.expect)
            buf = torch.zeros(size, dtype=torch.uint8, device=self.groups.device)
            buf[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            self.wire.stamp(buf, len(raw))
            self._fill = None
            return buf, Header((), (), 0, len(raw), 0, None, error=str(exc)), len(raw)

    def relay(self, batch: DataProto, hops: list[tuple[object, tuple[int, ...]]]) -> DataProto:
        """The leader packs; each hop ``(group, ranks)`` this rank takes part in moves the
        message from ``ranks[0]`` to the rest of the group; receivers forward what they got
        unchanged on their next hop and unpack the last message they received."""
        g = self.groups
        if g.replica_ranks == (g.rank,):
            return batch
        buf, header, total = self.pack(batch) if g.is_leader else (None, None, 0)
        for group, ranks in hops:
            src = ranks[0]
            if g.rank == src:
                self.wire.send(buf, total, group, src, fill=self.take_fill())
            else:
                buf, header = self.wire.recv(group, src)
                total = header.total_bytes
        return self.complete(batch, buf, header, total)

    def complete(self, batch: DataProto, buf, header: Header, total: int) -> DataProto:
        """End of a call on every rank: agree on the next size, raise a refusal, or unpack."""
        g = self.groups
        self.wire.finish(self.wire.next_expect(total) if g.is_leader else header.next_expect)
        if header.error is not None:
            if g.is_leader:
                raise ContractError(header.error)
            raise ContractError(
                f"rank {g.rank}: the replica leader (rank {g.leader}) refused its batch: "
                f"{header.error}"
            )
        if not g.is_leader:
            self.finish_receiver(batch, buf, header)
        return batch

    def _pack(self, batch: DataProto) -> tuple[torch.Tensor, Header, int]:
        nt = batch.non_tensor_batch if batch.broadcast_non_tensor else None
        buf, header, self._fill = pack_deferred(
            batch.batch,
            nt,
            out=self._pack_buf,
            min_capacity=self.wire.expect,
            rank=self.groups.rank,
            cache=self._pack_cache,
        )
        self._pack_buf = buf
        self.wire.stamp(buf, header.total_bytes)
        return buf, header, header.total_bytes

    def take_fill(self):
        """The leader's pending ``fill`` (packing deferred into the first send), once."""
        fill, self._fill = self._fill, None
        return fill

    def finish_receiver(self, batch: DataProto, buf: torch.Tensor, header: Header) -> DataProto:
        td, non_tensor = unpack(buf, header, td_device=None)
        batch.batch = td
        if non_tensor is not None:
            batch.non_tensor_batch = non_tensor
        return batch
