"""Shared machinery of the header-based strategies: pack on the leader, move the message with
a ``Wire``, unpack as views. Not a strategy itself (no ``STRATEGY``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from strategies.core.contract import (
    PROTO_ATTRS,
    DataProto,
    check_non_tensor,
    deliver,
    is_lazy,
    validate,
    wants_non_tensor,
)
from strategies.core.header_format import (
    DEFAULT_MAX_BYTES,
    DIRECT,
    KIND_DENSE,
    Header,
    HeaderError,
)
from strategies.core.packer import Packer
from strategies.core.parts import (
    nbytes_of,
    parts_and_structure,
    transportable,
)
from strategies.core.phase_clock import CLOCK
from strategies.core.recent import remember
from strategies.core.strategy_base import Strategy
from strategies.core.unpacker import unpack
from strategies.core.wire import Wire, check_initial_bytes


class PackedStrategy(Strategy):
    """The header family's base. Options: ``Options``, those of every strategy built on it
    that broadcasts its message (a node store, whose message crosses no broadcast, has its own).

    A subclass that sets ``direct_min_bytes`` sends every contiguous leaf of at least that
    many bytes in a broadcast of its own, straight from the tensor, after the message on
    each hop (strategies/direct.py); the header still describes it.
    """

    @dataclass(frozen=True, kw_only=True)
    class Options(Strategy.Options):
        initial_bytes: int = 64 << 10
        """First-message size before any call has announced one (at least one header page)."""
        eager_max_bytes: int = 256 << 20
        """Largest first message a receiver will post."""
        max_bytes: int = DEFAULT_MAX_BYTES
        """Receivers refuse a header that claims more than this."""

        def __post_init__(self) -> None:
            super().__post_init__()
            check_initial_bytes(self.initial_bytes)

    direct_min_bytes: int | None = None
    phased = True

    def __init__(self, groups, **options) -> None:
        super().__init__(groups, **options)
        self.wire = self.new_wire()
        self.packer = Packer()  # leader: the send buffer and the last structure's layout
        self._fill = None
        self._direct: list[torch.Tensor] = []  # leader: the leaves that travel on their own
        self._valid: dict[tuple, tuple] = {}  # leader: recent valid structures, each its own key
        self._last_valid: tuple | None = None  # leader: the last of them
        self._checked: tuple | None = None  # leader: (td, parts, structure) leader_view saw
        self._encoded: tuple | None = None  # leader: (batch, its non-tensor blob), once encoded
        self.last_header: Header | None = None
        """The header of the last batch that arrived (on every rank alike; ``auto`` decides
        from it)."""

    def set_aside(self) -> None:
        self.packer.forget()  # the leader's send buffer: a batch's bytes, held for nothing

    def new_wire(self) -> Wire:
        """This instance's ``Wire``, from its options (a node store's message crosses no
        broadcast, so it takes ``max_bytes`` alone)."""
        o, g = self.options, self.groups
        return Wire(g.device, g.rank, o.initial_bytes, o.eager_max_bytes, o.max_bytes)

    def leader_view(self, batch: DataProto) -> DataProto:
        """Leader, before any collective: the contract's checks, cached per structure
        (``checked_parts``), and ``check``. The batch travels as it is: packing copies every
        leaf, which reads a lazy view's values (``direct_leaves`` keeps those in the pack)."""
        parts, shape = self.checked_parts(batch)
        self.check(batch)
        self._checked = (batch.batch, parts, shape)
        return batch

    def pack(
        self, batch: DataProto, into: Packer | None = None
    ) -> tuple[torch.Tensor, Header, int]:
        """Leader: pack into the reused buffer (``into``'s, when given: a node store's slot,
        whose packer writes its segment); returns (buffer, header, total bytes). Runs before
        the first collective of a call, so whatever it raises (a dtype the header cannot
        carry, leaves over max_bytes) travels to every rank in the batch's place."""
        return self._pack(batch, into or self.packer)

    def relay(self, batch: DataProto, hops: list[tuple[object, tuple[int, ...]]]) -> DataProto:
        """The leader packs; each hop ``(group, ranks)`` this rank takes part in moves the
        message from ``ranks[0]`` to the rest of the group; receivers forward what they got
        unchanged on their next hop and unpack the last message they received."""
        g = self.groups  # a replica of one never gets here (``Strategy.get_data_input``)
        buf, header, total = self.pack(batch) if g.is_leader else (None, None, 0)
        direct = self._direct if g.is_leader else []
        for group, ranks in hops:
            src = ranks[0]
            if g.rank == src:
                self.wire.send(buf, total, group, src, fill=self.take_fill())
                _broadcast_all(direct, group, src)
            else:
                buf, header = self.wire.recv(group, src)
                total = header.total_bytes
                direct = [
                    torch.empty(e.shape, dtype=e.dtype, device=g.device)
                    for e in header.entries
                    if e.offset == DIRECT
                ]
                _broadcast_all(direct, group, src)
        return self.complete(batch, buf, header, total, direct)

    def complete(self, batch: DataProto, buf, header: Header, total: int, direct=()) -> DataProto:
        """End of a call on every rank: agree on the next size, then unpack."""
        g = self.groups
        self.agree(header, total)
        self._direct = []  # the call's leaves are the caller's again: hold none across calls
        if not g.is_leader:
            self.finish_receiver(batch, buf, header, direct)
        return batch

    def agree(self, header: Header, total: int) -> None:
        """Every rank adopts the next size the leader announced (the leader computes it, a
        receiver reads it from the header) and keeps the header (``last_header``)."""
        nxt = self.wire.next_expect(total) if self.groups.is_leader else header.next_expect
        self.wire.finish(nxt, total)
        self.last_header = header

    def direct_leaves(self, parts: list) -> frozenset[int]:
        """Indices (in ``parts.message_parts`` order) of the dense leaves that travel on their
        own: contiguous, on the groups' device, at least ``direct_min_bytes``, and not lazy
        (``contract.is_lazy``: a collective would send a view's storage, not its values).
        Sending them from the tensor itself skips the pack copy, at one more collective each."""
        if self.direct_min_bytes is None:
            return frozenset()
        return frozenset(
            i
            for i, (_, kind, _, t) in enumerate(parts)
            if kind == KIND_DENSE
            and nbytes_of(t) >= self.direct_min_bytes
            and t.is_contiguous()
            and t.device == self.groups.device
            and not is_lazy(t)
        )

    def checked_parts(self, batch: DataProto) -> tuple[list, tuple]:
        """The batch's ``message_parts`` and ``structure``, validated (``contract.validate``)
        unless the structure is one of the last ``RECENT_SHAPES`` valid ones. A structure
        that passed once passes again (its keys, dtypes, shapes and devices are what validate
        checks), so batches of a shape seen recently skip the per-leaf checks; non-tensor
        arrays are checked every call."""
        g = self.groups
        try:
            parts, shape = parts_and_structure(batch.batch, g.rank)
        except Exception:
            validate(batch, g.rank, g.device)  # what breaks the contract says so plainly
            raise
        # One object stands for each remembered structure (the packer's replay compares
        # identities); the last one is compared first, which costs less than hashing it.
        if shape == self._last_valid:
            known = shape = self._last_valid
        else:
            known = self._valid.get(shape)
            shape = known or shape
            if known is not None:  # in use again: the most recent, the last to be forgotten
                remember(self._valid, known, known)
        if known is None or not all(hasattr(batch, a) for a in PROTO_ATTRS):
            validate(batch, g.rank, g.device)
            remember(self._valid, shape, shape)
        else:
            check_non_tensor(batch, shape[1][0], g.rank)
        self._last_valid = shape
        return parts, shape

    def _pack(self, batch: DataProto, packer: Packer) -> tuple[torch.Tensor, Header, int]:
        checked, self._checked = self._checked, None  # held for this call only
        if checked is not None and checked[0] is batch.batch:
            _, parts, shape = checked  # leader_view's, for this very batch
        else:  # a batch the protocol made (a failure batch): nothing to check
            parts, shape = parts_and_structure(batch.batch, self.groups.rank)
        nt = batch.non_tensor_batch if wants_non_tensor(batch) else None
        encoded, self._encoded = self._encoded, None
        blob = encoded[1] if encoded is not None and encoded[0] is batch else None
        direct = self.direct_leaves(parts)
        buf, header, self._fill = packer.pack(
            batch.batch,
            nt,
            next_expect=self.wire.next_expect,  # the header carries it: no stamp per call
            min_capacity=self.wire.expect,
            rank=self.groups.rank,
            direct=direct,
            parts=parts,
            shape=shape,
            blob=blob,
        )
        if not direct:  # the usual case: every leaf is in the message
            self._direct = []
            return buf, header, header.total_bytes
        self._direct = [t for i, (*_, t) in enumerate(parts) if i in direct]
        alone = sum(nbytes_of(t) for t in self._direct)
        if alone and header.total_bytes + alone > self.wire.max_bytes:
            # A receiver refuses such a header only after the leader is committed to sending
            # the leaves, and would leave it waiting in their broadcasts: refuse here instead,
            # before any collective, so every rank raises it (max_bytes is the same everywhere).
            self._fill = None
            raise HeaderError(
                f"rank {self.groups.rank}: the message ({header.total_bytes} bytes) and the "
                f"leaves sent on their own ({alone} bytes) exceed max_bytes={self.wire.max_bytes}"
                "; raise max_bytes on every rank or send a smaller batch"
            )
        return buf, header, header.total_bytes

    def take_fill(self):
        """The leader's pending ``fill`` (packing deferred into the first send), once."""
        fill, self._fill = self._fill, None
        return fill

    def finish_receiver(
        self, batch: DataProto, buf: torch.Tensor, header: Header, direct=()
    ) -> DataProto:
        td, non_tensor = unpack(buf, header, td_device=None, direct=direct)
        return deliver(batch, td, non_tensor)


def _broadcast_all(tensors: list[torch.Tensor], group, src: int) -> None:
    """One async broadcast per tensor, then wait for all: the backend may run them at once
    (gloo has two worker threads per group), and none waits for the previous one's reply."""
    if not tensors:
        return
    before = CLOCK.switch("signal")
    handles = [
        dist.broadcast(transportable(t), src=src, group=group, async_op=True) for t in tensors
    ]
    for h in handles:
        h.wait()
    CLOCK.switch(before)
