"""Which ranks a Ray dispatch mode hands each replica's chunk to through Ray, which must hold
it when the call ends, and the plan of the hops ``edge_stages`` and ``chain`` run after Ray: pure
rank maths on a ``Layout``, shared by the job that runs the modes (``harness.job.dispatch``,
``harness.job.dispatch_hops``) and the model that prices them (``harness.model.dispatch_prices``).

- ``leader`` and ``chain``: the replica leader alone (pipeline stage 0, tp = cp = 0) gets it
  through Ray; every rank of the replica holds it at the end.
- ``all_ranks``: every rank gets it through Ray and holds it.
- ``rdt``: the replica leader gets it through Ray, then lends it to every other rank of its
  replica over Ray Direct Transport (the tensors out of band, gloo point to point); every rank
  holds it.
- ``cgraph``: a Ray Compiled Graph carries it, the driver's input channel to the replica leader,
  the leader's output channel to every rank of its replica (shared memory on one node); every
  rank holds it.
- ``edge_stages``: TP×CP rank 0 (tp = cp = 0) of the first and of the last pipeline stage get it
  through Ray; the ranks of those two stages hold it at the end, the middle stages nothing
  (in training they receive activations, not the batch). With pp = 1 the first stage is the
  last: one rank per replica gets it, as in ``leader``.
"""

from __future__ import annotations

from strategies.core.layout import Layout
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan

LEADER, ALL_RANKS, EDGE_STAGES, CHAIN = "leader", "all_ranks", "edge_stages", "chain"
RDT, CGRAPH = "rdt", "cgraph"
HOPS = (EDGE_STAGES, CHAIN)
"""The families whose in-group hops the dispatch itself runs (``harness.job.dispatch_hops``),
no broadcast strategy."""
KINDS = (LEADER, ALL_RANKS, RDT, CGRAPH, *HOPS)
"""Every dispatch mode's family (``harness.job.dispatch_modes.DispatchMode.kind``)."""


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"dispatch mode family {kind!r}: expected one of {list(KINDS)}")


def edge_stage(layout: Layout, rank: int) -> bool:
    """True for a rank of the first or the last pipeline stage."""
    return layout.coords(rank)["pp"] in (0, layout.pp - 1)


def ray_ranks(kind: str, layout: Layout) -> list[list[int]]:
    """Per replica (in ``layout.replica_groups()`` order), the ranks the driver hands the
    chunk's ObjectRef to, ascending."""
    _check(kind)
    replicas = layout.replica_groups()
    if kind == ALL_RANKS:
        return [sorted(replica) for replica in replicas]
    if kind != EDGE_STAGES:
        return [[replica[0]] for replica in replicas]
    # TP×CP rank 0 of a stage is its group's first rank (tp = cp = 0).
    sources = {g[0] for g in layout.groups("tp-cp") if edge_stage(layout, g[0])}
    return [sorted(sources.intersection(replica)) for replica in replicas]


def holding_ranks(kind: str, layout: Layout) -> list[int]:
    """Every rank that must hold its replica's chunk when a call of ``kind`` ends, ascending:
    every rank, but for ``edge_stages`` the ranks of the first and last pipeline stages only."""
    _check(kind)
    ranks = range(layout.world_size)
    if kind == EDGE_STAGES:
        return [r for r in ranks if edge_stage(layout, r)]
    return list(ranks)


def _hop_groups(kind: str, layout: Layout) -> list[list[list[int]]]:
    """The hops after Ray, in order, each as the groups that run it at once (every replica's):
    ``edge_stages`` the TP×CP groups of the first and last stages together; ``chain`` stage 0's
    TP×CP groups, then one hop per pair of neighbouring stages (each rank of stage k to its
    counterpart on stage k + 1, a group of two)."""
    if kind == EDGE_STAGES:
        groups = [g for g in layout.groups("tp-cp") if edge_stage(layout, g[0])]
        return [groups] if layout.tp_cp > 1 else []
    hops = [layout.stage0_tp_cp_groups()] if layout.tp_cp > 1 else []
    pipes = layout.groups("pp")
    hops += [[[p[k], p[k + 1]] for p in pipes] for k in range(layout.pp - 1)]
    return hops


def hop_plan(kind: str, layout: Layout, spec: PayloadSpec, raw: bool) -> Plan:
    """The comms and host work of ``kind``'s hops (``edge_stages``, ``chain``) for every
    replica, as ``harness.job.dispatch_hops`` runs them: a point-to-point send is priced as a
    broadcast on its group of two. Pickled: each hop sends the pickle's size, then the whole
    chunk pickled (``broadcast_object_list``, ``send_object_list``); its source pickles, its
    receivers unpickle, and a ``chain`` rank that passes the object on does both. The floor
    sends the flat bytes alone, with no host work."""
    if kind not in HOPS:
        raise ValueError(f"hop plan: {kind!r} is not one of ['edge_stages', 'chain']")
    name = f"{kind}:raw" if raw else kind
    hops = _hop_groups(kind, layout)
    if raw:
        nbytes = spec.tensor_bytes + spec.non_tensor_bytes
        comms = [Comm("broadcast", tuple(g), g[0], nbytes, step) for step, gs in enumerate(hops)
                 for g in gs]  # fmt: skip
        return Plan(name, comms, leader=LocalWork(), receiver=LocalWork())
    nbytes = spec.pickle_bytes + spec.non_tensor_bytes
    comms = []
    for step, groups in enumerate(hops):
        for what, size in (("sizes", 8), ("pickle", nbytes)):
            comms += [Comm("broadcast", tuple(g), g[0], size, 2 * step + (what == "pickle"), what,
                           what == "sizes" or spec.pickle_exact) for g in groups]  # fmt: skip
    # The ranks on the critical path that receive and send on: chain's middle stages, and the
    # first stage's TP×CP receivers where that hop runs (the plan charges its forwarder once,
    # so its bytes count each of them).
    forwarders = max(0, len(hops) - 1)
    return Plan(
        name,
        comms,
        leader=LocalWork(pickled_bytes=nbytes if hops else 0),
        receiver=LocalWork(pickled_bytes=nbytes if hops else 0),
        forwarder=LocalWork(pickled_bytes=2 * nbytes * forwarders),
    )


def rdt_plan(layout: Layout, spec: PayloadSpec, raw: bool) -> Plan:
    """The comms of ``rdt``'s lending after Ray (``raw``: its floor), as Ray Direct Transport
    runs them over gloo: each replica's leader sends every tensor (the floor: its one flat
    array) to each other rank of its replica point to point, one receiver after another, a
    send priced as a broadcast on its group of two (as ``hop_plan``'s); every replica at
    once. The non-tensor data and meta_info travel in the object itself, through Ray's object
    store (the get prices them)."""
    if raw:
        sizes, exact = [spec.tensor_bytes + spec.non_tensor_bytes], True
    else:
        sizes, exact = spec.leaf_nbytes()
    comms, step = [], 0
    for k in range(layout.replica_size - 1):
        for size in sizes:
            comms += [
                Comm("broadcast", (rep[0], rep[k + 1]), rep[0], size, step, "leaf", exact)
                for rep in layout.replica_groups()
            ]
            step += 1
    return Plan(f"{RDT}:raw" if raw else RDT, comms, leader=LocalWork(), receiver=LocalWork())
