"""``auto``: per call, the built-in strategy the calibrated cost model prices fastest.

The recommendation table as code: for the layout, the payload's bytes and leaves and a cluster
preset (``cluster``, default ``local``: the preset calibrated on the machine the harness runs
on), every candidate's ``plan`` is priced by ``strategies.core.pricing.price`` and the cheapest
serves the call (``choose``). ``choice`` holds the strategy that serves the next call.

The pricing and the presets it reads sit in ``strategies.core`` (``pricing``, ``cluster``,
``formulas``) rather than in the harness: they are pure arithmetic over plans and layouts, and
with them below this module ``strategies.get("auto", groups)`` works for a user who imports
only the strategies (the harness's cost model prices the same plans with the same function).

Who decides, without an extra collective: every rank decides the same way from the same
bytes. At the end of each call every rank of the replica holds the header the leader sent
(keys, dtypes, shapes, the non-tensor blob's size: ``spec_of_header``), so each prices the same
``PayloadSpec`` and picks the same strategy for the next call; pricing is pure arithmetic, so
no rank can disagree. The first call, with no header yet, uses ``first`` (``flat``).

Which shape to price: the one the *next* call will move, predicted from the calls so far
(``NextShape``: the shape that followed this call's shape the last time it was seen, else this
shape again). Every rank of the replica saw the same headers, so every rank predicts the same.
A stream of same-shaped batches is served by its own choice from its second call on, and so is
a workload that repeats a pattern (a large rollout batch then a small one, micro-batches of
a fixed sequence of shapes) from the second call of its second period on: each call is served by the choice for
its own shape, not the previous call's. A shape that breaks the pattern is served once by the
prediction's choice (correct either way: every candidate ships any batch). A shape is its
leaves' layout (keys, dtypes, shapes), not the non-tensor blob's size, which changes with the
data (``shape_key``); it is priced from the first call that moved it. Pricing a new shape runs
inside the call, so its cost is in the time; a shape seen before is a dict lookup. The
header-based candidates share one ``Wire``, so switching between them keeps the size every rank
agreed to expect (no extra broadcast).

Options: see ``Auto.Options``. ``plan(layout, spec)`` is the chosen strategy's.
"""

from __future__ import annotations

import inspect
import itertools
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from typing import Literal, get_args

import strategies
from strategies.core.cluster import load_cluster
from strategies.core.contract import DataProto, Unsupported, failure_in
from strategies.core.footprint import Footprint
from strategies.core.header_format import align
from strategies.core.layout import Layout
from strategies.core.packed import PackedStrategy
from strategies.core.plan import PayloadSpec, Plan, bytes_per_dtype, plan_of
from strategies.core.pricing import price
from strategies.core.recent import NextShape, remember
from strategies.core.strategy_base import Strategy

Candidate = Literal["flat", "direct", "header", "pp_first", "scatter_allgather", "shm"]
"""A built-in auto may choose (``CANDIDATES``)."""
CANDIDATES: tuple[str, ...] = get_args(Candidate)
"""The built-ins auto chooses among, in order of preference when the model cannot tell them
apart: the least work per call first (``direct`` without a leaf over its threshold is
``flat`` plus a per-leaf check on every rank; where it skips the pack copy of large leaves the
model prices it cheaper and it wins outright), then fewest collectives. ``shm`` comes last: it
holds shared segments and a socket per node-local rank, so it serves only where the model
prices it cheaper (ranks that share a node: no collective, a signal per rank; on a device it
is priced with its staging copies, ``choose``'s ``device``)."""
TIE = 0.01
"""Candidates priced within this fraction of the cheapest count as a tie; the first of them in
``CANDIDATES`` order wins. Small: the model's absolute error is larger, but between plans that
share a wire and differ in a few collectives its ranking is what it gets right (a wider tie
band handed to direct sizes where the model itself priced it above flat)."""


