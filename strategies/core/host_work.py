"""The work each role of a plan does off the network, priced: fixed-cost host calls (pickle,
unpickle, pack, unpack), bytes copied and pickled, a shared-memory hand-off's signals and a
pull plan's store fetches.

``strategies.core.pricing`` adds it to a plan's collectives. Pure: no process group, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from strategies.core.cluster import ClusterConf
from strategies.core.costs import LocalCost
from strategies.core.groups import node_split, stripes
from strategies.core.plan import Comm, LocalWork, Plan
from strategies.core.store_pricing import store_s


@dataclass(frozen=True)
class HostCalls:
    """How many fixed-cost host calls one role makes per ``get_data_input``."""

    pickles: int = 0
    unpickles: int = 0
    packs: int = 0
    unpacks: int = 0

    def seconds(self, cluster: ClusterConf) -> float:
        return (
            self.pickles * cluster.pickle_call_s
            + self.unpickles * cluster.unpickle_call_s
            + self.packs * cluster.pack_call_s
            + self.unpacks * cluster.unpack_call_s
        )


def has_forwarder(plan: Plan) -> bool:
    """True when some rank receives in one step and sends on in a later one (the root of a
    later broadcast/scatter, or a member of a later all_gather). Without one, a plan's
    ``forwarder`` work belongs to no rank and is not charged."""
    received: set[int] = set()
    by_step: dict[int, list[Comm]] = {}
    for c in plan.comms:
        by_step.setdefault(c.step, []).append(c)
    for step in sorted(by_step):
        comms = by_step[step]
        if received:
            for c in comms:
                if c.kind == "all_gather" and len(c.ranks) > 1:
                    if not received.isdisjoint(c.ranks):
                        return True
                elif c.root in received:
                    return True
        for c in comms:
            if len(c.ranks) > 1:
                received.update(r for r in c.ranks if r != c.root)
    return False


def host_calls(plan: Plan) -> dict[str, HostCalls]:
    """Fixed-cost host calls per role, inferred from what the plan says (plans carry bytes,
    not call counts):

    - an object hop is a step holding a comm with ``what == "pickle"`` (``broadcast_object_list``
      and its kin: the source pickles, every receiver unpickles). The leader pickles once per
      object hop, a receiver unpickles once, a forwarder unpickles and pickles once each.
    - a role with ``pickled_bytes`` > 0 but no object hop and no packing pickles (leader) or
      unpickles (receiver) once, both for a forwarder (one object sent once per call).
    - a leader with ``packed_bytes`` > 0 packs once, and then every receiver (of a comm or of a
      shared-memory hand-off) decodes the header and unpacks once (pickled non-tensor data inside the message is part of those calls).
      A forwarder passes the buffer on before it unpacks, so its unpack is off the path.
    """
    object_hops = len({c.step for c in plan.comms if c.what == "pickle"})
    packs = plan.leader.packed_bytes > 0
    moves = any(len(c.ranks) > 1 for c in plan.comms) or any(len(h.ranks) > 1 for h in plan.shared)
    if object_hops:
        leader = HostCalls(pickles=object_hops, packs=int(packs))
        receiver = HostCalls(unpickles=1, unpacks=int(packs and moves))
        forwarder = HostCalls(pickles=1, unpickles=1) if object_hops >= 2 else HostCalls()
    else:
        lone = not packs  # pickled bytes inside a pack are part of the pack/unpack calls
        leader = HostCalls(pickles=int(lone and plan.leader.pickled_bytes > 0), packs=int(packs))
        receiver = HostCalls(
            unpickles=int(lone and plan.receiver.pickled_bytes > 0),
            unpacks=int(packs and moves),
        )
        n = int(lone and plan.forwarder.pickled_bytes > 0)
        forwarder = HostCalls(pickles=n, unpickles=n)
    return {"leader": leader, "forwarder": forwarder, "receiver": receiver}


def price_local(
    work: LocalWork, cluster: ClusterConf, role: str, calls: HostCalls | None = None
) -> LocalCost:
    """Seconds of host work for one role. A forwarder unpickles what it got and pickles it again
    to send it on, so its pickled bytes pay both directions. ``packed_bytes`` and
    ``copied_bytes`` move at ``ClusterConf.pack_copy_bytes_per_s`` (on-device where the ranks hold
    their batch on a device); ``calls`` adds the fixed per-call host costs."""
    pickled = work.pickled_bytes
    return LocalCost(
        role=role,  # type: ignore[arg-type]
        pickle_s=pickled / cluster.pickle_bytes_per_s if role != "receiver" else 0.0,
        unpickle_s=pickled / cluster.unpickle_bytes_per_s if role != "leader" else 0.0,
        memcpy_s=(work.packed_bytes + work.copied_bytes) / cluster.pack_copy_bytes_per_s,
        d2h_s=work.d2h_bytes / cluster.d2h_bytes_per_s,
        h2d_s=work.h2d_bytes / cluster.h2d_bytes_per_s,
        calls_s=calls.seconds(cluster) if calls is not None else 0.0,
    )


def local_costs(plan: Plan, cluster: ClusterConf) -> tuple[LocalCost, ...]:
    """Leader, forwarder and receiver work; the forwarder's only when some rank forwards. The
    leader's carries the shared-memory signals (``handoff_signals``), the receiver's the
    store fetches of a pull plan (``store_pricing.store_s``: the put is on that path too)."""
    calls = host_calls(plan)
    forwarder = plan.forwarder if has_forwarder(plan) else LocalWork()
    if forwarder is not plan.forwarder:
        calls["forwarder"] = HostCalls()
    costs = [
        price_local(work, cluster, role, calls[role])
        for role, work in (
            ("leader", plan.leader),
            ("forwarder", forwarder),
            ("receiver", plan.receiver),
        )
    ]
    costs[0] = replace(costs[0], signal_s=handoff_signals(plan, cluster) * cluster.signal_s)
    costs[2] = replace(costs[2], store_s=store_s(plan, cluster))
    return tuple(costs)


def handoff_signals(plan: Plan, cluster: ClusterConf) -> int:
    """Signals on the critical path of the plan's hand-offs: the most ranks any writer signals
    (a node's writer tells its node's other ranks one after another; the replica leader
    signals its own node while its sends to the other nodes are in flight, so the path is the
    crossings, then the busiest other node's signals). A striped crossing adds the leader's
    signals up to its last stripe sender (which sends once signalled) and one report from
    the other node's stripe receivers (each a message of the same cost)."""
    most = 0
    for h in plan.shared:
        nodes = node_split(h.ranks, cluster.node_of)
        most = max(most, max(len(node) - 1 for node in nodes))
        for node, crossing in zip(nodes[1:], stripes(nodes, h.nbytes, h.stripe_min_bytes)):
            if len(crossing) > 1:
                most = max(most, (len(crossing) - 1) + 1 + (len(node) - 1))
    return most
