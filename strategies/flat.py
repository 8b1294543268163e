"""``flat``: one hop over the whole replica (tp·cp·pp ranks) instead of the seed's two.

Same message and wire protocol as ``header`` (binary header + one flat buffer, one broadcast
in steady state), but a single broadcast from the leader to every rank of the replica, so
the collective library (gloo's tree, NCCL's ring) chooses the route instead of the seed's
TP-then-PP order. Options: see ``strategies.packed.PackedStrategy``.
"""

from __future__ import annotations

from strategies.base import DataProto
from strategies.header import _steady_expect, _wire_comms
from strategies.packed import PackedStrategy
from strategies.plan import LocalWork, PayloadSpec, Plan


class Flat(PackedStrategy):
    name = "flat"
    claims = "1 broadcast over the replica in steady state (2 when the batch outgrows it)"

    def get_data_input(self, batch: DataProto) -> DataProto:
        g = self.groups
        return self.relay(batch, [(g.replica_group, g.replica_ranks)])

    @classmethod
    def plan(cls, layout, spec: PayloadSpec, expect: int | None = None) -> Plan:
        total = spec.message_bytes
        first = expect if expect is not None else _steady_expect(total)
        comms = []
        if layout.replica_size > 1:
            _wire_comms(comms, layout.replica_groups(), total, first, 0)
        nt = spec.non_tensor_bytes if spec.broadcast_non_tensor else 0
        return Plan(
            cls.name,
            comms,
            leader=LocalWork(packed_bytes=total),
            receiver=LocalWork(pickled_bytes=nt, copied_bytes=first if total > first else 0),
        )


STRATEGY = Flat