class Auto(Strategy):
    name = "auto"
    footprint = Footprint(leader=1, receiver=1, leader_kept=1)
    """The peak is the first call's, which ``first`` (``flat``) serves before any header: the
    leader's pack buffer and every receiver's bytes. Between calls it keeps one copy, whichever
    candidate then serves: shm's segment or a header family's pack buffer, counted as the
    leader's; a candidate it leaves drops its buffer (``set_aside``)."""
    claims = "the chosen strategy's collectives (priced per batch shape by the cost model)"

    @dataclass(frozen=True, kw_only=True)
    class Options(Strategy.Options):
        cluster: str = "local"
        """The cluster preset the candidates are priced on: a name under conf/cluster/ or a
        YAML path (``local``: the preset calibrated on the machine the harness runs on)."""
        first: Candidate = "flat"
        """The candidate that serves the first call, before any header has been seen."""
        candidates: tuple[Candidate, ...] | list[Candidate] = CANDIDATES
        """The built-ins priced per call (default: all of ``CANDIDATES``); one that refuses
        the layout is left out, and none left is refused."""

        def __post_init__(self) -> None:
            super().__post_init__()
            unknown = sorted((set(self.candidates) | {self.first}) - set(CANDIDATES))
            if unknown:
                raise ValueError(f"auto: unknown candidates {unknown}; valid: {list(CANDIDATES)}")

    def __init__(self, groups, **options) -> None:
        super().__init__(groups, **options)
        candidates, first = self.options.candidates, self.options.first
        self.layout = layout_of_groups(groups)
        self.device = groups.device.type
        self.built: dict[str, Strategy] = {}
        for name in candidates:
            try:
                self.built[name] = strategies.get(name, groups)
            except Unsupported:  # raised on every rank alike: the rest still choose
                continue
        if not self.built:
            raise Unsupported(f"auto: no candidate among {list(candidates)} serves this layout")
        wires = [s.wire for s in self.built.values() if isinstance(s, PackedStrategy)]
        for s in self.built.values():
            if isinstance(s, PackedStrategy):
                s.wire = wires[0]  # one agreed next size, whichever of them serves
        self.choice = first if first in self.built else next(iter(self.built))
        """The candidate that serves the next call."""
        self.served: str | None = None
        """The candidate that served the last call."""
        self._next = NextShape()
        self._choice_of: OrderedDict[Hashable, str] = OrderedDict()  # shape -> its choice

    def leader_view(self, batch: DataProto) -> DataProto:
        """The serving candidate's checks (a failure batch then goes out through it)."""
        return self.built[self.choice].leader_view(batch)

    def transfer(self, batch: DataProto) -> DataProto:
        self.served = self.choice
        serving = self.built[self.choice]
        out = serving.transfer(batch)
        header = getattr(serving, "last_header", None)
        if header is not None and failure_in(out) is None:  # a failure batch is not priced
            key = shape_key(header)
            choice = self._choice_of.get(key)
            if choice is None:  # a new shape: price it (a seen one is a lookup)
                spec = spec_of_header(header)
                choice = choose(
                    self.layout, spec, self.options.cluster, tuple(self.built), self.device
                )
            remember(self._choice_of, key, choice, NextShape.KEEP)
            predicted = self._next.observe(key)
            self.choice = self._choice_of.get(predicted, self._choice_of[key])
            if self.choice != self.served:  # every rank switches alike: each drops its own
                self.built[self.served].set_aside()
        return out

    @classmethod
    def plan(
        cls, layout, spec: PayloadSpec, expect: int | None = None, cluster: str = "local"
    ) -> Plan:
        """The plan of the strategy ``choose`` picks (steady state; ``expect`` is passed to a
        header-based choice), for a batch where the cluster's ranks hold it
        (``ClusterConf.device``)."""
        device = (_cluster(cluster) if isinstance(cluster, str) else cluster).device
        chosen = strategies.get_class(choose(layout, spec, cluster, device=device))
        kwargs = {"expect": expect} if "expect" in inspect.signature(chosen.plan).parameters else {}
        return plan_of(chosen, layout, spec, device, **kwargs)


def shape_key(header) -> tuple:
    """A batch's shape class, from its header: every leaf's key, dtype, shape and kind, and
    whether non-tensor data came. Not the offsets (they depend on which candidate packed it:
    ``direct`` takes large leaves out of the message), nor the non-tensor blob's size (its
    strings' lengths change with the data, call by call, in batches of one shape)."""
    leaves = tuple((e.key, e.dtype, e.shape, e.kind, e.aux) for e in header.entries)
    return (leaves, header.non_tensor is not None)


