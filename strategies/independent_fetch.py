"""``independent_fetch``: NeMo-RL's ``fetch_policy: independent`` (``TQWorkerMixin._fetch`` in
``nemo_rl/data_plane/worker_mixin.py``), reproduced with this suite's node store in place of
TransferQueue: every rank of the replica fetches its own copy of the batch from a store, and no
collective carries the data.

Reproduced:

- the batch is put in a store once (NeMo-RL: the driver's ``kv_batch_put``; here the replica
  leader packs it once, the ``header`` family's message, into a shared-memory segment of its
  node: ``strategies.core.node_channel``, the same store ``shm`` uses);
- what signals readiness is not the data: a reader learns the batch is in the store from one
  socket message (TransferQueue's readers need such a signal too: a get before the put raises);
- every other rank of the TP×CP×PP replica does its own fetch: it copies the whole message out
  of the store into a buffer of its own (on its own device when the groups are on one: one host
  to device copy, as a get onto a GPU worker), lets the store's segment go at once, and
  deserializes its batch from that copy. Each rank ends with an owned copy, as a get gives
  (not views of the store: writing into it touches no other rank's batch), so k readers make k
  copies of the message, where ``shm`` makes none.

Across nodes (emulated multi-node included) the store is per node: the replica leader feeds each
other node's store once (the channel's point-to-point sends on the replica's gloo group, in
stripes from ``stripe_min_bytes`` on), and that node's ranks fetch from it. NeMo-RL's readers on
another node would each fetch across the network from wherever the storage unit lives, so the
link would carry the batch once per remote rank; here it carries it once per node. That is a
per-node store (what a node-local cache in front of TransferQueue gives), said plainly rather
than hidden: the cross-node bytes are ``shm``'s, the fetches are not.

Left out: TransferQueue itself (its controller round trips, ZMQ frames, msgspec encoding, its
jagged return types and the conversion back), the metadata lookup a NeMo-RL worker makes before
its get, and the per-step ``kv_clear`` (the ring's slots are reused instead). The leader does
not fetch its own batch back: it holds what it put. The same source's other policy is
``nemo_rl_leader_broadcast`` (the replica leader fetches, then broadcasts): time the two side by
side to see what NeMo-RL's choice between them costs.

A leader's failure reaches every rank as it does for ``shm``: a batch the leader cannot pack is
replaced by a failure batch, which is put and fetched like any other; a leader that dies closes
its sockets and every reader raises at once naming it. The store's segments are memfds, so a
kill -9 leaves nothing in /dev/shm.

Options:

- ``slots`` (3): segments in the store's ring (``shm``'s ``slots``; a reader releases its slot as
  soon as it has copied the message, so few are ever held);
- ``stripe_min_bytes`` (1 MiB): across nodes, as ``shm``'s;
- ``max_bytes`` (16 GiB): readers refuse a header that claims more than this.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from strategies.core.contract import DataProto, deliver, is_settled, settled
from strategies.core.footprint import Footprint
from strategies.core.header_format import DEFAULT_MAX_BYTES, HeaderError, read_header
from strategies.core.node_channel import DEFAULT_SLOTS, DEFAULT_STRIPE_MIN_BYTES, NodeChannel
from strategies.core.node_signals import ShmError
from strategies.core.packed import PackedStrategy
from strategies.core.plan import Handoff, LocalWork, PayloadSpec, Plan, StoreFetch
from strategies.core.trace import WORK
from strategies.core.unpacker import unpack_non_tensor, unpack_tensors


class IndependentFetch(PackedStrategy):
    name = "independent_fetch"
    footprint = Footprint(leader=0.15, receiver=1.3, node=1)
    """Measured by the node memory phase (the node store's slot; every reader copies its own
    batch out)."""
    claims = (
        "no collective carries the data on a node: one socket message per node-local rank, "
        "each of which copies the batch out of the store; two point-to-point sends per other "
        "node of the replica"
    )

    def __init__(
        self,
        groups,
        slots: int = DEFAULT_SLOTS,
        stripe_min_bytes: int | None = DEFAULT_STRIPE_MIN_BYTES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        super().__init__(groups, max_bytes=max_bytes)
        with self._named():
            self.channel = NodeChannel(groups, slots, stripe_min_bytes)
        self.on_device = groups.device.type != "cpu"
        self._headers: dict = {}  # read_header's cache: same-shaped batches decode once

    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        if g.replica_ranks == (g.rank,):  # a replica of one: the leader holds what it put
            return batch
        with self._named():
            if g.is_leader:
                self._put(batch)
                return batch
            return self._fetch(batch)

    def _put(self, batch: DataProto) -> None:
        """Leader: the message into the next slot of the store, then the readiness signal (and,
        across nodes, the sends that feed every other node's store)."""
        ch = self.channel
        slot = ch.writer_slot()
        if self.on_device:  # packed where the batch lives, then copied to the host store once
            packed, header, total = self.pack(batch)
            self._fill(total)
            buf = slot.buffer(max(total, self.wire.expect))
            buf[:total].copy_(packed[:total])
            WORK["d2h_bytes"] += total
        else:  # the slot's packer writes the segment itself
            self.packer = slot.packer
            buf, header, total = self.pack(batch)
            self._fill(total)
            if buf.data_ptr() != slot.segment.view.data_ptr():
                raise ShmError(
                    f"rank {self.groups.rank}: {self.name}: the message was not packed into "
                    "the store's slot"
                )
        self._connect()
        ch.hand_over(slot, buf[:total], announce=True)
        self.agree(header, total)

    def _fill(self, total: int) -> None:
        fill = self.take_fill()
        if fill is not None:
            fill(total)

    def _fetch(self, batch: DataProto) -> DataProto:
        """A reader: wait for the signal, copy the message out of the store into this rank's own
        buffer, release the store's segment, and build the batch from the copy."""
        g = self.groups
        ch = self.channel
        self._connect()
        if ch.is_node_leader:  # another node's leader feeds its node's store first
            stored = ch.receive_from_leader(None, self.wire.max_bytes)
        else:
            stored = ch.receive()
        # The header is read in the store (host memory, whatever the device): what to copy.
        header = read_header(stored, self.wire.max_bytes, g.rank, cache=self._headers)
        total = header.total_bytes
        if total > stored.numel():
            raise HeaderError(
                f"rank {g.rank}: {self.name}: the header claims {total} bytes, the store's "
                f"message holds {stored.numel()}"
            )
        own = torch.empty(total, dtype=torch.uint8, device=g.device)
        own.copy_(stored[:total])
        WORK["h2d_bytes" if self.on_device else "copied_bytes"] += total
        del stored  # the last view of the segment: its release goes out now
        self.agree(header, total)
        return deliver(batch, unpack_tensors(own, header), unpack_non_tensor(own, header))

    def _connect(self) -> None:
        if not self.channel.connected:
            self.channel.connect()

    @contextmanager
    def _named(self):
        """The channel names itself ``shm`` in its errors; a user who ran this strategy reads
        this strategy's name instead (the error stays an ``ShmError``, settled or not)."""
        try:
            yield
        except ShmError as exc:
            renamed = ShmError(str(exc).replace(": shm: ", f": {self.name}: ", 1))
            if is_settled(exc):
                settled(renamed)
            raise renamed from exc.__cause__

    @classmethod
    def plan(
        cls,
        layout,
        spec: PayloadSpec,
        stage: bool = False,
        stripe_min_bytes: int | None = DEFAULT_STRIPE_MIN_BYTES,
    ) -> Plan:
        """No collective: every replica's message is one put into the store (``Handoff``: the
        cost model prices its signals and, across nodes, the sends that feed each node's
        store). The leader packs the message once; every reader copies all of it out (its
        fetch: a ``StoreFetch`` from the node store, whose readers contend for the host's
        memory and cores) and unpickles the flagged non-tensor blob. ``stage`` (a batch on a
        device): the leader's message goes to the host once, and each reader's fetch copies
        onto its device (the node store's rate on such a cluster, ``ClusterConf.store``)."""
        n = spec.message_bytes
        nt = spec.non_tensor_bytes if spec.broadcast_non_tensor else 0
        replicas = [tuple(r) for r in layout.replica_groups() if len(r) > 1]
        return Plan(
            cls.name,
            [],
            leader=LocalWork(packed_bytes=n, d2h_bytes=n if stage else 0),
            receiver=LocalWork(pickled_bytes=nt),
            shared=[Handoff(r, n, stripe_min_bytes) for r in replicas],
            stores=[StoreFetch("node_shm", r, n, "node", crosses=False) for r in replicas],
        )


STRATEGY = IndependentFetch
