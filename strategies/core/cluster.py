"""A machine room as the cost model sees it: links, nodes, host rates; loading the presets.

Here, below ``auto``, rather than in the harness: ``auto`` prices plans on a preset, so the
schema, its checks and the preset files it reads sit where a strategy may import them.

``ClusterConf`` is both the schema of ``conf/cluster/*.yaml`` (Hydra structured config) and the
type the pricing code reads. Units live here and only here: the fields hold the units vendors
and nccl-tests quote (µs, GB/s = 1e9 bytes/s), as the YAML does; the read-only properties give
the SI values pricing needs (seconds, bytes/s, seconds/byte). Validation runs in
``__post_init__``, so every way of building one (Python, ``OmegaConf.to_object``,
``load_cluster``) checks the same things and names the field that is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from strategies.core.formulas import (
    ALLGATHER_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    COLLECTIVES,
    SCATTER_ALGORITHMS,
    ClusterError,
    coefficients,
)

GB = 1e9  # GB/s here is the nccl-tests unit, 1e9 bytes/s (not Gbit/s, not GiB/s)
US = 1e-6
CONF_DIR = (Path(__file__).resolve().parents[2] / "harness" / "conf" / "cluster").resolve()
"""The presets, ``conf/cluster/``: this distribution ships the Hydra tree as ``harness/conf``
(a link to the checkout's ``conf/``, package data in a wheel), which ``harness.paths.CONF_DIR``
names for the harness; the strategies read it as files, without importing the harness."""

__all__ = [
    "CONF_DIR",
    "GB",
    "STORES",
    "ClusterConf",
    "ClusterError",
    "LinkConf",
    "StoreConf",
    "load_cluster",
]


def check_number(where: str, value: Any, allow_zero: bool = False) -> float:
    """``value`` as a float when finite and > 0 (or >= 0); a ClusterError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ClusterError(f"{where} must be finite and {bound}, got {value!r}")
    return value


@dataclass(unsafe_hash=True)
class LinkConf:
    """One link's Hockney parameters: a message of n bytes costs ``alpha_s + n·beta_s_per_byte``."""

    alpha_us: float = 0.0
    """Start-up latency per message (software + wire), microseconds."""
    bandwidth_gbytes_per_s: float = 1.0
    """Payload bandwidth, GB/s = 1e9 bytes/s (divide a Gbit/s line rate by 8)."""

    @property
    def alpha_s(self) -> float:
        return self.alpha_us * US

    @property
    def beta_s_per_byte(self) -> float:
        """Inverse bandwidth, seconds per byte."""
        return 1.0 / (self.bandwidth_gbytes_per_s * GB)

    @classmethod
    def from_si(cls, alpha_s: float, beta_s_per_byte: float) -> LinkConf:
        """The link a fit in SI units describes (``harness.commands.calibrate``)."""
        return cls(alpha_s / US, 1.0 / (beta_s_per_byte * GB))

    def check(self, where: str) -> None:
        check_number(f"{where}.alpha_us", self.alpha_us, allow_zero=True)
        check_number(f"{where}.bandwidth_gbytes_per_s", self.bandwidth_gbytes_per_s)


STORES = (
    "node_shm",
    "ray_object",
    "transferqueue",
    "mooncake",
    "nixl",
    "page_cache",
    "torch_shared",
)
"""The stores a pull strategy fetches from (``plan.StoreFetch.store``): ``independent_fetch``'s
node-local shared-memory segment, Ray's object store (``ray_object_store``), TransferQueue's
storage unit (``transferqueue``), and the leader's transfer engine, whose registered message the
readers READ: Mooncake's Transfer Engine (``mooncake``) or a NIXL agent (``nixl``); the page
cache a record on disk is read from (``self_load``); and torch's shared storages, each leaf
copied into fresh shared memory by the leader and mapped by each reader through a descriptor
it fetches (``torch_shared``: α is paid per storage)."""
NO_PUT_PER_CALL = ("node_shm", "page_cache")
"""Stores whose β prices no put: the plan prices it apart (``node_shm``: the leader's pack) or
no steady call makes one (``page_cache``: the record is written when the batch changes). Their
put share is 0 by construction, never fitted: a fit that split their β would hand the bytes a
reader skipped a cost no call pays."""


def put_share(kind: str, store: StoreConf) -> float:
    """Of the bytes store ``kind``'s β prices, the put's share (the rest is the get's): only a
    reader of some fields (ROLL's lazy fetch) tells them apart, getting fewer bytes than the
    leader put. The store's fitted ``put_share`` where its calibration held such readers; else
    half where a put and a get each move the bytes once (Ray's object store, TransferQueue's
    storage unit, an engine's packed and read message), and none where the plan prices the put
    apart (``node_shm``: the leader's pack) or no call makes one (``page_cache``: the record is
    written when the batch changes)."""
    if kind in NO_PUT_PER_CALL:
        return 0.0
    if store.put_share is not None:
        return store.put_share
    return 0.5


@dataclass(unsafe_hash=True)
class StoreConf:
    """What a store costs one replica per call: a put and one reader's get together take
    ``call_us + n / gbytes_per_s``; each further reader fetching from the same store at the
    same time adds ``fetch_contention`` of that (readers share the store's memory bandwidth,
    its serving thread and, on a CPU host, the cores), so k readers of one store finish after
    (α + n·β)·(1 + fetch_contention·(k − 1)) (``strategies.core.store_pricing``). Fitted from
    a pull sweep's records by ``bcastbench store-calibrate``; all 0 = not measured (free)."""

    call_us: float = 0.0
    """α: fixed cost of one put and one get (the calls, their round trips, (de)serializing
    the batch's structure), µs."""
    gbytes_per_s: float = 0.0
    """1/β: bytes of one put and one get per second, GB/s (0 = bytes not priced)."""
    fetch_contention: float = 0.0
    """Share of one reader's time each further concurrent reader adds: 0 = readers fetch in
    parallel at full speed; 1 = the store serves them one after another; above 1, readers
    also slow each other (time-slicing a loaded host)."""
    put_share: float | None = None
    """Of the bytes β prices, the put's share, 0..1 (a reader of some fields gets fewer bytes
    than were put); fitted where the calibration sweep held such readers, null: the store
    kind's own (``put_share``)."""

    @property
    def call_s(self) -> float:
        return self.call_us * US

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per byte of a put and a get; 0 when the rate is not measured."""
        return 1.0 / (self.gbytes_per_s * GB) if self.gbytes_per_s > 0 else 0.0

    def check(self, where: str) -> None:
        for name in ("call_us", "gbytes_per_s", "fetch_contention"):
            check_number(f"{where}.{name}", getattr(self, name), allow_zero=True)
        if (
            self.put_share is not None
            and check_number(f"{where}.put_share", self.put_share, allow_zero=True) > 1.0
        ):
            raise ClusterError(
                f"{where}.put_share must be a share between 0 and 1 (or null), got "
                f"{self.put_share!r}"
            )


_RATES = ("d2h", "h2d", "pickle", "unpickle", "memcpy")
_OPTIONAL_RATES = ("device_copy",)
_CALLS = ("pickle_call", "unpickle_call", "pack_call", "unpack_call")
_ALGORITHMS = {
    "broadcast_algorithm": BROADCAST_ALGORITHMS,
    "scatter_algorithm": SCATTER_ALGORITHMS,
    "allgather_algorithm": ALLGATHER_ALGORITHMS,
}


@dataclass(eq=True)
class ClusterConf:
    """Schema of ``conf/cluster/*.yaml`` and the pricing code's view of a cluster. Ranks fill
    nodes in blocks of ``gpus_per_node``."""

    name: str = "unnamed"
    """Preset name, carried into predictions and reports."""
    gpus_per_node: int = 8
    """Ranks per node; global rank r lives on node r // gpus_per_node (Megatron's orders put TP,
    then CP, innermost, so a TP group fills a node first)."""
    nics_per_node: int = 1
    """Network ports per node usable at once; concurrent cross-node groups beyond this many share
    a node's ports and divide their bandwidth."""
    intra: LinkConf = field(default_factory=LinkConf)
    """Link between two ranks on the same node (NVLink, or loopback for a local world)."""
    inter: LinkConf = field(default_factory=LinkConf)
    """One port of the inter-node network; a group spanning nodes is priced on it."""
    broadcast_algorithm: str = "tree"
    """'tree': binomial ⌈log₂p⌉(α+nβ) (gloo); 'ring': pipelined chain (p−1)α+nβ (NCCL)."""
    scatter_algorithm: str = "binomial"
    """'binomial': ⌈log₂p⌉α; 'linear': (p−1)α (root sends each chunk); β term (p−1)·chunk·β."""
    allgather_algorithm: str = "recursive_doubling"
    """'recursive_doubling': ⌈log₂p⌉α; 'ring': (p−1)α; β term ((p−1)/p)·n·β either way."""
    intra_by_kind: dict[str, LinkConf] = field(default_factory=dict)
    """Per-collective overrides of ``intra`` (keys: broadcast, scatter, all_gather; a calibrated
    local world fits each kind alone)."""
    inter_by_kind: dict[str, LinkConf] = field(default_factory=dict)
    """Per-collective overrides of ``inter``."""
    d2h_gbytes_per_s: float = 25.0
    """Device→host copy, GB/s (pickling CUDA tensors goes through host memory)."""
    h2d_gbytes_per_s: float = 25.0
    """Host→device copy, GB/s (unpickled tensors go back to the GPU)."""
    pickle_gbytes_per_s: float = 1.0
    """pickle.dumps throughput, GB/s of pickle produced."""
    unpickle_gbytes_per_s: float = 1.0
    """pickle.loads throughput, GB/s of pickle consumed."""
    memcpy_gbytes_per_s: float = 5.0
    """Host memcpy of one rank (packing into / copying out of a flat buffer), GB/s."""
    device_copy_gbytes_per_s: float = 0.0
    """On-device copy, GB/s of bytes copied, for ``packed_bytes`` and ``copied_bytes`` when ranks
    hold their batch on an accelerator (packing on a GPU is a device-to-device copy); 0 = ranks
    are host processes, use ``memcpy_gbytes_per_s``."""
    pickle_call_us: float = 0.0
    """Fixed host cost of one ``pickle.dumps`` of a batch object, on top of its bytes, µs."""
    unpickle_call_us: float = 0.0
    """Fixed host cost of one ``pickle.loads`` of a batch object, on top of its bytes, µs."""
    pack_call_us: float = 0.0
    """Fixed host cost of one pack of header + flat buffer (``strategies.core.packer.pack``), µs."""
    unpack_call_us: float = 0.0
    """Fixed host cost of one header decode + unpack into views (``strategies.core.unpacker.unpack``), µs."""
    signal_us: float = 0.0
    """One node-local signal of a shared-memory hand-off (``plan.Handoff``): the writer's socket
    message to one rank of its node and that rank's wake-up, µs. A node's writer signals its
    ranks one after another, so a node of k ranks pays (k−1)·signal. 0 = not measured (free,
    like the other per-call terms); ``bcastbench calibrate`` measures it."""
    cpu_cores: int = 0
    """Cores the ranks of one machine share (a CPU world time-slices them); 0 = every rank has
    its own device and host cores (GPU clusters): no oversubscription factor."""
    stores: dict[str, StoreConf] = field(default_factory=dict)
    """Per store a pull strategy fetches from (keys: ``STORES``), its put/get α, β and fetch
    contention; a store not listed is priced as ``store`` says (not measured here)."""
    calibrated_ranks: int = 0
    """Ranks of the world the α/β and host figures were measured on (``harness.commands.calibrate``);
    0 = not calibrated here."""

    def __post_init__(self) -> None:
        where = f"cluster {self.name!r}"
        for name, low in (("gpus_per_node", 1), ("nics_per_node", 1), ("cpu_cores", 0),
                          ("calibrated_ranks", 0)):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                what = "a positive integer" if low else "an integer >= 0 (0 = not applicable)"
                raise ClusterError(f"{where}: {name} must be {what}, got {value!r}")
        for name, valid in _ALGORITHMS.items():
            if getattr(self, name) not in valid:
                raise ClusterError(
                    f"{where}: {name} must be one of {list(valid)}, got {getattr(self, name)!r}"
                )
        self._check_links(where)
        for rate in _RATES + _OPTIONAL_RATES:
            check_number(f"{where}: {rate}_gbytes_per_s", getattr(self, f"{rate}_gbytes_per_s"),
                         allow_zero=rate in _OPTIONAL_RATES)  # fmt: skip
        for call in _CALLS + ("signal",):
            check_number(f"{where}: {call}_us", getattr(self, f"{call}_us"), allow_zero=True)

    def _check_links(self, where: str) -> None:
        for name in ("intra", "inter"):
            link = getattr(self, name)
            if not isinstance(link, LinkConf):
                raise ClusterError(f"{where}: {name} must be a LinkConf, got {link!r}")
            link.check(f"{where}: {name}")
        for name in ("intra_by_kind", "inter_by_kind"):
            for kind, link in getattr(self, name).items():
                if kind not in COLLECTIVES:
                    raise ClusterError(
                        f"{where}: {name} has unknown collective {kind!r}; "
                        f"valid kinds are {list(COLLECTIVES)}"
                    )
                if not isinstance(link, LinkConf):
                    raise ClusterError(f"{where}: {name}.{kind} must be a LinkConf, got {link!r}")
                link.check(f"{where}: {name}.{kind}")
        for kind, store in self.stores.items():
            if kind not in STORES:
                raise ClusterError(
                    f"{where}: stores has unknown store {kind!r}; valid stores are {list(STORES)}"
                )
            if not isinstance(store, StoreConf):
                raise ClusterError(f"{where}: stores.{kind} must be a StoreConf, got {store!r}")
            store.check(f"{where}: stores.{kind}")
            if kind in NO_PUT_PER_CALL and store.put_share not in (None, 0, 0.0):
                raise ClusterError(
                    f"{where}: stores.{kind}.put_share must be 0 or null (no call of it makes a "
                    f"put its β prices), got {store.put_share!r}; set it to 0 or remove the key"
                )

    def __hash__(self) -> int:  # the by-kind dicts are not hashable; their items are
        return hash(
            tuple(
                tuple(sorted(v.items())) if isinstance(v, Mapping) else v
                for v in (getattr(self, f.name) for f in fields(self))
            )
        )

    # -- SI views (what pricing reads) ------------------------------------------------------
    @property
    def d2h_bytes_per_s(self) -> float:
        return self.d2h_gbytes_per_s * GB

    @property
    def h2d_bytes_per_s(self) -> float:
        return self.h2d_gbytes_per_s * GB

    @property
    def pickle_bytes_per_s(self) -> float:
        return self.pickle_gbytes_per_s * GB

    @property
    def unpickle_bytes_per_s(self) -> float:
        return self.unpickle_gbytes_per_s * GB

    @property
    def memcpy_bytes_per_s(self) -> float:
        return self.memcpy_gbytes_per_s * GB

    @property
    def device_copy_bytes_per_s(self) -> float:
        return self.device_copy_gbytes_per_s * GB

    @property
    def device(self) -> str:
        """Where the cluster's ranks hold their batch: 'cuda' when it describes an on-device
        copy rate (``device_copy_gbytes_per_s``), else 'cpu' (host processes)."""
        return "cuda" if self.device_copy_gbytes_per_s > 0 else "cpu"

    @property
    def pack_copy_bytes_per_s(self) -> float:
        """Rate of ``packed_bytes``/``copied_bytes``: on-device copy if set, else host memcpy."""
        return (self.device_copy_gbytes_per_s or self.memcpy_gbytes_per_s) * GB

    @property
    def pickle_call_s(self) -> float:
        return self.pickle_call_us * US

    @property
    def unpickle_call_s(self) -> float:
        return self.unpickle_call_us * US

    @property
    def pack_call_s(self) -> float:
        return self.pack_call_us * US

    @property
    def unpack_call_s(self) -> float:
        return self.unpack_call_us * US

    @property
    def signal_s(self) -> float:
        return self.signal_us * US

    # -- questions pricing asks -------------------------------------------------------------
    def store(self, kind: str) -> StoreConf:
        """The costs of store ``kind`` (``STORES``) as measured here. Not measured: a node store
        is a copy out of host memory (into a rank's own buffer, or onto its device: the host's
        memcpy or host-to-device rate, readers not contending), and so are the page cache and
        torch's shared storages; any other store is free."""
        if kind in self.stores:
            return self.stores[kind]
        if kind in ("node_shm", "page_cache", "torch_shared"):
            rate = self.h2d_gbytes_per_s if self.device != "cpu" else self.memcpy_gbytes_per_s
            return StoreConf(gbytes_per_s=rate)
        return StoreConf()

    def link(self, kind: str, crosses_nodes: bool) -> LinkConf:
        """The α/β a collective of ``kind`` pays, inside a node or across nodes."""
        if crosses_nodes:
            return self.inter_by_kind.get(kind, self.inter)
        return self.intra_by_kind.get(kind, self.intra)

    def oversubscription(self, world_size: int) -> float:
        """CPU time-slicing factor of a world of ``world_size`` ranks on the cluster's host.

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

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def algorithms(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in _ALGORITHMS}

    def collective_s(self, kind: str, group_size: int, nbytes: int, crosses_nodes: bool) -> float:
        """Seconds for one collective alone, wholly on one link (no sharing, no tree rounds)."""
        a, b = coefficients(kind, group_size, nbytes, **self.algorithms())
        link = self.link(kind, crosses_nodes)
        return a * link.alpha_s + b * link.beta_s_per_byte


# -- loading ---------------------------------------------------------------------------------
def _one_line(exc: Exception) -> str:
    """An OmegaConf error as 'key: message' on one line (its own text spans several)."""
    key = getattr(exc, "full_key", None)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{key}: {first}" if key else first


def cluster_from_dict(cfg: Mapping[str, Any] | Any) -> ClusterConf:
    """A ``ClusterConf`` from a plain dict or DictConfig in the YAML's units, type-checked
    against the schema and value-checked; unknown keys are named with the valid ones."""
    # Imported on first use, not with the module: every strategy module is imported on every
    # rank (the registry), and only a rank that reads a cluster description needs OmegaConf.
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(cfg, Mapping) and not OmegaConf.is_config(cfg):
        raise ClusterError(f"a cluster description must be a mapping, got {type(cfg).__name__}")
    name = str(cfg.get("name", "unnamed"))
    known = {f.name for f in fields(ClusterConf)}
    unknown = sorted(set(cfg.keys()) - known)
    if unknown:
        raise ClusterError(
            f"cluster {name!r}: unknown keys {unknown}; valid keys are {sorted(known)}"
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ClusterConf), cfg)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ClusterError(f"cluster {name!r}: {_one_line(exc)}") from None


def preset_path(name_or_path: str | Path) -> Path:
    """``conf/cluster/<name>.yaml`` for a preset name; a ``.yaml`` path as given."""
    path = Path(name_or_path)
    return path if path.suffix in (".yaml", ".yml") else CONF_DIR / f"{name_or_path}.yaml"


def presets() -> list[str]:
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml"))


def load_cluster(name_or_path: str | Path) -> ClusterConf:
    """A preset by name (``conf/cluster/<name>.yaml``) or a YAML path, checked against the
    schema; errors name the file, the field and the value."""
    # On first use, as in cluster_from_dict: a rank that never reads a preset skips OmegaConf.
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = preset_path(name_or_path)
    if not path.is_file():
        raise ClusterError(f"no cluster file {path}; presets in {CONF_DIR}: {presets()}")
    try:
        raw = OmegaConf.load(path)
    except (OSError, OmegaConfBaseException, ValueError) as exc:
        raise ClusterError(f"{path}: {_one_line(exc)}") from None
    try:
        return cluster_from_dict(raw)
    except ClusterError as exc:
        raise ClusterError(f"{path}: {exc}") from None


def register_configs() -> None:
    """Store ``ClusterConf`` as ``cluster/schema`` in Hydra's ConfigStore (for a root config
    that declares ``cluster: ClusterConf`` or a YAML that lists ``schema`` in its defaults)."""
    # On first use: only a Hydra app registers configs; a rank running strategies never does.
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="cluster", name="schema", node=ClusterConf)
