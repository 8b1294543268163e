"""Price a communication ``Plan`` on a cluster with the Hockney α–β model, without running it.

``price`` says how long one call of a plan takes on a ``ClusterConf``, on which link, and
whether latency (α) or bandwidth (β) dominates; ``host_calls`` and ``price_local`` add the
work each role does off the network; ``lower_bound_s`` is what no broadcast can beat. Pure: no
process group, no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from strategies.core.cluster import ClusterConf
from strategies.core.formulas import COLLECTIVES, ceil_log2, coefficients, tree_rounds
from strategies.core.groups import node_split, stripes
from strategies.core.layout import Layout
from strategies.core.plan import Comm, LocalWork, Plan

LinkName = Literal["intra", "inter", "none"]


@dataclass(frozen=True)
class CommCost:
    """The price of one collective as issued in its step."""

    step: int
    kind: str
    what: str
    group_size: int
    first_rank: int
    """Lowest global rank of the group (names the group in a report)."""
    nbytes: int
    link: LinkName
    """'intra', 'inter' (the group spans nodes; a tree broadcast pays inter only in the rounds
    whose edges cross), or 'none' for a group of one."""
    nodes: int
    """Distinct nodes the group touches."""
    nic_share: float
    """How many flows share each port at the busiest node the group touches (≥ 1); the β term
    is multiplied by it."""
    alpha_s: float
    """Latency term a·α."""
    beta_s: float
    """Bandwidth term b·β·nic_share."""
    exact: bool

    @property
    def total_s(self) -> float:
        return self.alpha_s + self.beta_s


@dataclass(frozen=True)
class StepCost:
    """One step: concurrent collectives on disjoint groups; the slowest sets the pace."""

    step: int
    critical: CommCost
    """The slowest collective of the step."""
    n_comms: int
    n_inter: int
    """How many of the step's collectives cross nodes."""
    max_nic_share: float

    @property
    def total_s(self) -> float:
        return self.critical.total_s


@dataclass(frozen=True)
class LocalCost:
    """Work one role does off the network, priced from ``LocalWork`` and the host throughputs."""

    role: Literal["leader", "forwarder", "receiver"]
    pickle_s: float
    unpickle_s: float
    memcpy_s: float
    """``packed_bytes`` + ``copied_bytes`` at ``ClusterConf.pack_copy_bytes_per_s``."""
    d2h_s: float
    h2d_s: float
    calls_s: float = 0.0
    """Fixed per-call host overhead (pickle/unpickle/pack/unpack calls, see ``host_calls``)."""
    signal_s: float = 0.0
    """Shared-memory signals on the critical path (``handoff_signals`` × ``signal_s``; leader)."""

    @property
    def total_s(self) -> float:
        return (
            self.pickle_s
            + self.unpickle_s
            + self.memcpy_s
            + self.d2h_s
            + self.h2d_s
            + self.calls_s
            + self.signal_s
        )


