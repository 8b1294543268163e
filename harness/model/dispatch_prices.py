"""The cost model's price of Ray dispatch: from "the driver holds the global batch" to "every
rank holds its chunk", for ``all_ranks`` (one object per replica, every rank gets it),
``leader`` (the object to each replica's leader, then a broadcast strategy), ``edge_stages`` and
``chain`` (the object to a few ranks, then the mode's own hops), without running.
``bcastbench ray-model`` (``harness.commands.ray_model``) asks it the 16,384-GPU question and
sets it beside measured records (``harness.report.dispatch_model``).

One call is priced as the sum of its phases, as ``harness.job.dispatch`` runs them:

- **put**: the driver chunks and ``ray.put``\\s each of the dp chunks: dp·(α_put + n·β_put).
- **call**: one task per actor, submitted by the driver: α_call + W·β_call.
- **transfer**: an object crosses to each other node that needs it once, however many actors
  there read it; every pull is served by the driver's node (the owner), over one link:
  α_transfer + (bytes leaving the driver's node)·β_link.
- **get**: each rank that receives the object deserializes it (same-node actors share the
  object store, no copy of the bytes, but a DataProto is unpickled per actor): α_get + n·β_get,
  slowed by max(1, getters/cores) where ranks share a host's cores; on a GPU cluster each
  receiving rank then copies n bytes host→device.
- **broadcast** (``leader``): the strategy's own price (``harness.model.prices``); for ``rdt``
  the lend as calibrated (α_lend + (k − 1)·(α_rank + n·β_lend) to a replica of k ranks: Ray
  Direct Transport sends to each in turn), or, on a preset without a lend fit, a second round
  of tasks and the point-to-point sends of its plan on the cluster's links
  (``harness.model.dispatch_ranks.rdt_plan``); for ``edge_stages`` and ``chain`` the price of
  their hops' plan
  (``harness.model.dispatch_ranks.hop_plan``), by the same pricing, with the put, transfer and
  get of the ranks Ray hands the object to (two per replica for ``edge_stages`` when pp > 1).
- ``cgraph`` (a Compiled Graph, one node) submits no task and uses no object store: its
  channels as calibrated (α_channel + (every replica's bytes)·β_write + n·β_read·max(1,
  W/cores): the driver writes the input, every rank reads its chunk on the host's cores), or,
  on a preset without a channel fit, as puts and gets of the bytes they carry.

The Ray terms (put, get, call, lend, channel) are fitted on a local Ray world by ``bcastbench
calibrate target=ray`` into ``conf/ray/local.yaml`` (``RayCostConf``); links, host cores and
device copies come from the cluster preset (``strategies.core.cluster.ClusterConf``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields, replace
from pathlib import Path

import strategies
from harness import paths
from harness.model.dispatch_ranks import CGRAPH, HOPS, RDT, hop_plan, ray_ranks, rdt_plan
from harness.model.prices import predicted_cross_bytes, price_strategy
from strategies.core.cluster import GB, US, ClusterConf, ClusterError, check_number
from strategies.core.pricing import price

CONF_DIR = paths.CONF_DIR / "ray"
LEADER_STRATEGIES = ("header", "flat", "direct", "pp_first", "pickled", "scatter_allgather")
"""Broadcast strategies the leader path is priced with (the header family and the seed)."""
EXAMPLE_DPS = (1, 2, 4, 8, 16, 32, 64, 128)
"""DP degrees scanned for the 16,384-GPU example (its replica shape kept): 16 → 2,048 nodes."""
TIE = 0.05
"""Relative difference below which the example calls the two modes even (a model's figures
are not finer than that)."""
EXAMPLE_BATCHES = (8, 64, 512, 4096)
"""Rows per replica scanned for the example (seq 4096: ≈ 1.5 MB to ≈ 0.8 GB per chunk)."""


@dataclass
class RayCostConf:
    """Schema of ``conf/ray/*.yaml``: Ray's own costs on the driver and in an actor, α in µs and
    rates in GB/s (1e9 B/s) as in ``ClusterConf``. A rate of 0 means no per-byte cost."""

    name: str = "unnamed"
    """Preset name."""
    put_call_us: float = 0.0
    """Fixed cost of chunking one DataProto chunk and ``ray.put``-ting it, µs."""
    put_gbytes_per_s: float = 0.0
    """Per-byte rate of that chunk + put (a copy and a pickle of the TensorDict), GB/s."""
    put_raw_call_us: float = 0.0
    """Fixed cost of ``ray.put`` of the floor's flat uint8 array, µs."""
    put_raw_gbytes_per_s: float = 0.0
    """Per-byte rate of that put (one copy into the object store), GB/s."""
    get_call_us: float = 0.0
    """Fixed cost of one actor's ``ray.get`` of a DataProto on the object's node, µs."""
    get_gbytes_per_s: float = 0.0
    """Per-byte rate of that get (the unpickle rebuilds every tensor), GB/s."""
    get_raw_call_us: float = 0.0
    """Fixed cost of one actor's ``ray.get`` of a flat array on the object's node, µs."""
    get_raw_gbytes_per_s: float = 0.0
    """Per-byte rate of that get; 0 when the array is read from shared memory without a copy."""
    call_us: float = 0.0
    """Fixed cost of one round of actor tasks (submit, run, answer) on the driver, µs."""
    call_per_actor_us: float = 0.0
    """What each more actor adds to that round, µs."""
    transfer_call_us: float = 0.0
    """Fixed cost of pulling objects to other nodes (object-manager round trips), µs."""
    transfer_gbytes_per_s: float = 0.0
    """Rate of a cross-node object transfer, GB/s; 0 = the cluster's inter-node link."""
    lend_call_us: float = 0.0
    """``rdt``: fixed cost of one lend of a DataProto chunk its leader holds (the lend task,
    the ref, the takers' round of tasks), µs. All lend terms 0: not calibrated (the plan's
    sends on the cluster's links price it)."""
    lend_per_rank_us: float = 0.0
    """What each more rank taking the lend adds (Ray Direct Transport sends in turn), µs."""
    lend_gbytes_per_s: float = 0.0
    """Per-byte rate of the lend to each more rank, GB/s."""
    lend_raw_call_us: float = 0.0
    """The same three of the floor's flat tensor."""
    lend_raw_per_rank_us: float = 0.0
    lend_raw_gbytes_per_s: float = 0.0
    channel_call_us: float = 0.0
    """``cgraph``: fixed cost of one execution of the compiled graph with a DataProto chunk, µs.
    All channel terms 0: not calibrated (priced as puts and gets)."""
    channel_write_gbytes_per_s: float = 0.0
    """Rate of the bytes written into the graph's channels once per execution, GB/s."""
    channel_read_gbytes_per_s: float = 0.0
    """Rate of each rank's read of its chunk, on a core of its own, GB/s."""
    channel_raw_call_us: float = 0.0
    """The same three of the floor's flat array."""
    channel_raw_write_gbytes_per_s: float = 0.0
    channel_raw_read_gbytes_per_s: float = 0.0
    calibrated_ranks: int = 0
    """Actors that ran ``get`` at once during calibration (the fit includes their sharing)."""
    calibrated_cores: int = 0
    """Cores of the calibration host; 0 = not calibrated on a shared host."""

    def __post_init__(self) -> None:
        where = f"ray costs {self.name!r}"
        for f in fields(self):
            if f.name != "name":
                check_number(f"{where}: {f.name}", getattr(self, f.name), allow_zero=True)

    # -- seconds --------------------------------------------------------------------------
    @staticmethod
    def _affine(call_us: float, gbytes_per_s: float, nbytes: float) -> float:
        per_byte = 1.0 / (gbytes_per_s * GB) if gbytes_per_s > 0 else 0.0
        return call_us * US + nbytes * per_byte

    def put_s(self, nbytes: float, raw: bool) -> float:
        if raw:
            return self._affine(self.put_raw_call_us, self.put_raw_gbytes_per_s, nbytes)
        return self._affine(self.put_call_us, self.put_gbytes_per_s, nbytes)

    def get_s(self, nbytes: float, raw: bool) -> float:
        """One get with a core to itself: the fit divided by the calibration's own sharing."""
        if raw:
            fit = self._affine(self.get_raw_call_us, self.get_raw_gbytes_per_s, nbytes)
        else:
            fit = self._affine(self.get_call_us, self.get_gbytes_per_s, nbytes)
        return fit / _sharing(self.calibrated_ranks, self.calibrated_cores)

    def calls_s(self, actors: int) -> float:
        return (self.call_us + actors * self.call_per_actor_us) * US

    def lend_s(self, nbytes: float, takers: int, raw: bool) -> float | None:
        """``rdt``'s lend of ``nbytes`` from a leader to ``takers`` ranks (itself among them);
        None where the preset has no lend fit."""
        if raw:
            call_us, per_rank_us = self.lend_raw_call_us, self.lend_raw_per_rank_us
            rate = self.lend_raw_gbytes_per_s
        else:
            call_us, per_rank_us, rate = (
                self.lend_call_us, self.lend_per_rank_us, self.lend_gbytes_per_s
            )  # fmt: skip
        if not (call_us or per_rank_us or rate):
            return None
        return call_us * US + (takers - 1) * self._affine(per_rank_us, rate, nbytes)

    def channel_s(self, written: float, nbytes: float, sharing: float, raw: bool) -> float | None:
        """``cgraph``'s execution: ``written`` bytes into its channels, each rank's read of
        ``nbytes`` slowed by ``sharing``; None where the preset has no channel fit."""
        if raw:
            call_us, write_rate = self.channel_raw_call_us, self.channel_raw_write_gbytes_per_s
            read_rate = self.channel_raw_read_gbytes_per_s
        else:
            call_us, write_rate = self.channel_call_us, self.channel_write_gbytes_per_s
            read_rate = self.channel_read_gbytes_per_s
        if not (call_us or write_rate or read_rate):
            return None
        return (
            self._affine(call_us, write_rate, written)
            + self._affine(0.0, read_rate, nbytes) * sharing
        )

    def transfer_s(self, nbytes: float, cluster: ClusterConf) -> float:
        if nbytes <= 0:
            return 0.0
        rate = self.transfer_gbytes_per_s or cluster.inter.bandwidth_gbytes_per_s
        return self.transfer_call_us * US + nbytes / (rate * GB)


def _sharing(concurrent: int, cores: int) -> float:
    """How much slower each of ``concurrent`` busy processes runs on ``cores`` cores."""
    return max(1.0, concurrent / cores) if cores > 0 else 1.0


def load_ray_costs(name_or_path: str | Path = "local") -> RayCostConf:
    """A preset by name (``conf/ray/<name>.yaml``) or a YAML path."""
    import yaml

    path = Path(name_or_path)
    path = path if path.suffix in (".yaml", ".yml") else CONF_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
        raise ClusterError(
            f"no Ray cost file {path}; presets: {known} (write one: bcastbench calibrate target=ray)"
        )
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError) as exc:  # unreadable, not text, not YAML
        raise ClusterError(f"{path}: not a readable Ray cost file ({exc})") from None
    if not isinstance(raw, dict):
        raise ClusterError(f"{path}: a Ray cost file is a mapping of keys to numbers, got {raw!r}")
    known = {f.name for f in fields(RayCostConf)}
    if set(raw) - known:
        raise ClusterError(
            f"{path}: unknown keys {sorted(set(raw) - known)}; valid: {sorted(known)}"
        )
    return RayCostConf(**raw)


# -- pricing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DispatchCost:
    """One dispatch call, phase by phase (seconds), and the bytes it sends between nodes."""

    mode: str
    put_s: float
    call_s: float
    transfer_s: float
    get_s: float
    broadcast_s: float = 0.0
    cross_node_bytes: float = 0.0

    @property
    def total_s(self) -> float:
        return self.put_s + self.call_s + self.transfer_s + self.get_s + self.broadcast_s


def replica_nodes(layout, gpus_per_node: int) -> list[set[int]]:
    """The nodes each DP replica's ranks live on (rank r on node r // gpus_per_node)."""
    return [{r // gpus_per_node for r in group} for group in layout.replica_groups()]


def _per_rank_get_s(ray: RayCostConf, cluster: ClusterConf, nbytes: float, raw: bool,
                    getters_per_host: int, host_cores: int | None) -> float:  # fmt: skip
    """One receiving rank's get (and host→device copy on a GPU cluster), slowed by the
    ranks that get at the same time on its host's cores."""
    cores = cluster.cpu_cores if host_cores is None else host_cores
    seconds = ray.get_s(nbytes, raw) * _sharing(getters_per_host, cores)
    if on_gpu(cluster):
        seconds += nbytes / cluster.h2d_bytes_per_s
    return seconds


def on_gpu(cluster: ClusterConf) -> bool:
    """Ranks hold their data on an accelerator (the preset prices on-device copies)."""
    return cluster.cpu_cores == 0 and cluster.device_copy_gbytes_per_s > 0


def price_all_ranks(layout, nbytes: float, cluster: ClusterConf, ray: RayCostConf,
                    raw: bool = False, host_cores: int | None = None) -> DispatchCost:  # fmt: skip
    """``all_ranks``: one put per replica; the driver's node (node 0) serves one copy to every
    other node of each replica; every rank gets it. ``host_cores``: cores all ranks of the
    machine share (an emulated cluster on one host); None takes the cluster's ``cpu_cores``."""
    nodes = replica_nodes(layout, cluster.gpus_per_node)
    far = sum(len(n - {0}) for n in nodes)
    crossed = nbytes * far
    # A node's ranks get at once; a far node's get after its pull, so one node's gets are on
    # the critical path (on one shared host too: the near node's are done by then).
    getters = min(cluster.gpus_per_node, layout.world_size)
    get_s = _per_rank_get_s(ray, cluster, nbytes, raw, getters, host_cores)
    return DispatchCost(
        "all_ranks:raw" if raw else "all_ranks",
        put_s=layout.dp * ray.put_s(nbytes, raw),
        call_s=ray.calls_s(layout.world_size),
        transfer_s=ray.transfer_s(crossed, cluster),
        get_s=get_s,
        cross_node_bytes=crossed,
    )


def _to_receivers(name: str, layout, nbytes: float, cluster: ClusterConf, ray: RayCostConf,
                  receivers: list[list[int]], raw: bool, broadcast_s: float,
                  broadcast_cross_bytes: float, host_cores: int | None) -> DispatchCost:  # fmt: skip
    """A mode that hands each replica's object to ``receivers`` (per replica) through Ray, then
    carries it on (``broadcast_s``): one put per replica, the object pulled once to each other
    node of a replica's receivers (served by the driver's node 0), one get per receiver."""
    crossed = nbytes * sum(
        len({r // cluster.gpus_per_node for r in rep} - {0}) for rep in receivers
    )
    # Receivers on one host get at once; on one shared host (host_cores set) all of them do.
    every = [r for rep in receivers for r in rep]
    nodes_of = Counter(r // cluster.gpus_per_node for r in every)
    per_host = len(every) if host_cores is not None else max(nodes_of.values())
    return DispatchCost(
        name,
        put_s=layout.dp * ray.put_s(nbytes, raw),
        call_s=ray.calls_s(layout.world_size),
        transfer_s=ray.transfer_s(crossed, cluster),
        get_s=_per_rank_get_s(ray, cluster, nbytes, raw, per_host, host_cores),
        broadcast_s=broadcast_s,
        cross_node_bytes=crossed + broadcast_cross_bytes,
    )


def price_leader(layout, nbytes: float, cluster: ClusterConf, ray: RayCostConf,
                 strategy: str, broadcast_s: float, broadcast_cross_bytes: float = 0.0,
                 host_cores: int | None = None) -> DispatchCost:  # fmt: skip
    """``leader:<strategy>``: one put per replica, the object pulled to each leader's node
    (served by the driver's node 0), one get per leader, then the strategy's broadcast
    (``broadcast_s``, priced by the caller on the same cluster)."""
    leaders = [[group[0]] for group in layout.replica_groups()]
    return _to_receivers(f"leader:{strategy}", layout, nbytes, cluster, ray, leaders,
                         strategy == "floor", broadcast_s, broadcast_cross_bytes, host_cores)  # fmt: skip


def price_hops(kind: str, layout, spec, cluster: ClusterConf, ray: RayCostConf,
               raw: bool = False, host_cores: int | None = None) -> DispatchCost:  # fmt: skip
    """``edge_stages`` or ``chain`` (``raw``: its floor): the object through Ray to the ranks
    ``harness.model.dispatch_ranks.ray_ranks`` names (two per replica for edge_stages when
    pp > 1, the leader for chain), then the hops of ``hop_plan``, priced as a strategy's plan
    is (``strategies.core.pricing.price``) on the same cluster."""
    nbytes = spec.tensor_bytes + spec.non_tensor_bytes
    plan = hop_plan(kind, layout, spec, raw)
    hops = price(plan, cluster, layout, check=False)
    cross = 0.0
    if layout.world_size <= 4096:  # the plan walk is O(ranks), as for a leader mode
        cross = float(predicted_cross_bytes(plan, cluster.gpus_per_node))
    receivers = ray_ranks(kind, layout)
    return _to_receivers(plan.strategy, layout, nbytes, cluster, ray, receivers, raw,
                         hops.total_s, cross, host_cores)  # fmt: skip


def price_rdt(layout, spec, cluster: ClusterConf, ray: RayCostConf, raw: bool = False,
              host_cores: int | None = None) -> DispatchCost:  # fmt: skip
    """``rdt`` (``raw``: its floor): the object through Ray to each replica's leader, as
    ``leader``'s; then each leader's lend to its replica as the preset's lend fit prices it
    (``RayCostConf.lend_s``: the lend task, Ray Direct Transport's sends in turn and the takers'
    round of tasks, the object's rest through the store). A preset without a lend fit prices a
    second round of tasks and ``rdt_plan``'s point to point sends of the tensors, as a
    strategy's plan is, on the same cluster, and the rest as each receiver's get of it."""
    nbytes = spec.tensor_bytes + spec.non_tensor_bytes
    leaders = ray_ranks(RDT, layout)
    lend = ray.lend_s(nbytes, layout.replica_size, raw)
    if lend is not None:
        # The lend's own round of tasks on the takers is in its fit: the mode's one round of
        # tasks is not priced again.
        cost = _to_receivers(f"{RDT}:raw" if raw else RDT, layout, nbytes, cluster, ray,
                             leaders, raw, lend, 0.0, host_cores)  # fmt: skip
        return replace(cost, call_s=0.0)
    plan = rdt_plan(layout, spec, raw)
    sends = price(plan, cluster, layout, check=False)
    cross = 0.0
    if layout.world_size <= 4096:  # the plan walk is O(ranks), as for a leader mode
        cross = float(predicted_cross_bytes(plan, cluster.gpus_per_node))
    rest_s = 0.0 if raw else ray.get_s(spec.non_tensor_bytes, False)
    lending_s = ray.calls_s(layout.dp) + sends.total_s + rest_s
    return _to_receivers(plan.strategy, layout, nbytes, cluster, ray, leaders, raw,
                         lending_s, cross, host_cores)  # fmt: skip


def price_cgraph(layout, nbytes: float, cluster: ClusterConf, ray: RayCostConf,
                 raw: bool = False, host_cores: int | None = None) -> DispatchCost:  # fmt: skip
    """``cgraph`` (``raw``: its floor), one node: no task submitted per call and no object
    store. With the preset's channel fit (``RayCostConf.channel_s``): every replica's chunk
    written into the graph's channels, and each rank's read of its chunk, a host's ranks at
    once on its cores. Without one: the driver's write of the input (every replica's chunk)
    priced as a put of all of it; each leader reads the whole input (a get of every chunk) and
    writes its own into its output channel (a put); every rank of its replica reads that (a
    get), a host's ranks at once."""
    every = layout.dp * nbytes
    getters = min(cluster.gpus_per_node, layout.world_size)
    cores = cluster.cpu_cores if host_cores is None else host_cores
    channels = ray.channel_s(every, nbytes, _sharing(getters, cores), raw)
    if channels is not None:
        name = "cgraph:raw" if raw else "cgraph"
        return DispatchCost(name, put_s=0.0, call_s=0.0, transfer_s=0.0, get_s=channels)
    return DispatchCost(
        "cgraph:raw" if raw else "cgraph",
        put_s=ray.put_s(every, raw) + ray.put_s(nbytes, raw),
        call_s=0.0,
        transfer_s=0.0,
        get_s=ray.get_s(every, raw)
        + _per_rank_get_s(ray, cluster, nbytes, raw, getters, host_cores),
    )


def price_mode(mode: str, layout, spec, cluster: ClusterConf, ray: RayCostConf,
               host_cores: int | None = None) -> DispatchCost:  # fmt: skip
    """Any dispatch mode of ``harness.job.dispatch`` on ``layout`` with a chunk of ``spec``."""
    nbytes = spec.tensor_bytes + spec.non_tensor_bytes
    kind, _, rest = mode.partition(":")
    if kind == "all_ranks" and rest in ("", "raw"):
        return price_all_ranks(layout, nbytes, cluster, ray, rest == "raw", host_cores)
    if kind in HOPS and rest in ("", "raw"):
        return price_hops(kind, layout, spec, cluster, ray, rest == "raw", host_cores)
    if kind == RDT and rest in ("", "raw"):
        return price_rdt(layout, spec, cluster, ray, rest == "raw", host_cores)
    if kind == CGRAPH and rest in ("", "raw"):
        return price_cgraph(layout, nbytes, cluster, ray, rest == "raw", host_cores)
    if kind != "leader" or not rest:
        raise ValueError(
            f"dispatch mode {mode!r}: expected leader:<strategy>, or all_ranks, rdt, cgraph, "
            "edge_stages or chain with an optional :raw"
        )
    pred = price_strategy(rest, layout, spec, cluster)
    cross = 0.0
    if layout.world_size <= 4096:  # the plan walk is O(ranks); the example asks for time only
        plan = strategies.get_class(rest).plan(layout, spec)
        cross = float(predicted_cross_bytes(plan, cluster.gpus_per_node))
    return price_leader(layout, nbytes, cluster, ray, rest, pred.total_s, cross, host_cores)


# -- the 16,384-GPU question -----------------------------------------------------------------
ASSUMPTIONS = (
    "the driver's node serves every pull (the object's owner); no pull is served from "
    "another node's copy, so all_ranks sends each chunk once per node of its replica "
    "through the driver's one object-manager address",
    "a cross-node object transfer runs at the cluster's inter-node link rate (one NIC), "
    "with no per-transfer start-up beyond transfer_call_us",
    "put, get and per-actor call costs are the local Ray calibration's (CPU host costs, "
    "one core per rank); on GPUs each receiving rank adds a host-to-device copy of its chunk",
    "every rank gets one task per call in both modes (the leader mode's non-leaders get "
    "meta_info), so the call overhead is the same on both sides",
    "leader + broadcast takes the best of the header family and pickled as priced by "
    "harness.model.prices on the same cluster",
    "edge_stages and chain carry the chunk as pickled objects, as their sources do "
    "(harness.model.dispatch_ranks.hop_plan); chain's pp - 1 stage-to-stage hops run one "
    "after another, each forwarding rank unpickling and pickling it again",
)


def example_answer(rows: list[dict]) -> str:
    """One sentence per payload: the node count from which all_ranks wins, or never."""
    lines = []
    for batch in sorted({r["batch_size"] for r in rows}):
        cells = [r for r in rows if r["batch_size"] == batch]
        wins = [r["nodes"] for r in cells if r["all_ranks_wins"]]
        ties = [r["nodes"] for r in cells if r["tie"]]
        size = f"{cells[0]['payload_bytes'] / 2**20:,.1f} MiB per replica (batch {batch})"
        even = f" (within {TIE:.0%}, even, at {ties} nodes)" if ties else ""
        if not wins:
            lines.append(f"{size}: all_ranks never overtakes leader + broadcast{even}")
        elif len(wins) == len(cells):
            lines.append(f"{size}: all_ranks wins at every node count scanned")
        else:
            lines.append(f"{size}: all_ranks wins at {wins} nodes only")
    return "\n".join(lines)


def format_scan(rows: list[dict]) -> str:
    """The scan, a line per cell; the hop modes' columns where the rows price them."""
    hops = [k for k in HOPS if rows and f"{k}_ms" in rows[0]]
    head = (
        f"{'nodes':>6}{'GPUs':>7}{'batch':>7}{'MiB':>10}{'all_ranks ms':>14}{'leader + best':>28}"
    ) + "".join(f"{k + ' ms':>16}" for k in hops)
    lines = [head]
    for r in rows:
        best = f"{r['leader']} {r['leader_ms']:.1f} ms"
        mark = "  <- all_ranks" if r["all_ranks_wins"] else ("  (even)" if r["tie"] else "")
        lines.append(
            f"{r['nodes']:>6}{r['gpus']:>7}{r['batch_size']:>7}{r['payload_bytes'] / 2**20:>10.1f}"
            f"{r['all_ranks_ms']:>14.1f}{best:>28}"
            + "".join(f"{r[f'{k}_ms']:>16.1f}" for k in hops)
            + mark
        )
    return "\n".join(lines)
