"""The replica groups derived from megatron-core's own initialized groups, and the checks that
every group the project uses agrees with megatron-core's.

megatron-core keeps its order string only inside a local RankGenerator, so the replica group
(all tp·cp·pp ranks of a DP replica, which megatron-core never builds) cannot be regenerated
from an order without guessing it. Instead every rank reports the groups megatron-core gave it
(``MegatronView``); the replicas are the connected components of the TP×CP and PP groups, and
each one is checked against megatron-core's DP, DP×CP, CP, TP and model-parallel groups. The
maths here is pure (no process group), so it is tested at large world sizes with
``strategies.core.layout`` as the oracle; ``ProcessGroups.from_megatron`` gathers the views.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from strategies.core.formulas import chunk_bounds


class GroupMismatch(RuntimeError):
    """The groups megatron-core built do not form the layout the strategies need (or disagree
    with an order the caller passed); the message names the ranks and both groupings."""


@dataclass(frozen=True)
class MegatronView:
    """The global ranks of the groups megatron-core gave one rank (group-rank order)."""

    rank: int
    tp: tuple[int, ...]
    cp: tuple[int, ...]
    tp_cp: tuple[int, ...]
    pp: tuple[int, ...]
    dp: tuple[int, ...]
    """Megatron's DP group without CP (one rank per replica)."""
    dp_cp: tuple[int, ...]
    """Megatron's DP group with CP (``with_context_parallel=True``)."""
    mp: tuple[int, ...]
    """Megatron's model-parallel group (TP×PP: it leaves CP out)."""
    node: str = ""
    """The host this rank runs on (``node_key``): ranks with the same key share memory."""


