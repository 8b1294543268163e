"""Every strategy priced on one layout and cluster, and what the ranking says: the pure part of
``bcastbench predict`` (``harness.commands.predict``), shared with extrapolate and the Ray model.

Each strategy's ``plan(layout, spec)`` is priced by ``strategies.core.pricing.price``; nothing
here builds a batch, reads a config or writes a file.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

import strategies
from strategies.auto import CANDIDATES, pick
from strategies.core.costs import Prediction
from strategies.core.formulas import tree_rounds
from strategies.core.option_types import from_text
from strategies.core.plan import plan_of
from strategies.core.pricing import price

PARTS = (
    "local work",
    "store put/get",
    "intra-node α",
    "intra-node β",
    "inter-node α",
    "inter-node β",
)


# --------------------------------------------------------------------------------------------
# Pricing every strategy
# --------------------------------------------------------------------------------------------
def breakdown_s(pred: Prediction) -> dict[str, float]:
    """Seconds per part, the same split ``Prediction.dominant`` names (local, link × α/β)."""
    parts = dict.fromkeys(PARTS, 0.0)
    parts["store put/get"] = sum(w.store_s for w in pred.local)
    parts["local work"] = pred.local_s - parts["store put/get"]
    for s in pred.steps:
        c = s.critical
        if c.link in ("intra", "inter"):
            parts[f"{c.link}-node α"] += c.alpha_s
            parts[f"{c.link}-node β"] += c.beta_s
    return parts


def replicas_independent(layout, gpus_per_node: int) -> bool:
    """True when pricing one DP replica prices them all exactly: no node holds ranks of two
    replicas (so no NIC is shared between replicas) and every replica has the same shape
    relative to its nodes (same node offsets, same slots, in group order)."""
    if layout.dp == 1:
        return False  # nothing to save
    ranks = np.asarray(layout.replica_groups())
    nodes = ranks // gpus_per_node
    per_replica = sum(len(np.unique(row)) for row in nodes)
    if per_replica != len(np.unique(nodes)):
        return False
    shape = np.concatenate([nodes - nodes.min(axis=1, keepdims=True), ranks % gpus_per_node], 1)
    return bool((shape == shape[0]).all())


def _one_replica_plan(cls, layout, spec, device: str = "cpu", **options):
    """The plan of replica 0 of ``layout``, built on a 2-replica copy of the layout (so a
    strategy that refuses DP > 1 still refuses) and moved onto replica 0's global ranks."""
    small = replace(layout, dp=2)
    plan = plan_of(cls, small, spec, device, **options)
    move = dict(zip(small.replica_groups()[0], layout.replica_groups()[0]))
    comms = [
        replace(
            c,
            ranks=tuple(move[r] for r in c.ranks),
            root=None if c.root is None else move[c.root],
        )
        for c in plan.comms
        if c.ranks[0] in move
    ]
    shared = [
        replace(h, ranks=tuple(move[r] for r in h.ranks)) for h in plan.shared if h.root in move
    ]
    stores = [
        replace(f, ranks=tuple(move[r] for r in f.ranks)) for f in plan.stores if f.writer in move
    ]
    return replace(plan, comms=comms, shared=shared, stores=stores)


def price_strategy(name: str, layout, spec, cluster, **options) -> Prediction:
    """``price(plan(layout, spec))``; for a big DP whose replicas are independent
    (``replicas_independent``) one replica is planned and priced and the group counts scaled,
    which is exact and ~dp× faster (a 16k-rank layout of per-tensor broadcasts has 28k comms).
    Raises ``strategies.Unsupported`` when the strategy refuses the layout. The batch is where
    the cluster's ranks hold it (``ClusterConf.device``: shm stages a device batch)."""
    cls = strategies.get_class(name)
    device = cluster.device
    if not replicas_independent(layout, cluster.gpus_per_node):
        # check=False: the test-suite checks plans against real runs; the O(ranks) check
        # would double the time of a 16k-rank layout.
        return price(plan_of(cls, layout, spec, device, **options), cluster, layout, check=False)
    try:
        one = _one_replica_plan(cls, layout, spec, device, **options)
    except strategies.Unsupported:
        # Refuse with the real layout in the message (refusals are raised before any planning,
        # so this is cheap); a strategy that refuses only the 2-replica copy is planned in full.
        plan = plan_of(cls, layout, spec, device, **options)
        return price(plan, cluster, layout, check=False)
    pred = price(one, cluster, layout, check=False)
    steps = tuple(
        replace(s, n_comms=s.n_comms * layout.dp, n_inter=s.n_inter * layout.dp) for s in pred.steps
    )
    return replace(pred, steps=steps)


def predict_all(layout, spec, cluster, names: list[str] | None = None) -> dict[str, Any]:
    """``{strategy: Prediction | str}`` (a string says why a strategy cannot serve the layout),
    plus the floor under ``"floor"``. A name may carry options, priced under that label
    (``pickled[serialization=dataclass]``: ``option_label``)."""
    out: dict[str, Any] = {}
    # auto is priced as what it picks (``auto_pick``), not as a plan of its own.
    for label in [*(n for n in names or strategies.names() if n != "auto"), "floor"]:
        name, options = parse_label(label)
        if not strategies.has_plan(name):
            # plan() is optional (a user's strategy may state none): measured, not predicted.
            out[label] = "n/a: no plan() (it can be measured with bcastbench run, not predicted)"
            continue
        try:
            out[label] = price_strategy(name, layout, spec, cluster, **options)
        except strategies.Unsupported as exc:
            out[label] = f"n/a: {exc}"
    return out


def option_label(name: str, options: dict) -> str:
    """``name`` with its options, as predict prints it: ``pickled[serialization=dataclass]``."""
    if not options:
        return name
    return f"{name}[{','.join(f'{k}={v}' for k, v in sorted(options.items()))}]"


