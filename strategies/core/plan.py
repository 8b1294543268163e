"""Communication plans: what a strategy will do for a layout and payload, stated without running.

A plan lists every collective every replica issues (kind, global ranks, root, bytes, step) and
the local work per role. The cost model prices plans; a test checks each plan against the
collectives a real gloo run records (``strategies.core.trace``).
"""

from __future__ import annotations

import inspect
import pickle
from dataclasses import dataclass, field
from typing import Literal

from strategies.core.contract import wants_non_tensor
from strategies.core.header_format import encode_header
from strategies.core.packer import layout_entries
from strategies.core.parts import blob_room, encode_non_tensor, message_parts, nbytes_of

CommKind = Literal["broadcast", "scatter", "all_gather"]


@dataclass(frozen=True)
class Comm:
    """One collective on one group."""

    kind: CommKind
    """The collective."""
    ranks: tuple[int, ...]
    """Global ranks of the group, in group-rank order."""
    root: int | None
    """Global rank of the source (broadcast, scatter); None for all_gather."""
    nbytes: int
    """Message size: broadcast = bytes every rank ends with; scatter = bytes per rank (one
    chunk); all_gather = total gathered bytes per rank (nccl-tests convention)."""
    step: int
    """Comms with the same step run at the same time on disjoint groups; steps run in order."""
    what: str = "payload"
    """What travels: 'sizes', 'pickle', 'header', 'payload', 'chunk', 'leaf' (one tensor),
    'handoff' (a shared-memory hand-off's message to another node, ``pricing.handoff_comms``)."""
    exact: bool = True
    """False when nbytes is an estimate (pickle sizes predicted without pickling)."""


@dataclass(frozen=True)
class LocalWork:
    """Bytes a rank touches outside the network, per call."""

    pickled_bytes: int = 0
    """Bytes produced by pickle.dumps (source) or consumed by pickle.loads (receiver)."""
    packed_bytes: int = 0
    """Bytes copied into a flat send buffer."""
    copied_bytes: int = 0
    """Other host copies (buffer growth, copy-out of received data)."""
    d2h_bytes: int = 0
    """Device to host copies (pickling CUDA tensors)."""
    h2d_bytes: int = 0
    """Host to device copies."""


@dataclass(frozen=True)
class Handoff:
    """One replica's message handed to its ranks through shared memory (``shm``,
    ``floor:shm``): the root writes it once into its node's segment and signals each rank of
    its node; the ranks on other nodes get it from one rank per node (point-to-point from the
    root), which writes it into that node's segment and signals its node. Not collectives: a
    layout holds no nodes, so ``pricing.price`` derives the crossings from the cluster's
    nodes."""

    ranks: tuple[int, ...]
    """Global ranks of the replica, the root first."""
    nbytes: int
    """Bytes of the message every rank ends with."""
    stripe_min_bytes: int | None = None
    """The channel's threshold: a message this large crosses to each other node in stripes,
    one per rank pair (``groups.stripes``); None: it crosses whole."""

    @property
    def root(self) -> int:
        return self.ranks[0]


