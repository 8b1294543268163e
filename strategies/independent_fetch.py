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

ROLL's lazy fetch (``Options.fields``, ``strategies.core.lazy_fields``): a reader copies the
header, then only the named leaves' bytes (and the non-tensor blob) out of the store, each at its
own offset in a buffer of its own whose other pages are never touched.

Options: ``Options``, ``strategies.core.node_store.NodeStore.Options`` (``shm``'s, less its own)
and ``fields``; a reader releases its slot as soon as it has copied the message, so few slots
are ever held.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from strategies.core.contract import DataProto, deliver
from strategies.core.footprint import Footprint
from strategies.core.header_format import Header
from strategies.core.lazy_fields import FieldsOptions, LazyFields, fields_bytes
from strategies.core.node_channel import DEFAULT_STRIPE_MIN_BYTES
from strategies.core.node_store import NodeStore
from strategies.core.segment_ring import Slot
from strategies.core.trace import WORK
from strategies.core.unpacker import unpack_non_tensor, unpack_tensors


class IndependentFetch(LazyFields, NodeStore):
    """``shm``'s node store whose readers copy the message out (see the module docstring)."""

    @dataclass(frozen=True, kw_only=True)
    class Options(NodeStore.Options, FieldsOptions):
        pass

    name = "independent_fetch"
    footprint = Footprint(leader=0.15, receiver=1.3, node=1)
    """Measured by the node memory phase (the node store's slot; every reader copies its own
    batch out)."""
    readers_copy = True
    claims = (
        "no collective carries the data on a node: one socket message per node-local rank, "
        "each of which copies the batch out of the store; two point-to-point sends per other "
        "node of the replica"
    )

    def check(self, batch) -> None:
        super().check(batch)
        self.check_fields(batch)

    @classmethod
    def plan(
        cls,
        layout,
        spec,
        stage: bool = False,
        stripe_min_bytes: int | None = DEFAULT_STRIPE_MIN_BYTES,
        fields: tuple[str, ...] | str = (),
    ):
        """``NodeStore.plan``, each reader's copy out of the store (its fetch) only the header
        and the named ``fields`` where it reads some (lazy fetch)."""
        plan = super().plan(layout, spec, stage, stripe_min_bytes)
        got = fields_bytes(spec, fields, header=True)
        plan.stores = [replace(f, read_bytes=got) for f in plan.stores]
        return plan

    def publish(self, slot: Slot, batch: DataProto) -> tuple[Header, int]:
        """Leader: the message into the next slot of the store, then the readiness signal (and,
        across nodes, the sends that feed every other node's store)."""
        buf, header, total, fill = self.put(slot, batch)
        if fill is not None:
            fill(total)
        self.connect()
        self.channel.hand_over(slot, buf[:total], announce=True)
        return header, total

    def take(self, batch: DataProto) -> DataProto:
        """A reader: wait for the signal, copy the message out of the store into this rank's own
        buffer, release the store's segment, and build the batch from the copy."""
        g = self.groups
        stored = self.receive()
        _, header = self.stored_header(stored)  # what to copy
        total = header.total_bytes
        own = torch.empty(total, dtype=torch.uint8, device=g.device)
        ranges = [(0, total)]
        wanted = header
        if self.options.fields:
            wanted, ranges = self.field_ranges(header)
            ranges = [(0, header.header_len), *ranges]
        for offset, nbytes in ranges:
            own[offset : offset + nbytes].copy_(stored[offset : offset + nbytes])
        WORK["h2d_bytes" if self.stage else "copied_bytes"] += sum(n for _, n in ranges)
        del stored  # the last view of the segment: its release goes out now
        self.agree(header, total)
        return deliver(batch, unpack_tensors(own, wanted), unpack_non_tensor(own, wanted))


STRATEGY = IndependentFetch
