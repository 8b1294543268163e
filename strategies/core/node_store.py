"""The node store: the base of every strategy whose replica leader puts one packed message (the
``header`` family's) into its node's shared-memory channel (``strategies.core.node_channel``)
and whose other ranks take it from there. ``shm`` views what it takes, ``independent_fetch``
copies it out; a later store strategy is one more subclass.

What they share lives here, once: the channel and the strategy's name in its errors, the
leader's turn (a closed channel refused, the next slot, the message written, the size agreed),
the message packed straight into the slot's segment (``put``), a failure the leader could not
ship told to its readers through their sockets (``abandon``), a reader's receive and its check
of the header against the segment, and the cost model's plan. A subclass says how its leader
signals (``publish``) and what its readers do with the message (``take``).

The channel's own protocol (which slot, which signal, who releases what) is mapped in
``strategies.core.node_channel``'s module docstring.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from strategies.core.contract import DataProto, is_settled, settled
from strategies.core.header_format import DEFAULT_MAX_BYTES, Header, HeaderError, read_header_bytes
from strategies.core.node_channel import (
    DEFAULT_POLL_US,
    DEFAULT_SLOTS,
    DEFAULT_STRIPE_MIN_BYTES,
    NodeChannel,
)
from strategies.core.node_signals import ShmError, check_poll_option, check_size_option
from strategies.core.packed import PackedStrategy
from strategies.core.plan import Handoff, LocalWork, PayloadSpec, Plan, StoreFetch
from strategies.core.segment_ring import Premap, Slot
from strategies.core.strategy_base import Strategy
from strategies.core.trace import WORK
from strategies.core.wire import Wire

CHANNEL_NAME = "shm"
"""How the channel names itself in its errors (``NodeChannel``); each store says its own."""


class NodeStore(PackedStrategy):
    """A store on the node (see the module docstring). Subclasses implement ``publish`` (the
    leader, its message written or its leaves still to copy: signal the readers) and ``take``
    (a reader, connected: receive the message and build the batch)."""

    readers_copy = False
    """Whether every reader copies the whole message out of the store (a fetch the cost model
    prices as the store's: ``StoreFetch``) rather than viewing it in place."""

    @dataclass(frozen=True, kw_only=True)
    class Options(Strategy.Options):
        slots: int = DEFAULT_SLOTS
        """Segments in the ring; a slot still held when its turn comes is replaced by a new
        segment (the holder keeps the old one), so more slots only save segment set-ups."""
        stripe_min_bytes: int | None = DEFAULT_STRIPE_MIN_BYTES
        """Across nodes, a message at least this large crosses in stripes: the i-th rank of
        the leader's node sends the i-th slice to the i-th rank of each other node, which
        writes it into its node's segment (with one link per GPU each link carries its share;
        with one link per node it carries the message once either way); None sends every
        message whole, leader to node leader."""
        poll_us: int | None = DEFAULT_POLL_US
        """Microseconds. Where the node has a core per rank (a poll would take a core another
        rank needs) and on x86 (whose store order the word relies on), receivers poll instead
        of sleeping: a receiver waiting for the signal spins on its socket, yielding its core,
        for up to this long before it blocks; and the node leader completes a message signalled
        early (``shm``'s ``early_min_bytes``) by writing its number into a shared completion
        word, which a receiver done with the header and the blob spins on for this long, then
        looks at between 50 µs sleeps (up to the gloo timeout): no wake-up through the
        scheduler for a signal or a completion that comes meanwhile. An abort or the leader's
        end reaches it through its socket. Elsewhere, or None or 0, receivers block on their
        socket and the completion is a socket message. The node leader's option decides for
        its node (the floor's node-local method, built on the same channel, polls alike)."""
        max_bytes: int = DEFAULT_MAX_BYTES
        """Readers refuse a header that claims more than this."""

        def __post_init__(self) -> None:
            super().__post_init__()
            if type(self.slots) is not int or self.slots < 1:
                raise ValueError(f"shm: slots must be >= 1, got {self.slots!r}")
            check_size_option("stripe_min_bytes", self.stripe_min_bytes)
            check_poll_option(self.poll_us)

    def __init__(self, groups, **options) -> None:
        super().__init__(groups, **options)
        o = self.options
        with self.named():
            self.channel = NodeChannel(groups, o.slots, o.stripe_min_bytes, o.poll_us)
        self._headers: dict = {}  # read_header_bytes' cache: same-shaped batches decode once
        self.stage = groups.device.type != "cpu"
        """Whether the message is packed on the groups' device and copied into the segment
        once (a batch on a GPU), rather than packed straight into the segment."""

    def new_wire(self) -> Wire:
        """The message crosses no broadcast: the wire only agrees sizes and reads headers."""
        return Wire(self.groups.device, self.groups.rank, max_bytes=self.options.max_bytes)

    # -- the call --------------------------------------------------------------------------
    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups  # a replica of one never gets here (``Strategy.get_data_input``)
        with self.named():
            if not g.is_leader:
                self.connect()
                return self.take(batch)
            ch = self.channel
            if ch.closed:  # every reader's is closed too: each raises, nothing to ship
                raise settled(ShmError(
                    f"rank {g.rank}: {CHANNEL_NAME}: the channel closed on an earlier call "
                    f"({ch.closed_why}); build the strategy again"
                ))  # fmt: skip
            header, total = self.publish(ch.writer_slot(), batch)
            self.agree(header, total)  # auto's candidates share one Wire: keep it agreed
            return batch

    def publish(self, slot: Slot, batch: DataProto) -> tuple[Header, int]:
        """Leader: ``batch``'s message into ``slot`` and its readers told; returns the
        message's header and bytes."""
        raise NotImplementedError

    def take(self, batch: DataProto) -> DataProto:
        """A reader (connected): the message from the store, as this rank's batch."""
        raise NotImplementedError

    def abandon(self, text: str) -> bool:
        """Leader, a failure it could not ship: on one node, its readers are told ``text``
        through their sockets and the channel is closed (``RingWriter.abandon``), connected
        first if this was the first call (the readers wait in its set-up). A channel closed
        already keeps nobody waiting (each reader's is closed too): True. Across nodes the
        other node leaders wait in a point-to-point receive: False."""
        ch = self.channel
        if len(ch.nodes) > 1:
            return False
        if ch.closed:
            return True
        self.connect()
        return ch.abandon(text)

    def posts_collectives(self) -> bool:
        """On one node, once connected, a call is socket messages and shared memory only."""
        return not self.channel.node_local

    # -- the leader --------------------------------------------------------------------------
    def put(self, slot: Slot, batch: DataProto):
        """Leader: the message in ``slot``'s segment; returns the segment's view of it (host
        memory, what the sends read), the header, the message's bytes, and the leaves' copy
        still to do (``fill(total)``; None: all written). On host groups the slot's packer
        writes the segment itself; staged, the leader's own packer packs on the groups'
        device and the message is copied into the segment once (a device-to-host copy)."""
        if not self.stage:
            buf, header, total = self.pack(batch, into=slot.packer)
            return buf, header, total, self.take_fill()
        packed, header, total = self.pack(batch)
        fill = self.take_fill()
        if fill is not None:
            fill(total)
        buf = slot.buffer(max(total, self.wire.expect))  # grows as the wire does, not per byte
        buf[:total].copy_(packed[:total])
        WORK["d2h_bytes"] += total
        return buf, header, total, None

    def connect(self) -> None:
        """The channel's sockets, set up on the first call (every rank of the node joins)."""
        if not self.channel.connected:
            self.channel.connect()

    @contextmanager
    def named(self):
        """The channel names itself ``shm`` in its errors; a user who ran another store reads
        that store's name instead (the error stays an ``ShmError``, settled or not)."""
        try:
            yield
        except ShmError as exc:
            if self.name == CHANNEL_NAME:
                raise
            renamed = ShmError(str(exc).replace(f": {CHANNEL_NAME}: ", f": {self.name}: ", 1))
            if is_settled(exc):
                settled(renamed)
            raise renamed from exc.__cause__

    # -- a reader ----------------------------------------------------------------------------
    def receive(self, premap: Premap | None = None) -> torch.Tensor:
        """A reader: the next message's segment view (another node's leader receives it from
        the replica leader first, into its node's store)."""
        ch = self.channel
        if ch.is_node_leader:
            return ch.receive_from_leader(None, self.wire.max_bytes)
        return ch.receive(premap)

    def stored_header(self, buf: torch.Tensor) -> tuple[bytes, Header]:
        """A reader: the header's bytes and the header of the message in ``buf`` (read in the
        segment, host memory whatever the device), refused when it claims more bytes than the
        segment holds."""
        g = self.groups
        raw, header = read_header_bytes(buf, self.wire.max_bytes, g.rank, cache=self._headers)
        if header.total_bytes > buf.numel():
            raise HeaderError(
                f"rank {g.rank}: {self.name}: the header claims {header.total_bytes} bytes, "
                f"the segment holds {buf.numel()}"
            )
        return raw, header

    # -- the cost model ----------------------------------------------------------------------
    @classmethod
    def plan(
        cls,
        layout,
        spec: PayloadSpec,
        stage: bool = False,
        stripe_min_bytes: int | None = DEFAULT_STRIPE_MIN_BYTES,
    ) -> Plan:
        """No collective: every replica's message is one hand-off through its node's store
        (``Handoff``: the model prices its signals and, where the replica spans nodes, the sends
        that feed each other node's store, in stripes from ``stripe_min_bytes``). The leader
        packs the message once; each reader unpickles the flagged non-tensor blob and either
        views the message in place or (``readers_copy``) copies all of it out (a
        ``StoreFetch`` from the node store, whose readers contend for the host's memory and
        cores). ``stage`` (a batch on a device): the leader's message goes to the host once,
        and each reader's copy (its fetch, or the message whole) goes onto its device."""
        n = spec.message_bytes
        nt = spec.sent_non_tensor_bytes
        replicas = [tuple(r) for r in layout.replica_groups() if len(r) > 1]
        fetches = [StoreFetch("node_shm", r, n, "node", crosses=False) for r in replicas]
        staged = n if stage and not cls.readers_copy else 0  # a fetch is priced as the store's
        return Plan(
            cls.name,
            [],
            leader=LocalWork(packed_bytes=n, d2h_bytes=n if stage else 0),
            receiver=LocalWork(pickled_bytes=nt, h2d_bytes=staged),
            shared=[Handoff(r, n, stripe_min_bytes) for r in replicas],
            stores=fetches if cls.readers_copy else [],
        )
