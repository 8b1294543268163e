"""``floor``: the measured limit, not a way to ship a batch.

The fastest raw way to move an already packed flat buffer of the batch's bytes (its tensor
bytes, plus the encoded non_tensor_batch when it is flagged to travel) from the leader to every
rank of its replica: no header, no packing, no unpacking (``../shared/brief/measurement.md``).
One broadcast is not always that (gloo runs a group's broadcasts on two worker threads, so
concurrent chunks overlap), so the floor is a family of raw methods, one per instance:

- ``method: one`` — one broadcast over the replica (the single-broadcast floor);
- ``method: chunks`` (``chunks: k``) — k concurrent async broadcasts of contiguous slices;
- ``method: seed_hops`` — TP×CP on stage 0, then PP (the seed's hop order);
- ``method: pp_first`` — the leader's PP group, then TP×CP on every stage;
- ``method: shm`` — node-local: one copy into a shared segment, node-local receivers read it
  in place (``strategies.core.node_channel``); across nodes the bytes go to one rank per other node
  first (point-to-point), which puts them in its node's segment. Host memory only: listed for
  a CPU job.

Options: see ``Floor.Options`` (``method``, and ``chunks`` for ``method: chunks``).

``variants(layout)`` lists the methods a layout allows; the harness measures each of them in
the same interleaved rounds and reports the fastest as the floor, naming it (``floor_method``).
Receivers allocate a fresh buffer per call, as any real receiver must. ``prepare`` (untimed)
packs the leader's buffer and tells receivers its size. ``get_data_input`` leaves the DataProto
as it was; the bytes it received stay in ``received`` for the harness to verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist

from strategies.core.contract import DataProto, Unsupported, wants_non_tensor
from strategies.core.footprint import Footprint
from strategies.core.formulas import chunk_bounds
from strategies.core.layout import leader_pp_groups
from strategies.core.node_channel import DEFAULT_STRIPE_MIN_BYTES, NodeChannel
from strategies.core.parts import as_bytes, encode_non_tensor, message_parts
from strategies.core.plan import Comm, Handoff, LocalWork, PayloadSpec, Plan
from strategies.core.strategy_base import Strategy

Method = Literal["one", "chunks", "seed_hops", "pp_first", "shm"]
"""The raw methods (``Floor.Options.method``; the module docstring says what each does)."""
METHODS: tuple[str, ...] = get_args(Method)
CHUNKS = (2, 4)
"""Chunk counts the harness measures (gloo runs two broadcasts of a group at once; four keeps
both threads busy while each slice's reply is pending)."""

VARIANTS = ("shm", *(f"chunks{k}" for k in CHUNKS), "seed_hops", "pp_first")
"""The raw methods besides one broadcast, by the suffix of their label (``floor:<suffix>``):
what a job's ``floor_methods`` may name."""


class Floor(Strategy):
    name = "floor"
    selectable = False
    raw_bytes = True  # it moves the bytes prepare() packed, not the batch it is handed
    claims = "1 broadcast over the replica (method=one); see the module docstring for the others"

    @dataclass(frozen=True, kw_only=True)
    class Options(Strategy.Options):
        method: Method = "one"
        """The raw method this instance times (the module docstring lists them)."""
        chunks: int = 4
        """Concurrent broadcasts of contiguous slices, for ``method="chunks"`` (ignored by the
        other methods)."""

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.method not in METHODS:
                raise ValueError(f"floor: unknown method {self.method!r}; valid: {list(METHODS)}")
            if self.chunks < 1:
                raise ValueError(f"floor: chunks must be >= 1, got {self.chunks}")

    def __init__(self, groups, **options) -> None:
        super().__init__(groups, **options)
        method = self.options.method
        if method == "shm" and groups.device.type != "cpu":
            raise Unsupported(
                f"rank {groups.rank}: floor: method shm reads host memory in place, the job "
                f"runs on {groups.device}"
            )
        self.method = method
        self.chunks = self.options.chunks if method == "chunks" else 1
        self.channel = NodeChannel(groups) if method == "shm" else None
        self.nbytes = 0
        self.sent: torch.Tensor | None = None
        self.received: torch.Tensor | None = None

    footprint = Footprint(leader=1, receiver=1.2, leader_kept=1)
    """The packed buffer (one for every raw method of a job: the harness shares it) and the
    received bytes; method shm holds the segment's slots instead of received bytes."""

    @classmethod
    def footprint_for(cls, **options) -> Footprint:
        if cls.options_of(**options).method == "shm":
            return Footprint(leader=1, receiver=0, node=1, leader_kept=1)
        return cls.footprint

    @staticmethod
    def variants(layout, device: str = "cpu", methods=None) -> dict[str, dict]:
        """Label -> options of every raw method ``layout`` allows on ``device``; ``floor`` is
        one broadcast. Hop orders differ from one broadcast only when the replica has both PP
        and TP×CP; shared memory holds host memory only. ``methods``: the labels' suffixes
        (``VARIANTS``) to keep beside one broadcast, which is always there (None: every one)."""
        out = Floor._variants(layout, device)
        if methods is None:
            return out
        kept = {"floor", *(f"floor:{m}" for m in methods)}
        return {k: v for k, v in out.items() if k in kept}

    @staticmethod
    def _variants(layout, device: str) -> dict[str, dict]:
        out: dict[str, dict] = {"floor": {}}
        if device == "cpu" and layout.replica_size > 1:
            out["floor:shm"] = {"method": "shm"}
        for k in CHUNKS:
            out[f"floor:chunks{k}"] = {"method": "chunks", "chunks": k}
        if layout.pp > 1 and layout.tp_cp > 1:
            out["floor:seed_hops"] = {"method": "seed_hops"}
            out["floor:pp_first"] = {"method": "pp_first"}
        return out

    def prepare(self, batch: DataProto, sent: torch.Tensor | None = None) -> None:
        """Pack the leader's buffer (untimed) and tell every receiver its size. ``sent``: the
        packed bytes another raw method already made of this batch, on the leader: every
        method moves the same bytes, so the harness packs them once for all of them instead
        of keeping one copy of the batch per method."""
        g = self.groups
        size = torch.zeros(1, dtype=torch.int64)
        if g.is_leader:
            if sent is None:
                parts = raw_parts(batch)
                sent = torch.cat([p.to(g.device) for p in parts]) if parts else torch.empty(0)
            self.sent = sent
            size[0] = self.sent.numel()
        dist.broadcast(size, src=g.leader, group=g.cpu_replica_group)
        self.nbytes = int(size[0])

    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        if g.replica_ranks == (g.rank,):  # a replica of one rank: what it holds is received
            self.received = self.sent
            return batch
        if self.channel is not None:
            self.received = self._through_shm()
            return batch
        buf = self.sent if g.is_leader else None
        for group, ranks in self._hops():
            if g.rank not in ranks:
                continue
            if buf is None:
                buf = torch.empty(self.nbytes, dtype=torch.uint8, device=g.device)
            _broadcast_chunks(buf, chunk_bounds(self.nbytes, self.chunks), group, ranks[0])
        self.received = buf
        return batch

    def let_go(self) -> None:
        """Drop the bytes the last call received (the harness calls it once a timed call's
        clock stopped, when it drops every other strategy's returned batch)."""
        self.received = None

    def _through_shm(self) -> torch.Tensor:
        """The raw bytes through the node's shared segment: the leader's one copy in, every
        node-local rank's view of it, the segment mapped before the signal when it is the
        expected one (the other node leaders receive them first)."""
        g, ch = self.groups, self.channel
        if not ch.connected:
            ch.connect()
        n = self.nbytes
        if g.is_leader:
            slot = ch.writer_slot()
            slot.buffer(max(n, 1))[:n].copy_(self.sent)
            ch.hand_over(slot, self.sent, announce=False)  # prepare told every rank the size
            return self.sent
        if ch.is_node_leader:
            return ch.receive_from_leader(n, n)
        return ch.receive(ch.premap())[:n]  # mapped while it waits, as shm's readers do

    def _hops(self) -> list[tuple[object, tuple[int, ...]]]:
        """(group, ranks) of each hop this rank takes part in, in order; source = ranks[0]."""
        g = self.groups
        if self.method == "seed_hops":
            return [(hop.group, hop.ranks) for hop in g.seed_hops()]
        if self.method == "pp_first":
            hops = []
            if g.pp_size > 1 and g.tp_cp_rank == 0:
                hops.append((g.pp_group, g.pp_ranks))
            if g.tp_cp_size > 1:
                hops.append((g.tp_cp_group, g.tp_cp_ranks))
            return hops
        return [(g.replica_group, g.replica_ranks)]

    @classmethod
    def plan(cls, layout, spec: PayloadSpec, method: str = "one", chunks: int = 4) -> Plan:
        nbytes = spec.sent_bytes
        if method == "shm":  # a hand-off per replica: the cost model finds the nodes it spans
            shared = [
                Handoff(tuple(r), nbytes, DEFAULT_STRIPE_MIN_BYTES)
                for r in layout.replica_groups()
                if len(r) > 1
            ]
            leader = LocalWork(copied_bytes=nbytes)  # the one copy into the segment is timed
            return Plan(cls.name, [], leader=leader, receiver=LocalWork(), shared=shared)
        if method == "seed_hops":
            hops = layout.seed_hop_groups()
        elif method == "pp_first":
            hops = [leader_pp_groups(layout)] if layout.pp > 1 else []
            hops += [layout.groups("tp-cp")] if layout.tp_cp > 1 else []
        else:
            hops = [layout.replica_groups()] if layout.replica_size > 1 else []
        bounds = chunk_bounds(nbytes, chunks if method == "chunks" else 1)
        comms = [
            Comm("broadcast", tuple(r), r[0], b - a, step, "payload")
            for step, groups in enumerate(hops)
            for a, b in bounds
            for r in groups
        ]
        return Plan(cls.name, comms, leader=LocalWork(), receiver=LocalWork())


def _broadcast_chunks(buf: torch.Tensor, bounds, group, src: int) -> None:
    if len(bounds) == 1:
        dist.broadcast(buf, src=src, group=group)
        return
    handles = [dist.broadcast(buf[a:b], src=src, group=group, async_op=True) for a, b in bounds]
    for h in handles:
        h.wait()


def raw_parts(batch: DataProto) -> list[torch.Tensor]:
    """The floor's bytes of a batch, as uint8 tensors in order: each message part's own
    elements (a jagged leaf as its parts, a non-tensor leaf as its pickle), then the encoded
    non_tensor_batch when it is flagged to travel. Every path that sizes or sends the floor
    (its receivers' buffer, the Ray floor's flat array, records' payload_bytes) uses this."""
    parts = [as_bytes(t) for *_, t in message_parts(batch.batch)]
    if wants_non_tensor(batch):
        blob = encode_non_tensor(batch.non_tensor_batch)
        parts.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    return parts


STRATEGY = Floor
