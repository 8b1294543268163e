"""Price a communication ``Plan`` on a cluster with the Hockney α–β model, without running it.

``price`` says how long one call of a plan takes on a ``ClusterConf``, on which link, and
whether latency (α) or bandwidth (β) dominates (its records: ``strategies.core.costs``); the
work each role does off the network is priced by ``strategies.core.host_work``;
``lower_bound_s`` is what no broadcast can beat. Pure: no process group, no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from strategies.core.cluster import ClusterConf
from strategies.core.costs import LOCAL_TERMS, CommCost, Prediction, StepCost
from strategies.core.formulas import COLLECTIVES, ceil_log2, coefficients, tree_rounds
from strategies.core.groups import node_split, stripes
from strategies.core.host_work import local_costs
from strategies.core.layout import Layout
from strategies.core.plan import Comm, Plan


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


def _oversubscribed(steps, local, factor: float):
    """Every α, β and local term × ``factor`` (CPU time-slicing)."""
    if factor == 1.0:
        return steps, local
    steps = tuple(
        replace(s, critical=replace(s.critical, alpha_s=s.critical.alpha_s * factor,
                                    beta_s=s.critical.beta_s * factor))
        for s in steps
    )  # fmt: skip
    local = tuple(replace(w, **{k: getattr(w, k) * factor for k in LOCAL_TERMS}) for w in local)
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
    signals as the leader's ``signal_s`` (``handoff_signals``); its store fetches
    (``Plan.stores``) as the receiver's ``store_s`` (``store_pricing``). On a CPU cluster every term is then multiplied by
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
        named += [r for f in plan.stores for r in f.ranks]
        world = 1 + max(named, default=0)
    over = cluster.oversubscription(world)
    steps, local = _oversubscribed(steps, local_costs(plan, cluster), over)
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
