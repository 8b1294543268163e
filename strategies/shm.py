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

import torch
import torch.distributed as dist

from strategies.core.contract import DataProto, Unsupported, deliver
from strategies.core.header_format import DEFAULT_MAX_BYTES, HeaderError, read_header
from strategies.core.packed import PackedStrategy
from strategies.core.plan import LocalWork, PayloadSpec, Plan
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
        if groups.device.type != "cpu":
            raise Unsupported(
                f"rank {groups.rank}: shm: the shared segment is host memory and the groups "
                f"run on {groups.device}; use flat or header there"
            )
        super().__init__(groups, max_bytes=max_bytes)
        self.channel = NodeChannel(groups, slots)
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
            self._send_to_nodes(buf, total)
            self.last_header = header
            return batch
        self._connect()
        if ch.is_node_leader:
            buf = self._receive_from_leader()
        else:
            buf = ch.receive()
        header = read_header(buf, self.wire.max_bytes, g.rank, cache=self._headers)
        if header.total_bytes > buf.numel():
            raise HeaderError(
                f"rank {g.rank}: shm: the header claims {header.total_bytes} bytes, the segment "
                f"holds {buf.numel()}"
            )
        self.last_header = header
        td, non_tensor = unpack(buf[: header.total_bytes], header)
        if not self.views:
            td = td.clone()  # owned copies: the views (and the segment's hold) go with buf
        return deliver(batch, td, non_tensor)

    def _connect(self) -> None:
        if not self.channel.connected:
            self.channel.connect()

    def _send_to_nodes(self, buf: torch.Tensor, total: int) -> None:
        """Replica leader: the message to every other node's leader, size first."""
        g = self.groups
        others = g.node_leaders[1:]
        if not others:
            return
        size = torch.tensor([total], dtype=torch.int64)
        handles = [dist.isend(size, dst, group=g.cpu_replica_group) for dst in others]
        handles += [dist.isend(buf[:total], dst, group=g.cpu_replica_group) for dst in others]
        for h in handles:
            h.wait()

    def _receive_from_leader(self) -> torch.Tensor:
        """A node leader other than the replica leader: the message into its node's segment,
        signalled to its node; returns its own copy-on-write view of it."""
        g = self.groups
        ch = self.channel
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, g.leader, group=g.cpu_replica_group)
        total = int(size[0])
        if not 0 < total <= self.wire.max_bytes:
            raise HeaderError(
                f"rank {g.rank}: shm: the leader announced {total} bytes; expected 1 to "
                f"max_bytes={self.wire.max_bytes}"
            )
        slot = ch.writer_slot()
        view = slot.buffer(total)
        dist.recv(view[:total], g.leader, group=g.cpu_replica_group)
        ch.publish(slot, total)
        return ch.view_own(slot, total)

    @classmethod
    def plan(cls, layout, spec: PayloadSpec) -> Plan:
        """One node (a layout holds no nodes): no collective, the leader packs the message, a
        receiver unpickles the flagged non-tensor blob and copies nothing. Across nodes the
        leader adds two point-to-point sends per other node of the replica."""
        nt = spec.non_tensor_bytes if spec.broadcast_non_tensor else 0
        return Plan(
            cls.name,
            [],
            leader=LocalWork(packed_bytes=spec.message_bytes),
            receiver=LocalWork(pickled_bytes=nt),
        )


STRATEGY = Shm