def choose(
    layout,
    spec: PayloadSpec,
    cluster="local",
    candidates: tuple[str, ...] = CANDIDATES,
    device: str = "cpu",
) -> str:
    """The candidate whose plan the cost model prices fastest on ``cluster`` (a preset name,
    a YAML path or a ``ClusterConf``; ties: the first in ``CANDIDATES`` among those within
    ``TIE`` of the cheapest). Only what every rank knows exactly is priced: the pickle size of
    the tensors (which no candidate sends) is left out. ``device``: where the batch lives; a
    plan that stages through host memory off the CPU (``shm``'s ``stage``) is priced so."""
    spec = replace(spec, pickle_bytes=spec.tensor_bytes, pickle_exact=False)
    return _choose(layout, spec, cluster, tuple(candidates), device)


@lru_cache(maxsize=NextShape.KEEP)  # a run of ever-new shapes keeps memory bounded
def _choose(layout, spec: PayloadSpec, cluster, candidates: tuple[str, ...], device: str) -> str:
    conf = _cluster(cluster) if isinstance(cluster, str) else cluster
    priced: dict[str, float] = {}
    for name in candidates:
        try:
            plan = plan_of(strategies.get_class(name), layout, spec, device)
        except Unsupported:
            continue
        priced[name] = price(plan, conf, layout, check=False).total_s
    if not priced:
        raise Unsupported(f"auto: no candidate among {list(candidates)} serves {layout.describe()}")
    return pick(priced)


def pick(priced: dict[str, float]) -> str:
    """The choice among priced candidates (name -> seconds): the first in ``CANDIDATES``
    order among those within ``TIE`` of the cheapest."""
    cheapest = min(priced.values())
    return next(n for n in CANDIDATES if n in priced and priced[n] <= cheapest * (1 + TIE))


@cache
def _cluster(name: str):
    return load_cluster(name)


def spec_of_header(header) -> PayloadSpec:
    """The ``PayloadSpec`` a decoded header describes (what ``plan.spec_of`` says of the
    leader's batch, but from bytes every rank of the replica received alike; of the non-tensor
    blob the header keeps its room, ``parts.blob_room``, not its length)."""
    sizes = [e.nbytes for e in header.entries]
    nt = header.non_tensor[1] if header.non_tensor is not None else 0
    padded = sum(align(n) for n in sizes)
    return PayloadSpec(
        tensor_bytes=sum(sizes),
        n_tensors=len(sizes),
        header_bytes=header.header_len + padded - sum(sizes),
        pickle_bytes=sum(sizes),
        non_tensor_bytes=nt,
        broadcast_non_tensor=header.non_tensor is not None,
        dtype_bytes=bytes_per_dtype([e.dtype for e in header.entries], sizes),
        leaf_bytes=tuple(sizes),
        leaf_names=tuple(".".join(e.key) for e in header.entries),
    )


def layout_of_groups(groups) -> Layout:
    """A ``Layout`` whose groups are these: TP×CP folded into one axis (every plan groups them
    together), and the first order of TP×CP, DP and PP that reproduces this rank's TP×CP, PP
    and replica groups (rank maths is regular, so the same order fits every rank)."""
    sizes = dict(dp=groups.replicas, pp=len(groups.pp_ranks), tp=len(groups.tp_cp_ranks))
    for perm in itertools.permutations(("tp-cp-ep", "dp", "pp")):
        layout = Layout(cp=1, order="-".join(perm), **sizes)
        rank = groups.rank
        if (
            tuple(layout.group_of("tp-cp", rank)) == tuple(groups.tp_cp_ranks)
            and tuple(layout.group_of("pp", rank)) == tuple(groups.pp_ranks)
            and set(layout.group_of("tp-cp-pp", rank)) == set(groups.replica_ranks)
        ):
            return layout
    return Layout(cp=1, **sizes)


STRATEGY = Auto