@dataclass(frozen=True)
class StoreFetch:
    """One replica's batch put once into a store and fetched by its other ranks (the pull
    strategies: ``independent_fetch``, ``ray_object_store``, ``transferqueue``). Not a
    collective: ``strategies.core.store_pricing`` prices it from the cluster's ``stores``."""

    store: str
    """Which store (``cluster.STORES``): its put/get α, β and fetch contention."""
    ranks: tuple[int, ...]
    """Global ranks of the replica, the writer first; every other rank fetches."""
    nbytes: int
    """Bytes put once and fetched by each reader."""
    scope: Literal["node", "replica"] = "node"
    """'node': each node holds a copy its ranks fetch (``independent_fetch``'s node store, Ray's
    object, copied once to each other node), so a node's readers contend; 'replica': one store
    serves every reader of the replica (TransferQueue's storage unit), so all of them contend
    and each remote reader fetches across the network."""
    crosses: bool = True
    """Whether the fetch's crossings of nodes are priced with it; False where the plan's
    ``Handoff`` already carries them (``independent_fetch`` feeds each node's store so)."""
    read_bytes: int | None = None
    """Bytes each reader gets, where it reads only some fields (ROLL's lazy fetch: the store
    strategies' ``fields``); None: all ``nbytes``."""
    calls: int = 1
    """Times a put and a reader's get pay the store's α: once, or once per storage where each
    leaf is one of its own (``torch_shared``: a fresh shared storage and a descriptor each)."""

    @property
    def writer(self) -> int:
        return self.ranks[0]

    @property
    def got_bytes(self) -> int:
        """Bytes each reader gets."""
        return self.nbytes if self.read_bytes is None else self.read_bytes

    def priced_bytes(self, put_share: float) -> float:
        """The bytes a store's β prices for one put and one get: the put's share of every byte
        put and the get's share of the bytes read (``cluster.put_share``); ``nbytes`` where
        the readers read everything."""
        return put_share * self.nbytes + (1.0 - put_share) * self.got_bytes


@dataclass
class Plan:
    """Everything one call of ``get_data_input`` does, for every replica of a layout."""

    strategy: str
    comms: list[Comm] = field(default_factory=list)
    leader: LocalWork = field(default_factory=LocalWork)
    """Work on each replica leader."""
    receiver: LocalWork = field(default_factory=LocalWork)
    """Work on a rank that only receives (the heaviest such role)."""
    forwarder: LocalWork = field(default_factory=LocalWork)
    """Work on a rank that receives and then sends on (stage-0 ranks in two-hop strategies)."""
    shared: list[Handoff] = field(default_factory=list)
    """Messages handed over through node-local shared memory after ``comms``, one per replica."""
    stores: list[StoreFetch] = field(default_factory=list)
    """Batches put into a store and fetched by every other rank, one per replica."""

    def for_rank(self, rank: int) -> list[Comm]:
        """The comms ``rank`` takes part in, in issue order."""
        return [c for c in self.comms if rank in c.ranks]

    @property
    def steps(self) -> int:
        return 1 + max((c.step for c in self.comms), default=-1)


def plan_of(cls, layout, spec, device: str = "cpu", **options) -> Plan:
    """``cls.plan(layout, spec, **options)`` for a batch on ``device``: a plan that can stage
    through host memory (its ``stage`` parameter: ``shm``) is staged off the CPU, as the
    strategy itself does there."""
    if device != "cpu" and "stage" in inspect.signature(cls.plan).parameters:
        options = {**options, "stage": True}
    return cls.plan(layout, spec, **options)


def plan_options(cls, options) -> dict:
    """Of a strategy's options (a record's ``options``; anything but a dict is none), those its
    plan prices: the ones ``cls.plan`` takes by name (``fields``, ``stage``...)."""
    if not isinstance(options, dict):
        return {}
    takes = inspect.signature(cls.plan).parameters
    return {k: v for k, v in options.items() if k in takes and k not in ("layout", "spec")}


