"""``scatter_allgather``: van de Geijn's bandwidth-optimal broadcast, aware of the two levels.

The leader packs header + data (as ``header`` does) and cuts the message into n = tp·cp equal
chunks. A small header broadcast over the replica tells every rank the sizes; the chunks are
scattered across TP×CP on stage 0; each stage-0 rank carries only its own chunk down its PP
group; then every stage all-gathers inside its TP×CP group. Each inter-stage link therefore
carries 1/(tp·cp) of the payload (the SC'21 scatter/gather optimisation), at the price of four
collectives instead of one or two.
Options: see ``ScatterAllgather.Options``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from strategies.core.contract import DataProto, deliver, wants_non_tensor
from strategies.core.footprint import Footprint
from strategies.core.header_format import (
    DEFAULT_MAX_BYTES,
    PREFIX_BYTES,
    read_header,
    read_prefix,
)
from strategies.core.packer import Packer
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan
from strategies.core.strategy_base import Strategy
from strategies.core.unpacker import unpack

CHUNK_ALIGN = 64


def _all_gather_flat(output, inp, group):
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, inp, group=group)


def chunk_bytes(total: int, n: int) -> int:
    """Equal chunks, each a multiple of 64 bytes so every chunk boundary stays aligned."""
    per = -(-total // n)
    return -(-per // CHUNK_ALIGN) * CHUNK_ALIGN


class ScatterAllgather(Strategy):
    name = "scatter_allgather"
    footprint = Footprint(leader=2.7, receiver=2.5, leader_kept=1)
    """Measured by the node memory phase (the packed message and its chunks on the leader; a
    chunk, the gathered buffer and its copy on a receiver)."""
    claims = "header broadcast + scatter (stage 0) + chunk broadcast (pp>1) + all-gather (tp·cp>1)"

    @dataclass(frozen=True, kw_only=True)
    class Options(Strategy.Options):
        header_bytes: int = 4096
        """Size of the first header broadcast, a multiple of 64 (a longer header takes a
        second one)."""
        max_bytes: int = DEFAULT_MAX_BYTES
        """Receivers refuse a header that claims more than this."""

        def __post_init__(self) -> None:
            super().__post_init__()
            hb = self.header_bytes
            if hb < PREFIX_BYTES or hb % 64:
                raise ValueError(
                    f"header_bytes must be a multiple of 64 and >= {PREFIX_BYTES}, got {hb}"
                )

    def __init__(self, groups, **options) -> None:
        super().__init__(groups, **options)
        self.header_bytes = self.options.header_bytes
        self.packer = Packer()  # leader: the send buffer and the last structure's layout
        self._headers: dict = {}  # receiver: the last header decoded, by its bytes
        self.last_header = None
        """The header of the last batch that arrived (on every rank alike; ``auto`` decides
        from it)."""

    def set_aside(self) -> None:
        self.packer.forget()  # the leader's send buffer: a batch's bytes, held for nothing

    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        n = g.tp_cp_size
        dev = g.device
        # 1. Header: everyone learns the message size and layout.
        if g.is_leader:
            buf, header = self._pack(batch)
            self._send_header(buf, header)
        else:
            header = self._receive_header()
        total = header.total_bytes
        c = chunk_bytes(total, n)
        # 2. Scatter on stage 0; 3. each chunk down its PP group; 4. all-gather per stage.
        if n == 1:
            mine = buf[:total] if g.is_leader else torch.empty(total, dtype=torch.uint8, device=dev)
        else:
            mine = torch.empty(c, dtype=torch.uint8, device=dev)
            if g.pp_rank == 0:
                parts = list(buf[: c * n].split(c)) if g.is_leader else None
                dist.scatter(mine, parts, src=g.tp_cp_ranks[0], group=g.tp_cp_group)
        if g.pp_size > 1:
            dist.broadcast(mine, src=g.pp_ranks[0], group=g.pp_group)
        if n == 1:
            full = mine
        else:
            # The leader already holds everything but must still take part in the collective
            # (which writes its own bytes back: its packer's buffer still holds this header).
            full = (
                buf[: c * n] if g.is_leader else torch.empty(c * n, dtype=torch.uint8, device=dev)
            )
            _all_gather_flat(full, mine, group=g.tp_cp_group)
        self.last_header = header
        if g.is_leader:
            return batch
        td, non_tensor = unpack(full, header)
        return deliver(batch, td, non_tensor)

    def _send_header(self, buf: torch.Tensor, header) -> None:
        """Leader: the header over the replica, in one broadcast of ``header_bytes`` (a longer
        header sends the rest in a second one)."""
        g = self.groups
        dist.broadcast(buf[: self.header_bytes], src=g.leader, group=g.replica_group)
        if header.header_len > self.header_bytes:
            dist.broadcast(
                buf[self.header_bytes : header.header_len], src=g.leader, group=g.replica_group
            )

    def _receive_header(self):
        """A receiver: the leader's header, from the first broadcast alone or (when its prefix
        says the header is longer) with the second broadcast's rest."""
        g = self.groups
        head = torch.empty(self.header_bytes, dtype=torch.uint8, device=g.device)
        dist.broadcast(head, src=g.leader, group=g.replica_group)
        prefix = read_prefix(head, self.options.max_bytes, g.rank)
        header_len = prefix.header_len
        if header_len > self.header_bytes:
            rest = torch.empty(header_len, dtype=torch.uint8, device=g.device)
            rest[: self.header_bytes].copy_(head)
            dist.broadcast(rest[self.header_bytes :], src=g.leader, group=g.replica_group)
            head = rest
        return read_header(head, self.options.max_bytes, g.rank, self._headers, prefix)

    def _pack(self, batch: DataProto):
        """Leader: everything that can fail, before the first collective; the buffer holds
        whole chunks."""
        g = self.groups
        nt = batch.non_tensor_batch if wants_non_tensor(batch) else None
        n = g.tp_cp_size

        def room(total: int) -> int:  # the last chunk's padding and the header broadcast
            return max(chunk_bytes(total, n) * n, self.header_bytes)

        buf, header, fill = self.packer.pack(batch.batch, nt, min_capacity=room, rank=g.rank)
        fill(header.total_bytes)
        return buf, header

    @classmethod
    def plan(cls, layout, spec: PayloadSpec, header_bytes: int = 4096) -> Plan:
        total = spec.message_bytes
        n = layout.tp_cp
        c = chunk_bytes(total, n) if n > 1 else total
        comms: list[Comm] = []
        if layout.replica_size == 1:
            return Plan(cls.name, comms)
        step = 0
        for ranks in layout.replica_groups():
            comms.append(Comm("broadcast", tuple(ranks), ranks[0], header_bytes, step, "header"))
        step += 1
        if spec.header_bytes > header_bytes:
            for ranks in layout.replica_groups():
                comms.append(
                    Comm(
                        "broadcast",
                        tuple(ranks),
                        ranks[0],
                        spec.header_bytes - header_bytes,
                        step,
                        "header",
                    )
                )
            step += 1
        if n > 1:
            for ranks in layout.stage0_tp_cp_groups():
                comms.append(Comm("scatter", tuple(ranks), ranks[0], c, step, "chunk"))
            step += 1
        if layout.pp > 1:
            for ranks in layout.groups("pp"):
                comms.append(Comm("broadcast", tuple(ranks), ranks[0], c, step, "chunk"))
            step += 1
        if n > 1:
            for ranks in layout.groups("tp-cp"):
                comms.append(Comm("all_gather", tuple(ranks), None, c * n, step, "chunk"))
        nt = spec.sent_non_tensor_bytes
        return Plan(
            cls.name,
            comms,
            leader=LocalWork(packed_bytes=total),
            receiver=LocalWork(pickled_bytes=nt),
            forwarder=LocalWork(pickled_bytes=nt),
        )


STRATEGY = ScatterAllgather
