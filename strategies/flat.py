"""``flat``: one hop over the whole replica (tp·cp·pp ranks) instead of the seed's two.

Same message and wire protocol as ``header`` (binary header + one flat buffer, one broadcast
in steady state), but a single broadcast from the leader to every rank of the replica, so
the collective library (gloo's tree, NCCL's ring) chooses the route instead of the seed's
TP-then-PP order. Options: see ``strategies.core.packed.PackedStrategy.Options``.
"""

from __future__ import annotations

from strategies.core.contract import DataProto
from strategies.core.footprint import Footprint
from strategies.core.header_format import align
from strategies.core.packed import PackedStrategy
from strategies.core.plan import Comm, PayloadSpec, Plan
from strategies.core.relay_plan import hop_comms, relay_work, steady_expect

OWN_THRESHOLD = object()
"""``plan``'s default for ``direct_min_bytes``: the class's own (direct's subclass sets one)."""


class Flat(PackedStrategy):
    name = "flat"
    footprint = Footprint(leader=1, receiver=1, leader_kept=1)
    """Measured by the node memory phase (the pack buffer, kept for the next call; receivers
    view what arrived)."""
    claims = "1 broadcast over the replica in steady state (2 when the batch outgrows it)"

    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        return self.relay(batch, [(g.replica_group, g.replica_ranks)])

    @classmethod
    def plan(
        cls,
        layout,
        spec: PayloadSpec,
        expect: int | None = None,
        direct_min_bytes: int | None | object = OWN_THRESHOLD,
    ) -> Plan:
        """``direct_min_bytes`` (strategies/direct.py): leaves of at least that many bytes leave
        the message and follow it in a broadcast each (default: the class's own threshold, None
        for flat); contiguous leaves assumed."""
        if direct_min_bytes is OWN_THRESHOLD:
            direct_min_bytes = cls.direct_min_bytes
        leaves = spec.leaf_bytes
        if leaves is None:  # only the total is known: equal leaves
            leaves = (spec.tensor_bytes // max(spec.n_tensors, 1),) * spec.n_tensors
        direct = [n for n in leaves if direct_min_bytes is not None and n >= direct_min_bytes]
        total = spec.message_bytes - sum(align(n) for n in direct)
        first = expect if expect is not None else steady_expect(total)
        groups = layout.replica_groups() if layout.replica_size > 1 else []
        comms, step = hop_comms([groups] if groups else [], total, first)
        for n in direct if groups else ():
            for ranks in groups:
                comms.append(Comm("broadcast", tuple(ranks), ranks[0], n, step, "leaf"))
            step += 1
        work = relay_work(spec, total, first, receiver_copies=True, forwarder=False)
        return Plan(cls.name, comms, **work)


STRATEGY = Flat
