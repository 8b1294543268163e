"""``header``: the seed's two hops (TP×CP on stage 0, then PP), tensors only, no pickle of
tensor data.

The leader packs a compact binary header (keys, dtypes, shapes, offsets) and every tensor of
every dtype into one flat buffer (``strategies.core.packer``). Each hop moves it with a ``Wire``:
receivers post a first broadcast of the size the previous call announced, so in steady state a
hop is ONE broadcast (two when the batch outgrows the announced size, e.g. the first call).
Stage-0 ranks forward the received buffer unchanged on the PP hop; receivers get zero-copy
views. Non-tensor data travels (pickled, inside the same buffer) only when flagged.
Options: see ``strategies.core.packed.PackedStrategy.Options``.
"""

from __future__ import annotations

from strategies.core.contract import DataProto
from strategies.core.footprint import Footprint
from strategies.core.packed import PackedStrategy
from strategies.core.plan import PayloadSpec, Plan
from strategies.core.relay_plan import hop_comms, relay_work, steady_expect


class HeaderStrategy(PackedStrategy):
    name = "header"
    footprint = Footprint(leader=1, receiver=1, leader_kept=1)
    """Measured by the node memory phase (the pack buffer, kept for the next call; receivers
    view what arrived)."""
    claims = "1 broadcast per hop in steady state (2 when the batch outgrows the announced size)"

    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        return self.relay(batch, [(hop.group, hop.ranks) for hop in g.seed_hops()])

    @classmethod
    def plan(cls, layout, spec: PayloadSpec, expect: int | None = None) -> Plan:
        """Steady state by default (first message = this batch's size); pass ``expect`` to
        plan a call that follows a different announced size."""
        total = spec.message_bytes
        first = expect if expect is not None else steady_expect(total)
        comms, _ = hop_comms(layout.seed_hop_groups(), total, first)
        work = relay_work(spec, total, first, receiver_copies=False, forwarder=True)
        return Plan(cls.name, comms, **work)


STRATEGY = HeaderStrategy