@dataclass(frozen=True)
class Prediction:
    """What ``price`` says about one plan on one cluster."""

    strategy: str
    cluster: str
    layout: str
    total_s: float
    """Critical path: leader work + Σ steps (slowest comm each) + forwarder + receiver work."""
    comm_s: float
    local_s: float
    alpha_s: float
    """Latency share of comm_s (sum over steps of the critical comm's α term)."""
    beta_s: float
    """Bandwidth share of comm_s, NIC sharing included."""
    inter_s: float
    """Part of comm_s spent in steps whose critical comm crosses nodes."""
    steps: tuple[StepCost, ...]
    local: tuple[LocalCost, ...]
    exact: bool
    """False when any comm's size was an estimate."""
    oversubscription: float = 1.0
    """CPU time-slicing factor already applied to every term (``ClusterConf.oversubscription``)."""

    def dominant(self) -> str:
        """One phrase for a report: which link and which term dominate the total."""
        if self.total_s <= 0:
            return "nothing to do"
        parts = {"local work": self.local_s}
        for link in ("intra", "inter"):
            steps = [s for s in self.steps if s.critical.link == link]
            parts[f"{link}-node α"] = sum(s.critical.alpha_s for s in steps)
            parts[f"{link}-node β"] = sum(s.critical.beta_s for s in steps)
        name, value = max(parts.items(), key=lambda kv: kv[1])
        return f"{name} ({100 * value / self.total_s:.0f}% of {self.total_s * 1e3:.3g} ms)"

    def rows(self) -> list[dict[str, Any]]:
        """One row per step and per local role, for a pandas DataFrame."""
        out: list[dict[str, Any]] = []
        for s in self.steps:
            c = s.critical
            out.append(
                dict(
                    strategy=self.strategy,
                    cluster=self.cluster,
                    part=f"step {s.step}",
                    kind=c.kind,
                    what=c.what,
                    link=c.link,
                    group_size=c.group_size,
                    nodes=c.nodes,
                    nbytes=c.nbytes,
                    n_comms=s.n_comms,
                    n_inter=s.n_inter,
                    nic_share=c.nic_share,
                    alpha_s=c.alpha_s,
                    beta_s=c.beta_s,
                    total_s=c.total_s,
                    exact=c.exact,
                )
            )
        for w in self.local:
            out.append(
                dict(
                    strategy=self.strategy,
                    cluster=self.cluster,
                    part=f"local {w.role}",
                    kind="local",
                    what="pickle/unpickle/copy/d2h/h2d/calls/signals",
                    link="host",
                    alpha_s=0.0,
                    beta_s=w.total_s,
                    total_s=w.total_s,
                    exact=True,
                )
            )
        return out

    def summary(self) -> str:
        over = self.oversubscription
        lines = [
            f"{self.strategy} on {self.cluster} ({self.layout}): {self.total_s * 1e3:.4g} ms"
            f"{'' if self.exact else ' (estimated sizes)'}; dominated by {self.dominant()}"
            + (f"; ×{over:.3g} CPU oversubscription included" if over != 1 else "")
        ]
        for s in self.steps:
            c = s.critical
            lines.append(
                f"  step {s.step}: {c.kind} {c.what} {c.nbytes} B over {c.group_size} ranks "
                f"on {c.link} ({c.nodes} nodes, {s.n_comms} groups, share {c.nic_share:g}): "
                f"α {c.alpha_s * 1e3:.4g} ms + β {c.beta_s * 1e3:.4g} ms"
            )
        for w in self.local:
            if w.total_s:
                lines.append(f"  local {w.role}: {w.total_s * 1e3:.4g} ms")
        return "\n".join(lines)


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


# -- one step ---------------------------------------------------------------------------------
@dataclass
class _Flows:
    """Flows leaving each node during one step. A tree broadcast that crosses nodes is priced
    round by round (its crossing edges per round are its flows); any other crossing collective
    is one flow from each node it touches for the whole step."""

    nics: int
    whole_at: Counter[int] = field(default_factory=Counter)
    """Whole-step flows per node."""
    round_at: list[Counter[int]] = field(default_factory=list)
    """Tree flows per round per node (concurrent trees run their rounds in lock-step)."""

    def share(self, node: int, k: int | None) -> float:
        """Flows per port at ``node`` in tree round ``k`` (None: a whole-step flow, which meets
        the busiest round of the trees); k flows over m ports each get m/k of a port."""
        if k is None:
            tree_flows = max((rc[node] for rc in self.round_at), default=0)
        else:
            tree_flows = self.round_at[k][node]
        return max(1.0, (self.whole_at[node] + tree_flows) / self.nics)


