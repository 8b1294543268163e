"""``shm``: the batch reaches the ranks of a node through shared memory, not a socket.

The leader packs the batch once (the ``header`` family's message: binary header + one flat
buffer) straight into a shared segment, and tells each rank of its node with one socket
message; those ranks build their batch as views of the segment, with no copy and no
collective (``strategies.core.shm`` has the ring, the signal and the release protocol). Across
nodes it is hierarchical: the leader sends the message to one rank per other node (its node
leader, two point-to-point sends: the size, then the bytes straight from the segment), which
receives it into its own node's segment and signals its node the same way; each node link
carries the message once.

A receiver's batch is copy-on-write: writing into it changes only that rank's copy, never the
segment or another rank's batch, and a batch held across calls is never overwritten (its slot
is not reused until every tensor of it is gone). Host memory only: a batch on a GPU is refused
(``Unsupported``) on every rank before any collective.

Options:

- ``slots`` (3): segments in the ring; a slot still held when its turn comes is replaced by a
  new segment (the holder keeps the old one), so more slots only save segment set-ups;
- ``views`` (True): receivers view the segment in place; False gives every receiver owned
  copies (one copy each) and releases the segment at once;
- ``max_bytes`` (16 GiB): receivers refuse a header that claims more than this.
"""

from __future__ import annotations

from strategies.core.contract import DataProto, deliver
from strategies.core.header_format import DEFAULT_MAX_BYTES, HeaderError, read_header
from strategies.core.packed import PackedStrategy
from strategies.core.plan import Handoff, LocalWork, PayloadSpec, Plan
from strategies.core.shm import NodeChannel, ShmError
from strategies.core.unpacker import unpack


class Shm(PackedStrategy):
    name = "shm"
    claims = (
        "no collective on a node: one socket message per node-local rank; two point-to-point "
        "sends per other node of the replica"
    )

    def __init__(
        self,
        groups,
        slots: int = 3,
        views: bool = True,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        super().__init__(groups, max_bytes=max_bytes)
        self.channel = NodeChannel(groups, slots)  # refuses groups on a device (Unsupported)
        self.views = views
        self._headers: dict = {}  # read_header's cache: same-shaped batches decode once

    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        ch = self.channel
        if g.is_leader:
            slot = ch.writer_slot()
            self.packer = slot.packer  # the slot's packer writes into the slot's segment
            buf, header, total = self.pack(batch)
            if buf.data_ptr() != slot.segment.view.data_ptr():
                raise ShmError(f"rank {g.rank}: shm: the message was not packed into its slot")
            self.take_fill()(total)
            self._connect()
            ch.publish(slot, total)
            ch.send_to_nodes(buf[:total], announce=True)
            self._finish(header)
            return batch
        self._connect()
        if ch.is_node_leader:
            buf = ch.receive_from_leader(None, self.wire.max_bytes)
        else:
            buf = ch.receive()
        header = read_header(buf, self.wire.max_bytes, g.rank, cache=self._headers)
        if header.total_bytes > buf.numel():
            raise HeaderError(
                f"rank {g.rank}: shm: the header claims {header.total_bytes} bytes, the segment "
                f"holds {buf.numel()}"
            )
        self._finish(header)
        td, non_tensor = unpack(buf[: header.total_bytes], header)
        if not self.views:
            td = td.clone()  # owned copies: the views (and the segment's hold) go with buf
        return deliver(batch, td, non_tensor)

    def _connect(self) -> None:
        if not self.channel.connected:
            self.channel.connect()

    def _finish(self, header) -> None:
        """Every rank adopts the next size the header announced, as a wire strategy would:
        under ``auto`` the candidates share one ``Wire``, so the one that serves the next call
        posts the size every rank agreed to."""
        total = header.total_bytes
        nxt = self.wire.next_expect(total) if self.groups.is_leader else header.next_expect
        self.wire.finish(nxt, total)
        self.last_header = header

    @classmethod
    def plan(cls, layout, spec: PayloadSpec) -> Plan:
        """No collective: every replica's message is a shared-memory hand-off (``Handoff``:
        the cost model prices its signals and, where the replica spans nodes, its sends to
        each other node). The leader packs the message; a receiver views it in place and
        unpickles only the flagged non-tensor blob."""
        nt = spec.non_tensor_bytes if spec.broadcast_non_tensor else 0
        shared = [
            Handoff(tuple(ranks), spec.message_bytes)
            for ranks in layout.replica_groups()
            if len(ranks) > 1
        ]
        return Plan(
            cls.name,
            [],
            leader=LocalWork(packed_bytes=spec.message_bytes),
            receiver=LocalWork(pickled_bytes=nt),
            shared=shared,
        )


STRATEGY = Shm