def parse_label(label: str) -> tuple[str, dict[str, Any]]:
    """``option_label``'s inverse: each value read as its option's annotation reads it
    (``option_types.from_text``: ``stage=false`` is False, not the truthy text; a field list
    stays text, as a plan takes it); a label whose brackets hold no ``key=value`` pair raises
    ValueError naming it."""
    name, sep, rest = label.partition("[")
    if not sep:
        return label, {}
    pairs = [p.partition("=") for p in rest.removesuffix("]").split(",")]
    if not rest.endswith("]") or any(not k or not eq for k, eq, _ in pairs):
        raise ValueError(
            f"strategies: {label!r} is not name[key=value,...] (e.g. pickled[serialization=dataclass])"
        )
    options = {k: v for k, _, v in pairs}
    try:
        cls = strategies.get_class(name)
    except KeyError:  # unknown: the caller names it
        return name, options
    return name, from_text(cls.Options, options)


def auto_pick(preds: dict[str, Any]) -> str | None:
    """What ``auto`` would pick from these predictions (``strategies.auto.pick``: the model's
    fastest candidate, ties within ``TIE`` broken by its order), or None if none serves."""
    priced = {
        n: p.total_s for n, p in preds.items() if n in CANDIDATES and isinstance(p, Prediction)
    }
    return pick(priced) if priced else None


def explain(preds: dict[str, Any]) -> tuple[str | None, str]:
    """The winner and one sentence on why (its dominant term; what the runner-up loses on)."""
    ranked = sorted(
        ((n, p) for n, p in preds.items() if n != "floor" and isinstance(p, Prediction)),
        key=lambda kv: kv[1].total_s,
    )
    if not ranked:
        return None, "no strategy supports this layout"
    name, best = ranked[0]
    why = f"{name} is predicted fastest at {best.total_s * 1e3:.4g} ms, dominated by " + (
        best.dominant()
    )
    if len(ranked) > 1:
        second, other = ranked[1]
        a, b = breakdown_s(best), breakdown_s(other)
        part = max(PARTS, key=lambda k: b[k] - a[k])
        why += (
            f"; runner-up {second} takes {other.total_s / best.total_s:.2f}× as long "
            f"({other.total_s * 1e3:.4g} ms), losing most on {part} "
            f"(+{(b[part] - a[part]) * 1e3:.3g} ms)"
        )
    floor = preds.get("floor")
    if isinstance(floor, Prediction) and floor.total_s > 0:
        why += f"; {best.total_s / floor.total_s:.2f}× the floor ({floor.total_s * 1e3:.4g} ms)"
    return name, why


def report(preds: dict[str, Any], header: str) -> str:
    w = max([24, *map(len, preds)])  # a label with options is longer than any name
    lines = [header, f"{'strategy':{w}} {'predicted_ms':>13} {'vs_best':>8}  dominant term"]
    best = min((p.total_s for n, p in preds.items() if n != "floor" and isinstance(p, Prediction)),
               default=None)  # fmt: skip
    order = sorted(
        preds.items(),
        key=lambda kv: kv[1].total_s if isinstance(kv[1], Prediction) else float("inf"),
    )
    for n, p in order:
        if isinstance(p, Prediction):
            ratio = f"{p.total_s / best:8.2f}" if best else f"{'':8}"
            est = "" if p.exact else " (estimated sizes)"
            lines.append(f"{n:{w}} {p.total_s * 1e3:13.4g} {ratio}  {p.dominant()}{est}")
        else:
            lines.append(f"{n:{w}} {'n/a':>13} {'':8}  {p.removeprefix('n/a: ')[:90]}")
    return "\n".join(lines)


def to_json(preds: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for n, p in preds.items():
        if isinstance(p, Prediction):
            out[n] = dict(
                supported=True,
                total_s=p.total_s,
                comm_s=p.comm_s,
                local_s=p.local_s,
                alpha_s=p.alpha_s,
                beta_s=p.beta_s,
                inter_s=p.inter_s,
                steps=len(p.steps),
                exact=p.exact,
                dominant=p.dominant(),
                breakdown_s=breakdown_s(p),
            )
        else:
            out[n] = dict(supported=False, why=p)
    return out


def predicted_cross_bytes(plan, ranks_per_node: int) -> int:
    """Payload bytes one call of ``plan`` sends between nodes, as gloo moves them: a broadcast
    along its binomial tree's edges, a scatter straight from the root, an all-gather around a
    ring in group order; a shared-memory hand-off once to each other node of its replica; a
    store fetch as ``store_pricing.crossing_s`` counts it."""

    def node(r: int) -> int:
        return r // ranks_per_node

    total = 0
    for c in plan.comms:
        if c.kind == "broadcast":
            edges = [e for rnd in tree_rounds(c.ranks, c.root) for e in rnd]
            total += c.nbytes * sum(node(a) != node(b) for a, b in edges)
        elif c.kind == "scatter":
            total += c.nbytes * sum(node(r) != node(c.root) for r in c.ranks)
        elif c.kind == "all_gather":
            p = len(c.ranks)
            ring = zip(c.ranks, c.ranks[1:] + c.ranks[:1])
            total += c.nbytes * (p - 1) // p * sum(node(a) != node(b) for a, b in ring)
    for h in plan.shared:
        total += h.nbytes * (len({node(r) for r in h.ranks}) - 1)
    for f in plan.stores:
        if f.crosses:  # a node store's copy per other node, a replica store's per remote reader
            remote = [r for r in f.ranks if node(r) != node(f.writer)]
            total += f.nbytes * (
                len({node(r) for r in remote}) if f.scope == "node" else len(remote)
            )
    return total