def _step_flows(comms: list[Comm], cluster: ClusterConf):
    """Which comms cross nodes (their nodes, or None), the tree rounds of crossing tree
    broadcasts, and the flows they put on each node's ports."""
    g = cluster.gpus_per_node
    flows = _Flows(cluster.nics_per_node)
    spans: list[tuple[int, ...] | None] = []
    trees: dict[int, list[list[tuple[int, int]]]] = {}
    for i, c in enumerate(comms):
        if min(c.ranks) // g == max(c.ranks) // g:
            spans.append(None)
            continue
        nodes = tuple({r // g for r in c.ranks})
        spans.append(nodes)
        if c.kind == "broadcast" and cluster.broadcast_algorithm == "tree":
            trees[i] = rounds = tree_rounds(tuple(c.ranks), c.root)
            while len(flows.round_at) < len(rounds):
                flows.round_at.append(Counter())
            for k, edges in enumerate(rounds):
                flows.round_at[k].update(s // g for s, r in edges if s // g != r // g)
        else:
            flows.whole_at.update(nodes)
    return spans, trees, flows


def _tree_cost(c: Comm, rounds, cluster: ClusterConf, flows: _Flows):
    """(α, β, worst share) of a crossing tree broadcast: each round lasts as long as its
    slowest edge; an intra-node edge pays ``intra``, a crossing one ``inter`` × its share."""
    g = cluster.gpus_per_node
    intra = cluster.link(c.kind, crosses_nodes=False)
    inter = cluster.link(c.kind, crosses_nodes=True)
    intra_edge = (intra.alpha_s, c.nbytes * intra.beta_s_per_byte, 1.0)
    inter_alpha, inter_beta = inter.alpha_s, c.nbytes * inter.beta_s_per_byte
    alpha_s = beta_s = 0.0
    share = 1.0
    for k, edges in enumerate(rounds):
        worst = (0.0, 0.0, 1.0)
        for s, r in edges:
            if s // g == r // g:
                edge = intra_edge
            else:
                f = flows.share(s // g, k)
                edge = (inter_alpha, inter_beta * f, f)
            if edge[0] + edge[1] > worst[0] + worst[1]:
                worst = edge
        alpha_s += worst[0]
        beta_s += worst[1]
        share = max(share, worst[2])
    return alpha_s, beta_s, share


def _comm_cost(step: int, c: Comm, nodes, rounds, cluster: ClusterConf, flows: _Flows):
    """The ``CommCost`` of one comm of a step, given how the step loads each node's ports."""
    p = len(c.ranks)
    if nodes is None:
        a, b = coefficients(c.kind, p, c.nbytes, **cluster.algorithms())
        link = cluster.link(c.kind, crosses_nodes=False)
        link_name, share, n_nodes = ("intra" if p > 1 else "none"), 1.0, 1
        alpha_s, beta_s = a * link.alpha_s, b * link.beta_s_per_byte
    elif rounds is not None:
        link_name, n_nodes = "inter", len(nodes)
        alpha_s, beta_s, share = _tree_cost(c, rounds, cluster, flows)
    else:
        a, b = coefficients(c.kind, p, c.nbytes, **cluster.algorithms())
        link = cluster.link(c.kind, crosses_nodes=True)
        link_name, n_nodes = "inter", len(nodes)
        share = max(flows.share(n, None) for n in nodes)
        alpha_s, beta_s = a * link.alpha_s, b * link.beta_s_per_byte * share
    return CommCost(
        step=step,
        kind=c.kind,
        what=c.what,
        group_size=p,
        first_rank=min(c.ranks),
        nbytes=c.nbytes,
        link=link_name,  # type: ignore[arg-type]
        nodes=n_nodes,
        nic_share=share,
        alpha_s=alpha_s,
        beta_s=beta_s,
        exact=c.exact,
    )


def _price_step(step: int, comms: list[Comm], cluster: ClusterConf) -> StepCost:
    """The step's comms run at once on disjoint groups: the slowest sets the pace."""
    spans, trees, flows = _step_flows(comms, cluster)
    best: CommCost | None = None
    max_share = 1.0
    for i, (c, nodes) in enumerate(zip(comms, spans)):
        cost = _comm_cost(step, c, nodes, trees.get(i), cluster, flows)
        max_share = max(max_share, cost.nic_share)
        if best is None or cost.total_s > best.total_s:
            best = cost
    assert best is not None
    n_inter = sum(nodes is not None for nodes in spans)
    return StepCost(step, best, len(comms), n_inter, max_share)


def _check_disjoint(step: int, comms: Iterable[Comm]) -> None:
    seen: dict[int, Comm] = {}
    for c in comms:
        for r in c.ranks:
            if r in seen:
                raise ValueError(
                    f"step {step}: rank {r} is in two concurrent groups ({seen[r].kind} from "
                    f"{seen[r].root}, {c.kind} from {c.root}); same-step comms must be disjoint"
                )
            seen[r] = c


# -- one plan ---------------------------------------------------------------------------------
def _steps_of(plan: Plan, layout: Layout | None, check: bool) -> dict[int, list[Comm]]:
    """The plan's comms by step; with ``check``, same-step groups are disjoint and every rank
    fits ``layout``."""
    by_step: dict[int, list[Comm]] = {}
    for c in plan.comms:
        if c.kind not in COLLECTIVES:
            raise ValueError(f"plan {plan.strategy!r}: unknown collective {c.kind!r}")
        if c.nbytes < 0:
            raise ValueError(f"plan {plan.strategy!r}: negative nbytes in {c}")
        by_step.setdefault(c.step, []).append(c)
    if not check:
        return by_step
    world = layout.world_size if layout is not None else None
    for step, comms in by_step.items():
        _check_disjoint(step, comms)
        top = max(max(c.ranks) for c in comms)
        if world is not None and top >= world:
            raise ValueError(
                f"plan {plan.strategy!r} step {step} names rank {top}, outside "
                f"{layout.describe()} (world {world})"  # type: ignore[union-attr]
            )
    return by_step


def _local_costs(plan: Plan, cluster: ClusterConf) -> tuple[LocalCost, ...]:
    """Leader, forwarder and receiver work; the forwarder's only when some rank forwards. The
    leader's carries the shared-memory signals (``handoff_signals``)."""
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
    return tuple(costs)


def handoff_comms(plan: Plan, cluster: ClusterConf, step: int) -> list[Comm]:
    """The crossings of the plan's hand-offs, from ``step`` on: the root's message to the
    first rank of each other node, or its stripes from the ranks of the root's node to the
    ranks of that node (``groups.stripes``: concurrent flows that the step's port shares
    price), the j-th node of every replica in step ``step + j`` (the
    replicas' roots send at once; one root's sends share its node's port, so taking them one
    per step prices the same bytes through it). The size each is announced with travels
    ahead on the same connection and is not priced. Each crossing is priced on the cluster's
    inter-node link, the one its collectives use; shm sends through gloo's host sockets, so on
    a cluster whose collectives run on NCCL over InfiniBand this is optimistic."""
    comms = []
    for h in plan.shared:
        nodes = node_split(h.ranks, cluster.node_of)
        for j, node in enumerate(stripes(nodes, h.nbytes, h.stripe_min_bytes)):
            comms += [
                Comm(
                    "broadcast", (s.sender, s.receiver), s.sender, s.hi - s.lo, step + j, "handoff"
                )
                for s in node
            ]
    return comms


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


_LOCAL_PARTS = ("pickle_s", "unpickle_s", "memcpy_s", "d2h_s", "h2d_s", "calls_s", "signal_s")


def _oversubscribed(steps, local, factor: float):
    """Every α, β and local term × ``factor`` (CPU time-slicing)."""
    if factor == 1.0:
        return steps, local
    steps = tuple(
        replace(s, critical=replace(s.critical, alpha_s=s.critical.alpha_s * factor,
                                    beta_s=s.critical.beta_s * factor))
        for s in steps
    )  # fmt: skip
    local = tuple(replace(w, **{k: getattr(w, k) * factor for k in _LOCAL_PARTS}) for w in local)
    return steps, local


def price(
    plan: Plan, cluster: ClusterConf, layout: Layout | None = None, check: bool = True
) -> Prediction:
    """Predict one call of ``plan`` on ``cluster``.

    Ranks live on node ``rank // gpus_per_node``. A group inside one node pays ``intra``; a
    group spanning nodes pays ``inter`` (a tree broadcast only in the rounds whose edges cross,
    see ``tree_rounds``). Steps run in order; a step's comms run at once on disjoint groups and
    share each node's ports (flows beyond ``nics_per_node`` divide the bandwidth), so a step
    costs its slowest comm. Local work is taken as serial with the network (a
    conservative critical path): leader, forwarder and receiver work are added once each, the
    forwarder's only when the plan has one (``has_forwarder``), each with its fixed per-call
    host costs (``host_calls``). A plan's shared-memory hand-offs (``Plan.shared``) follow its
    comms: their crossings of nodes as point-to-point steps (``handoff_comms``) and their
    signals as the leader's ``signal_s`` (``handoff_signals``). On a CPU cluster every term is then multiplied by
    ``cluster.oversubscription(world)``, world = ``layout.world_size`` (or the highest rank the
    plan names, plus one). ``check`` verifies ranks fit ``layout`` and same-step groups are
    disjoint (cheap, O(ranks)).
    """
    by_step = _steps_of(plan, layout, check)
    for c in handoff_comms(plan, cluster, plan.steps):
        by_step.setdefault(c.step, []).append(c)
    steps = tuple(_price_step(s, by_step[s], cluster) for s in sorted(by_step))
    if layout is not None:
        world = layout.world_size
    else:
        named = [r for c in plan.comms for r in c.ranks] + [r for h in plan.shared for r in h.ranks]
        world = 1 + max(named, default=0)
    over = cluster.oversubscription(world)
    steps, local = _oversubscribed(steps, _local_costs(plan, cluster), over)
    comm_s = sum(s.total_s for s in steps)
    local_s = sum(w.total_s for w in local)
    return Prediction(
        strategy=plan.strategy,
        cluster=cluster.name,
        layout=layout.describe() if layout is not None else "?",
        total_s=comm_s + local_s,
        comm_s=comm_s,
        local_s=local_s,
        alpha_s=sum(s.critical.alpha_s for s in steps),
        beta_s=sum(s.critical.beta_s for s in steps),
        inter_s=sum(s.total_s for s in steps if s.critical.link == "inter"),
        steps=steps,
        local=local,
        exact=all(c.exact for c in plan.comms),
        oversubscription=over,
    )


def lower_bound_s(cluster: ClusterConf, group_size: int, nbytes: int, crosses_nodes: bool) -> float:
    """max(⌈log₂p⌉·α, n·β): no broadcast of n bytes to p ranks on this link can beat it."""
    link = cluster.link("broadcast", crosses_nodes)
    return max(ceil_log2(group_size) * link.alpha_s, nbytes * link.beta_s_per_byte)