@dataclass(frozen=True)
class PayloadSpec:
    """What a plan needs to know about a batch, without holding its data."""

    tensor_bytes: int
    """Sum of the batch's tensor bytes (``payload_bytes`` in records)."""
    n_tensors: int
    """Number of tensor leaves."""
    header_bytes: int
    """Encoded size of the header strategies send (exact: encoding is cheap and pure)."""
    pickle_bytes: int
    """Bytes ``pickle`` produces for the TensorDict (exact when measured, else estimated)."""
    non_tensor_bytes: int = 0
    """Pickled bytes of non_tensor_batch."""
    broadcast_non_tensor: bool = False
    """meta_info['_broadcast_non_tensor_batch']."""
    pickle_exact: bool = False
    """Whether pickle_bytes was measured."""
    dtype_bytes: tuple[int, ...] = ()
    """Tensor bytes per distinct dtype, in order of each dtype's first leaf (strategies that
    send one buffer per dtype)."""
    leaf_bytes: tuple[int, ...] | None = None
    """Bytes of each tensor leaf in iteration order (strategies that send one per tensor)."""
    leaf_names: tuple[str, ...] | None = None
    """Each tensor leaf's key, dotted (``nested.mask``), in ``leaf_bytes``'s order (a jagged
    leaf's parts each under its key): what a reader of some fields (``fields``) reads."""

    @property
    def sent_non_tensor_bytes(self) -> int:
        """The pickled non-tensor bytes a call moves: ``non_tensor_bytes`` where the batch flags
        them for broadcast (``broadcast_non_tensor``), else none."""
        return self.non_tensor_bytes if self.broadcast_non_tensor else 0

    @property
    def sent_bytes(self) -> int:
        """Tensor bytes plus ``sent_non_tensor_bytes``: what a raw broadcast of the batch moves."""
        return self.tensor_bytes + self.sent_non_tensor_bytes

    def leaf_nbytes(self, leaf_bytes: tuple[int, ...] | None = None) -> tuple[list[int], bool]:
        """Bytes per tensor leaf for a plan, and whether they are exact: ``leaf_bytes`` when
        given, else this spec's own, else equal leaves (inexact)."""
        leaf_bytes = leaf_bytes if leaf_bytes is not None else self.leaf_bytes
        if leaf_bytes is not None:
            return list(leaf_bytes), True
        n = self.n_tensors
        if n == 0:
            return [], True
        return [self.tensor_bytes // n + (i < self.tensor_bytes % n) for i in range(n)], False

    @property
    def message_bytes(self) -> int:
        """Size of the packed message: header (with leaf padding) + tensors + the padded
        non-tensor blob when it travels."""
        nt = -(-blob_room(self.non_tensor_bytes) // 64) * 64 if self.broadcast_non_tensor else 0
        return self.header_bytes + self.tensor_bytes + nt


def bytes_per_dtype(dtypes, sizes) -> tuple[int, ...]:
    """Bytes per distinct dtype, in order of each dtype's first leaf (``dtype_bytes``)."""
    per_dtype: dict = {}
    for dtype, n in zip(dtypes, sizes):
        per_dtype[dtype] = per_dtype.get(dtype, 0) + n
    return tuple(per_dtype.values())


def spec_of(dp) -> PayloadSpec:
    """The exact PayloadSpec of a leader's DataProto (header size as ``encode_header`` writes it, with
    its 64-byte leaf padding folded in; pickle size measured)."""
    # A jagged leaf counts as its parts and a non-tensor leaf as its pickle (the packed message).
    leaves = [(key, t) for key, _, _, t in message_parts(dp.batch)]
    sizes = [nbytes_of(t) for _, t in leaves]
    flagged = wants_non_tensor(dp)
    nt = dp.non_tensor_batch if flagged else None
    blob = encode_non_tensor(nt) if nt is not None else None
    entries, data_bytes, span = layout_entries(
        dp.batch,
        0,
        None if blob is None else blob_room(len(blob)),
        parts=[(k, 0, 0, t) for k, t in leaves],
    )
    header_len = len(encode_header(tuple(dp.batch.batch_size), entries, data_bytes, span))
    nt_padded = -(-blob_room(len(blob)) // 64) * 64 if blob is not None else 0
    return PayloadSpec(
        tensor_bytes=sum(sizes),
        n_tensors=len(sizes),
        header_bytes=header_len + data_bytes - sum(sizes) - nt_padded,
        pickle_bytes=len(pickle.dumps(dp.batch)),
        non_tensor_bytes=len(blob) if blob is not None else 0,
        broadcast_non_tensor=flagged,
        pickle_exact=True,
        dtype_bytes=bytes_per_dtype([t.dtype for _, t in leaves], sizes),
        leaf_bytes=tuple(sizes),
        leaf_names=tuple(".".join(key) for key, _ in leaves),
    )
