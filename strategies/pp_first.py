"""``pp_first``: the seed's two hops in the other order — PP first, then TP×CP on every stage.

The leader first sends the packed message down its own PP group (the stage leaders, tp = cp =
0 of each stage), then every stage leader fans it out inside its stage's TP×CP group, all
stages at once. The seed's order instead fans out on stage 0 and then runs tp·cp PP
broadcasts in parallel, so every stage-0 rank sends a full copy across the (usually
inter-node) PP link; here only the leader's PP group crosses stages, and the tp·cp copies stay
inside each stage (usually one node). Message, header format and wire protocol are those of
``header`` (``strategies.core.packer`` + ``strategies.core.wire.Wire``: one broadcast per hop in steady
state, two when the batch outgrows the announced size); stage leaders forward the received
buffer unchanged; receivers get zero-copy views. Non-tensor data travels (pickled, inside the
same buffer) only when flagged. Options: see ``strategies.core.packed.PackedStrategy.Options``.
"""

from __future__ import annotations

from strategies.core.contract import DataProto
from strategies.core.footprint import Footprint
from strategies.core.layout import leader_pp_groups
from strategies.core.packed import PackedStrategy
from strategies.core.plan import PayloadSpec, Plan
from strategies.core.relay_plan import hop_comms, relay_work, steady_expect


class PpFirst(PackedStrategy):
    name = "pp_first"
    footprint = Footprint(leader=1, receiver=1, leader_kept=1)
    """Measured by the node memory phase (the pack buffer, kept for the next call; receivers
    view what arrived)."""
    claims = (
        "1 broadcast per hop in steady state (2 when the batch outgrows the announced size): "
        "the leader's PP group if pp>1, then every stage's TP×CP group if tp·cp>1"
    )

    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        hops = []
        if g.pp_size > 1 and g.tp_cp_rank == 0:  # stage leaders first: cross nodes once
            hops.append((g.pp_group, g.pp_ranks))
        if g.tp_cp_size > 1:
            hops.append((g.tp_cp_group, g.tp_cp_ranks))
        return self.relay(batch, hops)

    @classmethod
    def plan(cls, layout, spec: PayloadSpec, expect: int | None = None) -> Plan:
        """Steady state by default (first message = this batch's size); pass ``expect`` to
        plan a call that follows a different announced size."""
        total = spec.message_bytes
        first = expect if expect is not None else steady_expect(total)
        hops = []
        if layout.replica_size > 1:
            if layout.pp > 1:
                hops.append(leader_pp_groups(layout))
            if layout.tp_cp > 1:
                hops.append(layout.groups("tp-cp"))
        comms, _ = hop_comms(hops, total, first)
        work = relay_work(spec, total, first, receiver_copies=True, forwarder=True)
        return Plan(cls.name, comms, **work)


STRATEGY = PpFirst
