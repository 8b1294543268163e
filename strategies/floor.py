"""``floor``: the measured limit, not a way to ship a batch.

One raw broadcast of an already packed flat buffer of the batch's tensor bytes (plus the
pickled non_tensor_batch when it is flagged to travel, so the byte count is the payload's) over
the whole replica: no header, no packing, no unpacking (``../shared/brief/measurement.md``). Receivers
allocate a fresh buffer per call, as any real receiver must. ``prepare`` (untimed) packs the
leader's buffer and tells receivers its size. ``get_data_input`` leaves the DataProto as it
was; the bytes it received stay in ``received`` for the harness to verify.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from strategies.core.codec import as_bytes, message_parts, nbytes_of
from strategies.core.contract import DataProto, Strategy, wants_non_tensor
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan


class Floor(Strategy):
    name = "floor"
    selectable = False
    claims = "1 broadcast over the replica"

    def __init__(self, groups) -> None:
        super().__init__(groups)
        self.nbytes = 0
        self.sent: torch.Tensor | None = None
        self.received: torch.Tensor | None = None

    def prepare(self, batch: DataProto) -> None:
        g = self.groups
        size = torch.zeros(1, dtype=torch.int64)
        if g.is_leader:
            parts = [as_bytes(t) for *_, t in message_parts(batch.batch)]
            if wants_non_tensor(batch):  # the same bytes: flagged non-tensor data travels too
                blob = pickle.dumps(batch.non_tensor_batch, protocol=pickle.HIGHEST_PROTOCOL)
                parts.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            self.sent = torch.cat([p.to(g.device) for p in parts]) if parts else torch.empty(0)
            size[0] = self.sent.numel()
        dist.broadcast(size, src=g.leader, group=g.cpu_replica_group)
        self.nbytes = int(size[0])

    def get_data_input(self, batch: DataProto) -> DataProto:
        g = self.groups
        if g.replica_ranks == (g.rank,):
            return batch
        if g.is_leader:
            dist.broadcast(self.sent, src=g.leader, group=g.replica_group)
            self.received = self.sent
        else:
            buf = torch.empty(self.nbytes, dtype=torch.uint8, device=g.device)
            dist.broadcast(buf, src=g.leader, group=g.replica_group)
            self.received = buf
        return batch

    @classmethod
    def plan(cls, layout, spec: PayloadSpec) -> Plan:
        comms = []
        nbytes = spec.tensor_bytes + (spec.non_tensor_bytes if spec.broadcast_non_tensor else 0)
        if layout.replica_size > 1:
            comms = [
                Comm("broadcast", tuple(r), r[0], nbytes, 0, "payload")
                for r in layout.replica_groups()
            ]
        return Plan(cls.name, comms, leader=LocalWork(), receiver=LocalWork())


def tensor_bytes(batch: DataProto) -> int:
    return sum(nbytes_of(t) for *_, t in message_parts(batch.batch))


STRATEGY = Floor