def node_key(env: Mapping[str, str] = os.environ) -> str:
    """Which host this process runs on, as its launcher numbers hosts: torchrun's GROUP_RANK,
    Slurm's SLURM_NODEID, else RANK // LOCAL_WORLD_SIZE where a launcher set both (the blocks
    of consecutive ranks torchrun and the forked world give each host), else the host name.
    A world that knows better (Ray's node id) passes its own key to ``from_megatron``."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if env.get(name, "").isdigit():
            return f"node {int(env[name])}"
    rank, per_node = env.get("RANK", ""), env.get("LOCAL_WORLD_SIZE", "")
    if rank.isdigit() and per_node.isdigit() and int(per_node) > 0:
        return f"node {int(rank) // int(per_node)}"
    return f"host {socket.gethostname()}"


def node_indices(keys: Sequence[str]) -> tuple[int, ...]:
    """Each rank's node as a small integer (``keys[r]`` is rank r's ``node_key``), numbered in
    the order the nodes first appear by rank."""
    index: dict[str, int] = {}
    return tuple(index.setdefault(k, len(index)) for k in keys)


def node_split(
    ranks: Sequence[int], node_of: Sequence[int] | Callable[[int], int]
) -> tuple[tuple[int, ...], ...]:
    """``ranks`` (a replica, in its order) split by node: one tuple per node, in the order the
    nodes first appear in ``ranks``, each in ``ranks``' order. Its first ranks are the node
    leaders, and the first of those is ``ranks[0]`` (the replica's leader). ``node_of`` is each
    rank's node, by index (a world's) or as a function (a cluster's ``ClusterConf.node_of``);
    an empty sequence means one node."""
    if not callable(node_of) and not node_of:
        return (tuple(ranks),)
    lookup = node_of if callable(node_of) else node_of.__getitem__
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(lookup(r), []).append(r)
    return tuple(tuple(members) for members in by_node.values())


@dataclass(frozen=True)
class Stripe:
    """One slice of a message crossing to another node: ``sender`` (on the replica leader's
    node) sends bytes [lo, hi) to ``receiver`` (on the other node)."""

    sender: int
    receiver: int
    lo: int
    hi: int


def stripes(
    nodes: Sequence[Sequence[int]], nbytes: int, min_bytes: int | None
) -> tuple[tuple[Stripe, ...], ...]:
    """How a message of ``nbytes`` crosses from the first node of ``nodes`` (``node_split``'s
    tuples, the replica leader's node first) to each other node: one tuple of stripes per
    other node. The i-th rank of the first node sends the i-th page-aligned slice to the i-th
    rank of the other node, as many slices as the smaller node has ranks, so each rank's own
    link carries its share (one link per GPU) and the node's link carries the message once.
    A message below ``min_bytes`` (or ``min_bytes`` None) crosses whole, leader to node
    leader. Pure: every rank derives the same stripes from the same arguments."""
    first = nodes[0] if nodes else ()
    out = []
    for node in nodes[1:]:
        k = min(len(first), len(node)) if min_bytes is not None and nbytes >= min_bytes else 1
        bounds = chunk_bounds(nbytes, k)
        out.append(tuple(Stripe(first[i], node[i], lo, hi) for i, (lo, hi) in enumerate(bounds)))
    return tuple(out)


def _components(views: dict[int, MegatronView]) -> dict[int, frozenset[int]]:
    """Connected components of the graph whose edges join the members of every TP×CP and PP
    group: each one is a replica when megatron-core's groups are orthogonal."""
    parent = {r: r for r in views}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for v in views.values():
        for group in (v.tp_cp, v.pp):
            for other in group:
                if other not in parent:
                    raise GroupMismatch(
                        f"rank {v.rank}: megatron-core's group {list(group)} names rank {other}, "
                        f"outside the world of {len(views)} ranks"
                    )
                parent[find(other)] = find(group[0])
    members: dict[int, set[int]] = {}
    for r in views:
        members.setdefault(find(r), set()).add(r)
    return {r: frozenset(members[find(r)]) for r in views}


def _check_rank(v: MegatronView, views: dict[int, MegatronView], replica: frozenset[int]) -> None:
    """Every check of one rank's groups against its replica (all raise naming the ranks)."""
    rep = sorted(replica)

    def fail(what: str) -> None:
        raise GroupMismatch(f"rank {v.rank}: {what} (replica derived from megatron-core: {rep})")

    if len(v.tp_cp) != len(v.tp) * len(v.cp) or not set(v.tp) | set(v.cp) <= set(v.tp_cp):
        fail(f"TP×CP group {list(v.tp_cp)} is not TP {list(v.tp)} × CP {list(v.cp)}")
    if len(replica) != len(v.tp_cp) * len(v.pp):
        fail(
            f"the replica holds {len(replica)} ranks, not tp·cp ({len(v.tp_cp)}) × pp "
            f"({len(v.pp)}): megatron-core's TP×CP and PP groups are not orthogonal"
        )
    stage = v.pp.index(v.rank)
    same_stage = {q for q in replica if views[q].pp.index(q) == stage}
    if same_stage != set(v.tp_cp):
        fail(f"stage {stage} of the replica is {sorted(same_stage)}, not TP×CP {list(v.tp_cp)}")
    if set(replica) & set(v.dp) != {v.rank}:
        fail(f"DP group {list(v.dp)} meets the replica in {sorted(set(replica) & set(v.dp))}")
    if set(replica) & set(v.dp_cp) != set(v.cp):
        fail(
            f"DP×CP group {list(v.dp_cp)} meets the replica in "
            f"{sorted(set(replica) & set(v.dp_cp))}, not in the CP group {list(v.cp)}"
        )
    if not set(v.mp) <= replica:
        fail(f"model-parallel group {list(v.mp)} leaves the replica")
    if len(replica) * len(v.dp) != len(views):
        fail(f"replica ({len(replica)} ranks) × DP ({len(v.dp)}) != world ({len(views)})")


def replica_order(replica: frozenset[int], views: dict[int, MegatronView]) -> tuple[int, ...]:
    """The replica's ranks in group-rank order (ascending, as ``torch.distributed`` orders a
    group), after checking that the first is the leader (pipeline stage 0, TP×CP index 0)."""
    ranks = tuple(sorted(replica))
    leader = min(replica, key=lambda q: (views[q].pp.index(q), views[q].tp_cp.index(q)))
    if ranks[0] != leader:
        raise GroupMismatch(
            f"rank {ranks[0]}: the replica {list(ranks)} would be led by rank {ranks[0]}, but its "
            f"stage-0, TP×CP-index-0 rank is {leader}"
        )
    return ranks


def derive_replicas(views: list[MegatronView]) -> dict[int, tuple[int, ...]]:
    """Each rank's replica (ascending, leader first) from every rank's megatron-core groups, after
    checking that TP×CP, PP, DP, DP×CP and the model-parallel group agree with it. The same
    views on every rank give the same answer or the same GroupMismatch on every rank."""
    by_rank = {v.rank: v for v in views}
    if sorted(by_rank) != list(range(len(views))):
        raise GroupMismatch(f"views cover ranks {sorted(by_rank)}, expected 0..{len(views) - 1}")
    for v in views:
        for name in ("tp", "cp", "tp_cp", "pp", "dp", "dp_cp", "mp"):
            if v.rank not in getattr(v, name):
                raise GroupMismatch(
                    f"rank {v.rank}: megatron-core's {name} group {list(getattr(v, name))} "
                    "does not contain the rank itself"
                )
    components = _components(by_rank)
    out = {}
    for v in views:
        _check_rank(v, by_rank, components[v.rank])
        out[v.rank] = replica_order(components[v.rank], by_rank)
    return out


def check_order(
    order_groups: dict[str, list[list[int]]], views: list[MegatronView], replicas, order: str
) -> None:
    """Compare the groups an order string gives (``Layout.groups``: keys ``tp-cp``, ``pp``,
    ``dp``, ``tp-cp-pp``) with megatron-core's and the derived replicas; raise on the first
    rank that differs, naming both groupings."""
    for v in views:
        mine = {
            "tp-cp": v.tp_cp,
            "pp": v.pp,
            "dp": v.dp,
            "tp-cp-pp": replicas[v.rank],
        }
        for axes, groups in order_groups.items():
            expected = next((sorted(g) for g in groups if v.rank in g), None)
            if expected != sorted(mine[axes]):
                raise GroupMismatch(
                    f"rank {v.rank}: order {order!r} gives the {axes} group {expected}, but "
                    f"megatron-core's groups give {sorted(mine[axes])}; omit order= (the groups "
                    "are derived from megatron-core's own) or pass the order given to "
                    "initialize_model_parallel"
                )
