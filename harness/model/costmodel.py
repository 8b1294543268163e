"""Price a communication ``Plan`` on a cluster with the Hockney α–β model, without running it.

Clusters come from ``conf/cluster/*.yaml`` (schema ``ClusterConfig``, human units: µs, GB/s) and
are turned into ``Cluster`` (SI units: s, s/byte). ``price`` says how long a plan takes, on which
link, and whether latency (α) or bandwidth (β) dominates. Pure: no process group, no torch.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from harness import paths  # noqa: I001
from strategies.core.layout import Layout
from strategies.core.plan import Comm, LocalWork, Plan

COLLECTIVES = ("broadcast", "scatter", "all_gather")
BROADCAST_ALGORITHMS = ("tree", "ring")
SCATTER_ALGORITHMS = ("binomial", "linear")
ALLGATHER_ALGORITHMS = ("recursive_doubling", "ring")
GB = 1e9  # GB/s here is the nccl-tests unit, 1e9 bytes/s (not Gbit/s, not GiB/s)
CONF_DIR = paths.CONF_DIR / "cluster"

BroadcastAlgorithm = Literal["tree", "ring"]
ScatterAlgorithm = Literal["binomial", "linear"]
AllgatherAlgorithm = Literal["recursive_doubling", "ring"]
LinkName = Literal["intra", "inter", "none"]


class ClusterError(ValueError):
    """A cluster description that cannot be priced; the message names the field and value."""


# --------------------------------------------------------------------------------------------
# The model's own form: every collective costs a·α + b·β. Calibration fits α, β with exactly
# these coefficients, so that a calibrated cluster reproduces its measurements by construction.
# --------------------------------------------------------------------------------------------
def ceil_log2(p: int) -> int:
    return (p - 1).bit_length() if p > 1 else 0


def coefficients(
    kind: str,
    group_size: int,
    nbytes: int,
    broadcast_algorithm: str = "tree",
    scatter_algorithm: str = "binomial",
    allgather_algorithm: str = "recursive_doubling",
) -> tuple[float, float]:
    """``(a, b)`` with T = a·α + b·β for one collective (Thakur, Rabenseifner & Gropp 2005).

    ``nbytes`` follows ``Comm.nbytes``: broadcast = bytes every rank ends with; scatter = one
    chunk (each rank's share); all_gather = total gathered bytes per rank.
    """
    p = group_size
    if p <= 1:
        return 0.0, 0.0  # a group of one moves nothing
    if kind == "broadcast":
        if broadcast_algorithm == "tree":  # binomial tree: ⌈log₂p⌉ rounds of the whole message
            rounds = ceil_log2(p)
            return float(rounds), float(rounds * nbytes)
        if broadcast_algorithm == "ring":  # pipelined chain: fill p−1 hops, then n·β
            return float(p - 1), float(nbytes)
        raise ClusterError(f"unknown broadcast_algorithm {broadcast_algorithm!r}")
    if kind == "scatter":
        # The root's p−1 chunks all leave it, whatever the tree: ((p−1)/p)·(p·chunk)·β.
        if scatter_algorithm == "binomial":
            return float(ceil_log2(p)), float((p - 1) * nbytes)
        if scatter_algorithm == "linear":  # one message per receiver, back to back
            return float(p - 1), float((p - 1) * nbytes)
        raise ClusterError(f"unknown scatter_algorithm {scatter_algorithm!r}")
    if kind == "all_gather":
        share = (p - 1) / p * nbytes
        if allgather_algorithm == "recursive_doubling":
            return float(ceil_log2(p)), share
        if allgather_algorithm == "ring":
            return float(p - 1), share
        raise ClusterError(f"unknown allgather_algorithm {allgather_algorithm!r}")
    raise ClusterError(f"unknown collective {kind!r}; valid kinds are {list(COLLECTIVES)}")


# --------------------------------------------------------------------------------------------
# Runtime types (SI units)
# --------------------------------------------------------------------------------------------
def _check_positive(where: str, value: Any, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ClusterError(f"{where} must be finite and {bound}, got {value!r}")
    return value


@dataclass(frozen=True)
class Link:
    """One link's Hockney parameters: a message of n bytes costs ``alpha_s + n·beta_s_per_byte``."""

    alpha_s: float
    """Start-up latency per message (software + wire), seconds."""
    beta_s_per_byte: float
    """Inverse bandwidth, seconds per byte (1 / payload bytes per second)."""

    def __post_init__(self) -> None:
        _check_positive("alpha_s", self.alpha_s, allow_zero=True)
        _check_positive("beta_s_per_byte", self.beta_s_per_byte)

    @property
    def bandwidth_gbytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte / GB

    @classmethod
    def from_human(cls, alpha_us: float, bandwidth_gbytes_per_s: float) -> Link:
        return cls(alpha_us * 1e-6, 1.0 / (bandwidth_gbytes_per_s * GB))


@dataclass(frozen=True)
class Cluster:
    """A machine room as the cost model sees it. Ranks fill nodes in blocks of gpus_per_node."""

    name: str
    """Preset name, carried into predictions and reports."""
    gpus_per_node: int
    """Ranks per node; global rank r lives on node r // gpus_per_node (Megatron's orders put TP,
    then CP, innermost, so a TP group fills a node first)."""
    nics_per_node: int
    """Network ports per node usable at once; concurrent cross-node groups beyond this many share
    a node's ports and divide their bandwidth."""
    intra: Link
    """Link between two ranks on the same node (NVLink, or loopback for a local world)."""
    inter: Link
    """One port of the inter-node network; a group spanning nodes is priced on it."""
    broadcast_algorithm: BroadcastAlgorithm = "tree"
    """'tree': binomial ⌈log₂p⌉(α+nβ) (gloo); 'ring': pipelined chain (p−1)α+nβ (NCCL)."""
    scatter_algorithm: ScatterAlgorithm = "binomial"
    """'binomial': ⌈log₂p⌉α; 'linear': (p−1)α (root sends each chunk); β term (p−1)·chunk·β."""
    allgather_algorithm: AllgatherAlgorithm = "recursive_doubling"
    """'recursive_doubling': ⌈log₂p⌉α; 'ring': (p−1)α; β term ((p−1)/p)·n·β either way."""
    intra_by_kind: Mapping[str, Link] = field(default_factory=dict)
    """Per-collective overrides of ``intra`` (a calibrated local world fits each kind alone)."""
    inter_by_kind: Mapping[str, Link] = field(default_factory=dict)
    """Per-collective overrides of ``inter``."""
    d2h_bytes_per_s: float = 25e9
    """Device→host copy throughput (pickling CUDA tensors goes through host memory)."""
    h2d_bytes_per_s: float = 25e9
    """Host→device copy throughput (unpickled tensors go back to the GPU)."""
    pickle_bytes_per_s: float = 1e9
    """pickle.dumps throughput, bytes of pickle produced per second."""
    unpickle_bytes_per_s: float = 1e9
    """pickle.loads throughput, bytes of pickle consumed per second."""
    memcpy_bytes_per_s: float = 5e9
    """Host memcpy throughput of one rank (packing into / copying out of a flat buffer)."""
    device_copy_bytes_per_s: float = 0.0
    """On-device copy throughput (bytes copied per second) for ``packed_bytes`` and
    ``copied_bytes`` when ranks hold their batch on an accelerator (packing on a GPU is a
    device-to-device copy, not a host memcpy); 0 = ranks are host processes, use
    ``memcpy_bytes_per_s``."""
    pickle_call_s: float = 0.0
    """Fixed host cost of one ``pickle.dumps`` of a batch object, on top of its bytes."""
    unpickle_call_s: float = 0.0
    """Fixed host cost of one ``pickle.loads`` of a batch object, on top of its bytes."""
    pack_call_s: float = 0.0
    """Fixed host cost of one pack of header + flat buffer (``strategies.core.codec.pack``)."""
    unpack_call_s: float = 0.0
    """Fixed host cost of one header decode + unpack into views (``codec.unpack``)."""
    cpu_cores: int = 0
    """Cores the ranks of one machine share (a CPU world time-slices them); 0 = every rank has
    its own device and host cores (GPU clusters): no oversubscription factor."""
    calibrated_ranks: int = 0
    """Ranks of the world the α/β and host figures were measured on (``harness.model.calibrate``);
    0 = not calibrated here."""

    def __post_init__(self) -> None:
        where = f"cluster {self.name!r}"
        for name in ("gpus_per_node", "nics_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ClusterError(f"{where}: {name} must be a positive integer, got {value!r}")
        for name in ("cpu_cores", "calibrated_ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ClusterError(
                    f"{where}: {name} must be an integer >= 0 (0 = not applicable), got {value!r}"
                )
        for name, valid in (
            ("broadcast_algorithm", BROADCAST_ALGORITHMS),
            ("scatter_algorithm", SCATTER_ALGORITHMS),
            ("allgather_algorithm", ALLGATHER_ALGORITHMS),
        ):
            if getattr(self, name) not in valid:
                raise ClusterError(
                    f"{where}: {name} must be one of {list(valid)}, got {getattr(self, name)!r}"
                )
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise ClusterError(f"{where}: {name} must be a Link, got {getattr(self, name)!r}")
        for name in ("intra_by_kind", "inter_by_kind"):
            for kind, link in getattr(self, name).items():
                if kind not in COLLECTIVES:
                    raise ClusterError(
                        f"{where}: {name} has unknown collective {kind!r}; "
                        f"valid kinds are {list(COLLECTIVES)}"
                    )
                if not isinstance(link, Link):
                    raise ClusterError(f"{where}: {name}.{kind} must be a Link, got {link!r}")
        for name in (
            "d2h_bytes_per_s",
            "h2d_bytes_per_s",
            "pickle_bytes_per_s",
            "unpickle_bytes_per_s",
            "memcpy_bytes_per_s",
        ):
            _check_positive(f"{where}: {name}", getattr(self, name))
        for name in (
            "device_copy_bytes_per_s",
            "pickle_call_s",
            "unpickle_call_s",
            "pack_call_s",
            "unpack_call_s",
        ):
            _check_positive(f"{where}: {name}", getattr(self, name), allow_zero=True)

    def __hash__(self) -> int:  # the by-kind dicts are not hashable; their items are
        return hash(
            tuple(
                tuple(sorted(v.items())) if isinstance(v, Mapping) else v
                for v in (getattr(self, f.name) for f in fields(self))
            )
        )

    def link(self, kind: str, crosses_nodes: bool) -> Link:
        """The α/β a collective of ``kind`` pays, inside a node or across nodes."""
        if crosses_nodes:
            return self.inter_by_kind.get(kind, self.inter)
        return self.intra_by_kind.get(kind, self.intra)

    def oversubscription(self, world_size: int) -> float:
        """CPU time-slicing factor of a world of ``world_size`` ranks on this machine.

        On a CPU cluster (``cpu_cores`` > 0) every rank is a process on the same ``cpu_cores``
        cores. A busy rank gets a share min(1, cores / ranks) of a core, and the calibration
        world already ran at its own share, so a world of W ranks runs slower than the
        calibration by share(N) / share(W) = max(cores, W) / max(cores, N), clamped at 1 (a
        world smaller than the calibration is priced as calibrated, not faster):

            factor = max(1, W / max(cores, N)),   N = calibrated_ranks.

        1 on GPU clusters (``cpu_cores`` = 0), where each rank drives its own device.
        """
        if self.cpu_cores <= 0 or world_size <= 0:
            return 1.0
        return max(1.0, world_size / max(self.cpu_cores, self.calibrated_ranks, 1))

    @property
    def pack_copy_bytes_per_s(self) -> float:
        """Rate of ``packed_bytes``/``copied_bytes``: on-device copy if set, else host memcpy."""
        return self.device_copy_bytes_per_s or self.memcpy_bytes_per_s

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def algorithms(self) -> dict[str, str]:
        return dict(
            broadcast_algorithm=self.broadcast_algorithm,
            scatter_algorithm=self.scatter_algorithm,
            allgather_algorithm=self.allgather_algorithm,
        )

    def collective_s(self, kind: str, group_size: int, nbytes: int, crosses_nodes: bool) -> float:
        """Seconds for one collective alone, wholly on one link (no sharing, no tree rounds)."""
        a, b = coefficients(kind, group_size, nbytes, **self.algorithms())
        link = self.link(kind, crosses_nodes)
        return a * link.alpha_s + b * link.beta_s_per_byte


# --------------------------------------------------------------------------------------------
# Predictions
# --------------------------------------------------------------------------------------------
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
    """``packed_bytes`` + ``copied_bytes`` at ``Cluster.pack_copy_bytes_per_s``."""
    d2h_s: float
    h2d_s: float
    calls_s: float = 0.0
    """Fixed per-call host overhead (pickle/unpickle/pack/unpack calls, see ``host_calls``)."""

    @property
    def total_s(self) -> float:
        return (
            self.pickle_s + self.unpickle_s + self.memcpy_s + self.d2h_s + self.h2d_s + self.calls_s
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
    """CPU time-slicing factor already applied to every term (``Cluster.oversubscription``)."""

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
                    what="pickle/unpickle/copy/d2h/h2d/calls",
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

    def seconds(self, cluster: Cluster) -> float:
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
    - a leader with ``packed_bytes`` > 0 packs once, and then every receiver decodes the header
      and unpacks once (pickled non-tensor data inside the message is part of those calls).
      A forwarder passes the buffer on before it unpacks, so its unpack is off the path.
    """
    object_hops = len({c.step for c in plan.comms if c.what == "pickle"})
    packs = plan.leader.packed_bytes > 0
    moves = any(len(c.ranks) > 1 for c in plan.comms)
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
    work: LocalWork, cluster: Cluster, role: str, calls: HostCalls | None = None
) -> LocalCost:
    """Seconds of host work for one role. A forwarder unpickles what it got and pickles it again
    to send it on, so its pickled bytes pay both directions. ``packed_bytes`` and
    ``copied_bytes`` move at ``Cluster.pack_copy_bytes_per_s`` (on-device where the ranks hold
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


def tree_rounds(ranks: tuple[int, ...], root: int | None) -> list[list[tuple[int, int]]]:
    """Edges (sender, receiver) of each round of a binomial-tree broadcast, in global ranks.

    Round k sends over distance 2^k from the root in group order (0→1, then 0→2 and 1→3, …);
    node boundaries play no part, so on the brief's emulated cluster a 4-rank broadcast crosses
    the slow link twice at once (2·S on one link per node) — what was measured there.
    """
    p = len(ranks)
    start = ranks.index(root) if root is not None and root in ranks else 0
    order = ranks[start:] + ranks[:start]
    rounds = []
    d = 1
    while d < p:
        rounds.append([(order[i], order[i + d]) for i in range(min(d, p - d))])
        d *= 2
    return rounds


def _price_step(step: int, comms: list[Comm], cluster: Cluster) -> StepCost:
    g = cluster.gpus_per_node
    algos = cluster.algorithms()
    nics = cluster.nics_per_node
    # First pass: which groups cross nodes, and how many flows leave each node. A tree broadcast
    # that crosses is priced round by round (its crossing edges per round are its flows); any
    # other crossing collective is one flow from each node it touches for its whole duration.
    spans: list[tuple[int, ...] | None] = []
    trees: dict[int, list[list[tuple[int, int]]]] = {}
    whole_at: Counter[int] = Counter()  # flows lasting the whole step, per node
    round_at: list[Counter[int]] = []  # tree flows per round, per node (groups in lock-step)
    for i, c in enumerate(comms):
        lo, hi = min(c.ranks), max(c.ranks)
        if lo // g == hi // g:
            spans.append(None)
            continue
        nodes = tuple({r // g for r in c.ranks})
        spans.append(nodes)
        if c.kind == "broadcast" and cluster.broadcast_algorithm == "tree":
            trees[i] = rounds = tree_rounds(tuple(c.ranks), c.root)
            while len(round_at) < len(rounds):
                round_at.append(Counter())
            for k, edges in enumerate(rounds):
                round_at[k].update(s // g for s, r in edges if s // g != r // g)
        else:
            whole_at.update(nodes)

    def share_at(node: int, k: int | None) -> float:
        if k is None:  # a whole-duration flow meets the busiest round of the trees
            tree_flows = max((rc[node] for rc in round_at), default=0)
        else:
            tree_flows = round_at[k][node]
        # k flows leaving one node over m ports each get m/k of a port (even striping).
        return max(1.0, (whole_at[node] + tree_flows) / nics)

    best: CommCost | None = None
    n_inter = 0
    max_share = 1.0
    for i, (c, nodes) in enumerate(zip(comms, spans)):
        p = len(c.ranks)
        if nodes is None:
            a, b = coefficients(c.kind, p, c.nbytes, **algos)
            link = cluster.link(c.kind, crosses_nodes=False)
            link_name: LinkName = "intra" if p > 1 else "none"
            share, n_nodes = 1.0, 1
            alpha_s, beta_s = a * link.alpha_s, b * link.beta_s_per_byte
        elif i in trees:
            link_name, n_nodes, n_inter = "inter", len(nodes), n_inter + 1
            intra = cluster.link(c.kind, crosses_nodes=False)
            inter = cluster.link(c.kind, crosses_nodes=True)
            alpha_s = beta_s = 0.0
            share = 1.0
            for k, edges in enumerate(trees[i]):
                # A round lasts as long as its slowest edge.
                worst = (0.0, 0.0, 1.0)
                for s, r in edges:
                    if s // g == r // g:
                        edge = (intra.alpha_s, c.nbytes * intra.beta_s_per_byte, 1.0)
                    else:
                        f = share_at(s // g, k)
                        edge = (inter.alpha_s, c.nbytes * inter.beta_s_per_byte * f, f)
                    if edge[0] + edge[1] > worst[0] + worst[1]:
                        worst = edge
                alpha_s += worst[0]
                beta_s += worst[1]
                share = max(share, worst[2])
            max_share = max(max_share, share)
        else:
            a, b = coefficients(c.kind, p, c.nbytes, **algos)
            link = cluster.link(c.kind, crosses_nodes=True)
            link_name, n_nodes, n_inter = "inter", len(nodes), n_inter + 1
            share = max(share_at(n, None) for n in nodes)
            max_share = max(max_share, share)
            alpha_s, beta_s = a * link.alpha_s, b * link.beta_s_per_byte * share
        if best is None or alpha_s + beta_s > best.total_s:
            best = CommCost(
                step=step,
                kind=c.kind,
                what=c.what,
                group_size=p,
                first_rank=min(c.ranks),
                nbytes=c.nbytes,
                link=link_name,
                nodes=n_nodes,
                nic_share=share,
                alpha_s=alpha_s,
                beta_s=beta_s,
                exact=c.exact,
            )
    assert best is not None
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


def price(
    plan: Plan, cluster: Cluster, layout: Layout | None = None, check: bool = True
) -> Prediction:
    """Predict one call of ``plan`` on ``cluster``.

    Ranks live on node ``rank // gpus_per_node``. A group inside one node pays ``intra``; a
    group spanning nodes pays ``inter`` (a tree broadcast only in the rounds whose edges cross,
    see ``tree_rounds``). Steps run in order; a step's comms run at once on disjoint groups and
    share each node's ports (flows beyond ``nics_per_node`` divide the bandwidth), so a step
    costs its slowest comm. Local work is taken as serial with the network (a
    conservative critical path): leader, forwarder and receiver work are added once each, the
    forwarder's only when the plan has one (``has_forwarder``), each with its fixed per-call
    host costs (``host_calls``). On a CPU cluster every term is then multiplied by
    ``cluster.oversubscription(world)``, world = ``layout.world_size`` (or the highest rank the
    plan names, plus one). ``check`` verifies ranks fit ``layout`` and same-step groups are
    disjoint (cheap, O(ranks)).
    """
    by_step: dict[int, list[Comm]] = {}
    for c in plan.comms:
        if c.kind not in COLLECTIVES:
            raise ValueError(f"plan {plan.strategy!r}: unknown collective {c.kind!r}")
        if c.nbytes < 0:
            raise ValueError(f"plan {plan.strategy!r}: negative nbytes in {c}")
        by_step.setdefault(c.step, []).append(c)
    if check:
        world = layout.world_size if layout is not None else None
        for step, comms in by_step.items():
            _check_disjoint(step, comms)
            if world is not None:
                top = max(max(c.ranks) for c in comms)
                if top >= world:
                    raise ValueError(
                        f"plan {plan.strategy!r} step {step} names rank {top}, outside "
                        f"{layout.describe()} (world {world})"  # type: ignore[union-attr]
                    )
    steps = tuple(_price_step(s, by_step[s], cluster) for s in sorted(by_step))
    calls = host_calls(plan)
    forwarder = plan.forwarder if has_forwarder(plan) else LocalWork()
    if forwarder is not plan.forwarder:
        calls["forwarder"] = HostCalls()
    local = tuple(
        price_local(work, cluster, role, calls[role])
        for role, work in (
            ("leader", plan.leader),
            ("forwarder", forwarder),
            ("receiver", plan.receiver),
        )
    )
    if layout is not None:
        world = layout.world_size
    else:
        world = 1 + max((max(c.ranks) for c in plan.comms), default=0)
    over = cluster.oversubscription(world)
    if over != 1.0:
        steps = tuple(
            replace(
                s, critical=replace(s.critical, alpha_s=s.critical.alpha_s * over,
                                    beta_s=s.critical.beta_s * over)
            )
            for s in steps
        )  # fmt: skip
        local = tuple(replace(w, **{k: getattr(w, k) * over for k in _LOCAL_PARTS}) for w in local)
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


_LOCAL_PARTS = ("pickle_s", "unpickle_s", "memcpy_s", "d2h_s", "h2d_s", "calls_s")


def lower_bound_s(cluster: Cluster, group_size: int, nbytes: int, crosses_nodes: bool) -> float:
    """max(⌈log₂p⌉·α, n·β): no broadcast of n bytes to p ranks on this link can beat it."""
    link = cluster.link("broadcast", crosses_nodes)
    return max(ceil_log2(group_size) * link.alpha_s, nbytes * link.beta_s_per_byte)


# --------------------------------------------------------------------------------------------
# Config schema (Hydra structured config, human units) and loading
# --------------------------------------------------------------------------------------------
@dataclass
class LinkConfig:
    """A link in the units vendors and nccl-tests quote."""

    alpha_us: float = 0.0
    """Per-message latency, microseconds."""
    bandwidth_gbytes_per_s: float = 1.0
    """Payload bandwidth, GB/s = 1e9 bytes/s (divide a Gbit/s line rate by 8)."""


@dataclass
class ClusterConfig:
    """Schema of ``conf/cluster/*.yaml``; ``Cluster.from_config`` validates and converts it."""

    _target_: str = "harness.model.costmodel.build_cluster"
    name: str = "unnamed"
    """Preset name."""
    gpus_per_node: int = 8
    """Ranks per node (global rank // gpus_per_node is the node)."""
    nics_per_node: int = 1
    """Inter-node ports per node usable at once."""
    intra: LinkConfig = field(default_factory=LinkConfig)
    """Same-node link (NVLink, or loopback)."""
    inter: LinkConfig = field(default_factory=LinkConfig)
    """One inter-node port."""
    broadcast_algorithm: str = "tree"
    """'tree' (gloo's binomial tree) or 'ring' (NCCL's pipelined chain)."""
    scatter_algorithm: str = "binomial"
    """'binomial' or 'linear'."""
    allgather_algorithm: str = "recursive_doubling"
    """'recursive_doubling' or 'ring'."""
    intra_by_kind: dict[str, LinkConfig] = field(default_factory=dict)
    """Per-collective overrides of ``intra`` (keys: broadcast, scatter, all_gather)."""
    inter_by_kind: dict[str, LinkConfig] = field(default_factory=dict)
    """Per-collective overrides of ``inter``."""
    d2h_gbytes_per_s: float = 25.0
    """Device→host copy, GB/s."""
    h2d_gbytes_per_s: float = 25.0
    """Host→device copy, GB/s."""
    pickle_gbytes_per_s: float = 1.0
    """pickle.dumps output rate, GB/s."""
    unpickle_gbytes_per_s: float = 1.0
    """pickle.loads input rate, GB/s."""
    memcpy_gbytes_per_s: float = 5.0
    """One rank's host memcpy, GB/s."""
    device_copy_gbytes_per_s: float = 0.0
    """On-device copy (packing on a GPU), GB/s of bytes copied; 0 = host ranks, use memcpy."""
    pickle_call_us: float = 0.0
    """Fixed cost of one pickle.dumps of a batch, µs."""
    unpickle_call_us: float = 0.0
    """Fixed cost of one pickle.loads of a batch, µs."""
    pack_call_us: float = 0.0
    """Fixed cost of one header + flat-buffer pack, µs."""
    unpack_call_us: float = 0.0
    """Fixed cost of one header decode + unpack into views, µs."""
    cpu_cores: int = 0
    """Cores a CPU world's ranks share (0 = GPU cluster: no oversubscription factor)."""
    calibrated_ranks: int = 0
    """World size the figures were calibrated on (0 = not calibrated)."""


def _link_from(where: str, cfg: Any) -> Link:
    alpha_us = _check_positive(f"{where}.alpha_us", _get(where, cfg, "alpha_us"), allow_zero=True)
    bw = _check_positive(
        f"{where}.bandwidth_gbytes_per_s", _get(where, cfg, "bandwidth_gbytes_per_s")
    )
    return Link.from_human(alpha_us, bw)


def _get(where: str, cfg: Any, key: str) -> Any:
    try:
        return cfg[key] if isinstance(cfg, Mapping) else getattr(cfg, key)
    except (KeyError, AttributeError):
        raise ClusterError(
            f"{where} has no {key}; a link needs alpha_us and bandwidth_gbytes_per_s"
        ) from None


def cluster_from_config(cfg: Any) -> Cluster:
    """``Cluster`` from a ``ClusterConfig``, a DictConfig or a plain dict (human units)."""
    if not isinstance(cfg, Mapping) and hasattr(cfg, "__dataclass_fields__"):
        cfg = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    known = {f.name for f in fields(ClusterConfig)}
    unknown = sorted(set(cfg.keys()) - known)
    name = str(cfg.get("name", "unnamed"))
    if unknown:
        raise ClusterError(
            f"cluster {name!r}: unknown keys {unknown}; valid keys are {sorted(known)}"
        )
    defaults = ClusterConfig()

    def get(key: str) -> Any:
        return cfg[key] if key in cfg else getattr(defaults, key)

    def rate(key: str, allow_zero: bool = False) -> float:
        return _check_positive(f"cluster {name!r}: {key}", get(key), allow_zero) * GB

    def us(key: str) -> float:
        return _check_positive(f"cluster {name!r}: {key}", get(key), allow_zero=True) * 1e-6

    def by_kind(key: str) -> dict[str, Link]:
        unknown_kinds = sorted(set(get(key) or {}) - set(COLLECTIVES))
        if unknown_kinds:  # before the links, so a typo in a kind is named as such
            raise ClusterError(
                f"cluster {name!r}: {key} has unknown collective {unknown_kinds[0]!r}; "
                f"valid kinds are {list(COLLECTIVES)}"
            )
        return {
            str(kind): _link_from(f"cluster {name!r}: {key}.{kind}", link)
            for kind, link in (get(key) or {}).items()
        }

    return Cluster(
        name=name,
        gpus_per_node=get("gpus_per_node"),
        nics_per_node=get("nics_per_node"),
        intra=_link_from(f"cluster {name!r}: intra", get("intra")),
        inter=_link_from(f"cluster {name!r}: inter", get("inter")),
        broadcast_algorithm=get("broadcast_algorithm"),
        scatter_algorithm=get("scatter_algorithm"),
        allgather_algorithm=get("allgather_algorithm"),
        intra_by_kind=by_kind("intra_by_kind"),
        inter_by_kind=by_kind("inter_by_kind"),
        d2h_bytes_per_s=rate("d2h_gbytes_per_s"),
        h2d_bytes_per_s=rate("h2d_gbytes_per_s"),
        pickle_bytes_per_s=rate("pickle_gbytes_per_s"),
        unpickle_bytes_per_s=rate("unpickle_gbytes_per_s"),
        memcpy_bytes_per_s=rate("memcpy_gbytes_per_s"),
        device_copy_bytes_per_s=rate("device_copy_gbytes_per_s", allow_zero=True),
        pickle_call_s=us("pickle_call_us"),
        unpickle_call_s=us("unpickle_call_us"),
        pack_call_s=us("pack_call_us"),
        unpack_call_s=us("unpack_call_us"),
        cpu_cores=get("cpu_cores"),
        calibrated_ranks=get("calibrated_ranks"),
    )


def build_cluster(**cfg: Any) -> Cluster:
    """Hydra ``_target_`` of ``ClusterConfig``: ``hydra.utils.instantiate(cfg.cluster)``."""
    cfg.pop("_target_", None)
    return cluster_from_config(cfg)


def cluster_to_config(cluster: Cluster) -> ClusterConfig:
    """The inverse of ``cluster_from_config`` (what ``harness.model.calibrate`` writes)."""

    def human(link: Link) -> LinkConfig:
        return LinkConfig(link.alpha_s * 1e6, link.bandwidth_gbytes_per_s)

    return ClusterConfig(
        name=cluster.name,
        gpus_per_node=cluster.gpus_per_node,
        nics_per_node=cluster.nics_per_node,
        intra=human(cluster.intra),
        inter=human(cluster.inter),
        broadcast_algorithm=cluster.broadcast_algorithm,
        scatter_algorithm=cluster.scatter_algorithm,
        allgather_algorithm=cluster.allgather_algorithm,
        intra_by_kind={k: human(v) for k, v in cluster.intra_by_kind.items()},
        inter_by_kind={k: human(v) for k, v in cluster.inter_by_kind.items()},
        d2h_gbytes_per_s=cluster.d2h_bytes_per_s / GB,
        h2d_gbytes_per_s=cluster.h2d_bytes_per_s / GB,
        pickle_gbytes_per_s=cluster.pickle_bytes_per_s / GB,
        unpickle_gbytes_per_s=cluster.unpickle_bytes_per_s / GB,
        memcpy_gbytes_per_s=cluster.memcpy_bytes_per_s / GB,
        device_copy_gbytes_per_s=cluster.device_copy_bytes_per_s / GB,
        pickle_call_us=cluster.pickle_call_s * 1e6,
        unpickle_call_us=cluster.unpickle_call_s * 1e6,
        pack_call_us=cluster.pack_call_s * 1e6,
        unpack_call_us=cluster.unpack_call_s * 1e6,
        cpu_cores=cluster.cpu_cores,
        calibrated_ranks=cluster.calibrated_ranks,
    )


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A preset by name (``conf/cluster/<name>.yaml``) or a YAML path, type-checked against
    ``ClusterConfig`` and then value-checked; errors name the file, the field and the value."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = CONF_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        presets = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
        raise ClusterError(f"no cluster file {path}; presets in {CONF_DIR}: {presets}")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(ClusterConfig), OmegaConf.load(path))
        plain = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise ClusterError(f"{path}: {exc}") from exc
    try:
        return cluster_from_config(plain)
    except ClusterError as exc:
        raise ClusterError(f"{path}: {exc}") from exc


def register_configs() -> None:
    """Store ``ClusterConfig`` as ``cluster/schema`` in Hydra's ConfigStore (for a root config
    that declares ``cluster: ClusterConfig`` or a YAML that lists ``schema`` in its defaults)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="cluster", name="schema", node=ClusterConfig)
