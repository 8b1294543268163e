"""The get_data_input contract: DataProto, its validation (every leaf kind carried or refused),
the process groups a strategy receives, and the Strategy base class whose ``get_data_input``
holds the contract for every strategy (a leader's failure reaches every rank).
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from tensordict import NonTensorData, NonTensorStack, TensorDict, is_tensor_collection

from strategies.core.completion import Replay, distinct_groups, marks, posted_since
from strategies.core.groups import (
    MegatronView,
    check_order,
    derive_replicas,
    node_indices,
    node_key,
    node_split,
)
from strategies.core.layout import Layout
from strategies.core.trace import WORK

NON_TENSOR_FLAG = "_broadcast_non_tensor_batch"


class ContractError(ValueError):
    """A batch that breaks the DataProto contract; the message names the key and the rank."""


class Unsupported(NotImplementedError):
    """A strategy that cannot serve this layout by design or by a known upstream bug.

    Raised on every rank at construction, before any collective, so no rank hangs; the harness
    records the job as unsupported (with this message) instead of failing the sweep.
    """


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass
class DataProto:
    """The batch container ROLL and verl hand to ``get_data_input``."""

    batch: TensorDict | None = None
    """Tensors with a leading batch dimension B (``batch.batch_size[0]``)."""
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    """Object arrays of length B (prompt texts, uids, ...)."""
    meta_info: dict[str, Any] = field(default_factory=dict)
    """Run-level values (global_step, micro_batch_size, flags); already on every rank."""

    @property
    def broadcast_non_tensor(self) -> bool:
        return bool(self.meta_info.get(NON_TENSOR_FLAG, False))

    def entry_state(self, is_leader: bool) -> DataProto:
        """What ROLL's dispatcher leaves on a rank: the leader holds everything, the others hold
        only (a copy of) the same meta_info."""
        if is_leader:
            return DataProto(self.batch, self.non_tensor_batch, self.meta_info)
        return DataProto(None, {}, copy.deepcopy(self.meta_info))

    def validate(self, rank: int | None = None, device: torch.device | None = None) -> int:
        """Check the leader's batch; return B. Raises ContractError naming key and rank."""
        return validate(self, rank, device)


# -- any DataProto-shaped object (ours, verl's, ROLL's) ----------------------------------------
PROTO_ATTRS = ("batch", "non_tensor_batch", "meta_info")


def _is_leaf(cls) -> bool:
    """Tensors, jagged NestedTensors and the non-tensor leaves (NonTensorData, NonTensorStack)
    are leaves; any other TensorDict is a node (tensordict's default skips non-tensor leaves)."""
    return not is_tensor_collection(cls) or issubclass(cls, (NonTensorData, NonTensorStack))


def leaves(td) -> list[tuple[tuple[str, ...], Any]]:
    """Every leaf of a TensorDict in iteration order, its key as a tuple; non-tensor leaves
    come as their NonTensorData / NonTensorStack."""
    out = []
    for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf):
        out.append((key if isinstance(key, tuple) else (key,), value))
    return out


def is_non_tensor_leaf(value) -> bool:
    return isinstance(value, (NonTensorData, NonTensorStack))


def wants_non_tensor(batch) -> bool:
    """``meta_info["_broadcast_non_tensor_batch"]`` of any DataProto-shaped object (False for
    anything without a meta_info dict, so a broken leader batch never raises here)."""
    meta = getattr(batch, "meta_info", None)
    return bool(meta.get(NON_TENSOR_FLAG, False)) if isinstance(meta, dict) else False


def deliver(entry, batch: TensorDict, non_tensor: dict | None):
    """Receiver: write what arrived onto the entry object it was handed (any DataProto-shaped
    class keeps its type) and return it."""
    entry.batch = batch
    if non_tensor is not None:
        entry.non_tensor_batch = non_tensor
    return entry


def _key_name(key: tuple[str, ...]):
    return key if len(key) > 1 else key[0]


def validate(
    batch,
    rank: int | None = None,
    device: torch.device | None = None,
    lazy: list | None = None,
) -> int:
    """Check a leader's DataProto-shaped object (attributes batch, non_tensor_batch,
    meta_info); return B. ``device``: the groups' device, where (besides the CPU) leaves may
    live. Every leaf kind no strategy can carry exactly is refused here (``tensor_refusal``);
    ``lazy``, when given, collects the keys of conjugate and negative views, which travel as
    their values once resolved (``resolve_lazy_views``). Raises ContractError naming the key
    and the rank."""
    rank = _rank() if rank is None else rank
    missing = [a for a in PROTO_ATTRS if not hasattr(batch, a)]
    if missing:
        raise ContractError(
            f"rank {rank}: get_data_input takes a DataProto-shaped object (attributes "
            f"{', '.join(PROTO_ATTRS)}); got {type(batch).__name__}, which lacks {missing}"
        )
    td = batch.batch
    if td is None:
        raise ContractError(f"rank {rank}: the leader's DataProto has batch=None")
    if not isinstance(td, TensorDict):
        raise ContractError(
            f"rank {rank}: batch must be a tensordict.TensorDict, got {type(td).__name__}"
        )
    if len(td.batch_size) < 1:
        raise ContractError(
            f"rank {rank}: batch.batch_size is {list(td.batch_size)}; expected a leading batch "
            "dimension B"
        )
    if FAILURE_KEY in td.keys():
        raise ContractError(
            f"rank {rank}: batch[{FAILURE_KEY!r}] is a reserved key: it carries a leader's "
            "failure to its receivers; rename it"
        )
    b = int(td.batch_size[0])
    for key, value in leaves(td):
        _check_leaf(_key_name(key), value, b, rank, device)
        if lazy is not None and type(value) is torch.Tensor and is_lazy(value):
            lazy.append(key)
    check_non_tensor(batch, b, rank)
    return b


def check_non_tensor(batch, b: int, rank: int) -> None:
    """``non_tensor_batch`` is a dict of numpy arrays of length B (ContractError otherwise)."""
    non_tensor = batch.non_tensor_batch
    if not isinstance(non_tensor, dict):
        raise ContractError(
            f"rank {rank}: non_tensor_batch is {type(non_tensor).__name__}; expected a dict of "
            f"numpy arrays of length B={b}"
        )
    for key, arr in non_tensor.items():
        if not isinstance(arr, np.ndarray):
            raise ContractError(
                f"rank {rank}: non_tensor_batch[{key!r}] is {type(arr).__name__}; expected a "
                f"numpy array of length B={b}"
            )
        if arr.ndim < 1 or arr.shape[0] != b:
            raise ContractError(
                f"rank {rank}: non_tensor_batch[{key!r}] has length "
                f"{arr.shape[0] if arr.ndim else 'scalar'}; expected B={b}"
            )


try:  # the class of a jagged NestedTensor (layout=torch.jagged), a torch.Tensor subclass
    from torch.nested._internal.nested_tensor import NestedTensor
except ImportError:  # a torch without jagged nested tensors
    NestedTensor = ()

CARRIED = (
    "dense strided tensors (any view: strided, transposed, expanded, offset, conjugate or "
    "negative; efficient zero tensors), jagged NestedTensors and NonTensorData/NonTensorStack "
    "leaves"
)
"""What the contract carries (each strategy may refuse more, on every rank)."""
_LAYOUT_FIX = {
    torch.sparse_coo: "a sparse COO tensor",
    torch.sparse_csr: "a sparse CSR tensor",
    torch.sparse_csc: "a sparse CSC tensor",
    torch.sparse_bsr: "a sparse BSR tensor",
    torch.sparse_bsc: "a sparse BSC tensor",
}


def tensor_refusal(value: torch.Tensor) -> str | None:
    """Why a tensor leaf cannot travel exactly through every strategy (what it is, and what
    to send instead), or None when it can. Conjugate and negative views and efficient zero
    tensors can: they travel as their values, as any view does (``is_lazy``)."""
    if type(value) is not torch.Tensor:
        if isinstance(value, NestedTensor) and value.layout is torch.jagged:
            return None
        cls = type(value)
        return (
            f"a {cls.__module__}.{cls.__qualname__}, a tensor subclass whose class and state "
            "no strategy carries; send a plain torch.Tensor (x.detach() for a Parameter, "
            "x.full_tensor() for a DTensor)"
        )
    if value.layout is not torch.strided:
        what = _LAYOUT_FIX.get(value.layout)
        if what is not None:
            return f"{what}; send x.to_dense(), or its indices and values as leaves of their own"
        return f"a tensor with layout {value.layout}; send x.to_dense()"
    if value.is_nested:
        return (
            "a nested tensor with layout torch.strided; only layout=torch.jagged nested tensors "
            "travel (torch.nested.nested_tensor(..., layout=torch.jagged))"
        )
    if value.is_quantized:
        return (
            f"a quantized tensor ({value.dtype}); send x.dequantize(), or x.int_repr() with its "
            "scale and zero point"
        )
    return None


def _check_leaf(key, value, b: int, rank: int, device: torch.device | None) -> None:
    if is_non_tensor_leaf(value):
        shape = list(value.batch_size)
    elif isinstance(value, torch.Tensor):
        why = tensor_refusal(value)
        if why is not None:
            raise ContractError(
                f"rank {rank}: batch[{key!r}] is {why}; get_data_input carries {CARRIED}"
            )
        shape = list(value.shape)
        if value.device.type == "meta" or (
            device is not None and value.device.type != "cpu" and value.device != device
        ):
            where = "the CPU" + (f" or {device}" if device is not None else "")
            raise ContractError(
                f"rank {rank}: batch[{key!r}] is on device {value.device}; expected {where}"
            )
    else:
        raise ContractError(
            f"rank {rank}: batch[{key!r}] is {type(value).__name__}; expected a tensor"
        )
    if not shape or shape[0] != b:
        raise ContractError(
            f"rank {rank}: batch[{key!r}] has shape {shape}; expected leading dim B={b}"
        )


def is_lazy(t: torch.Tensor) -> bool:
    """A dense tensor whose values are computed when read: a conjugate or negative view, or an
    efficient zero tensor. A copy reads them right; a collective, a raw byte view or a pickle
    of its storage does not."""
    return t.is_conj() or t.is_neg() or t._is_zerotensor()


def resolved(t: torch.Tensor) -> torch.Tensor:
    """A lazy tensor's values in a tensor of its own (``is_lazy``)."""
    if t._is_zerotensor():
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t.resolve_conj().resolve_neg()


def resolve_lazy_views(batch, keys: list):
    """The leader's object as it travels: ``batch`` itself, or (when ``keys`` name lazy
    leaves, ``is_lazy``) a shallow copy whose batch holds those leaves resolved. Receivers get
    the values a view shows, never its lazy bit, which collectives and buffers cannot carry;
    the caller's batch is left as it was."""
    if not keys:
        return batch
    td = batch.batch.clone(recurse=False)  # new nodes, the same leaves
    for key in keys:
        view = td.get(key)
        WORK["copied_bytes"] += view.numel() * view.element_size()
        td.set(key, resolved(view))
    sent = copy.copy(batch)
    sent.batch = td
    return sent


# -- a leader's failure, shipped to its receivers -----------------------------------------------
class LeaderFailed(ContractError):
    """Raised on a receiver whose replica leader failed before or while sending its batch; the
    message names the leader's rank and its error (type and text)."""


def failure_text(exc: BaseException) -> str:
    """A leader's exception as the one line its receivers raise with: ``Type: message``."""
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class ShippedFailure:
    """What a ``broadcast_object_list`` carries in place of objects its source could not
    pickle: the source's error as ``Type: text``, picklable whatever it raised."""

    text: str


def failed_while_pickling(exc: BaseException) -> bool:
    # broadcast_object_list pickles every object before its first collective; a failure there
    # leaves every receiver waiting in the sizes broadcast, where a second call still lands.
    frames = traceback.walk_tb(exc.__traceback__)
    return any(frame.f_code.co_name == "_object_to_tensor" for frame, _ in frames)


def broadcast_objects(box: list, src: int, group) -> Exception | None:
    """``dist.broadcast_object_list(box, src, group)`` that cannot strand the receivers: if the
    source fails to pickle an object (a lambda in a non-tensor array, any foreign type), it
    sends a ``ShippedFailure`` in every slot instead and returns its exception; receivers find
    the ShippedFailure in ``box``. Any other error propagates as before."""
    try:
        dist.broadcast_object_list(box, src=src, group=group)
        return None
    except Exception as exc:
        if not failed_while_pickling(exc):
            raise
        box[:] = [ShippedFailure(failure_text(exc))] * len(box)
        dist.broadcast_object_list(box, src=src, group=group)
        return exc


def raise_failure(groups, text: str, exc: BaseException | None = None):
    """End of a call that carried a failure: the leader re-raises its own exception (or a
    ContractError with ``text``), a receiver raises LeaderFailed naming the leader's error.
    Either is marked settled: every rank already knows, so nothing more is sent for it."""
    if groups.is_leader:
        raise settled(exc if exc is not None else ContractError(text))
    raise settled(leader_failed(groups, text))


def leader_failed(groups, text: str) -> LeaderFailed:
    return LeaderFailed(
        f"rank {groups.rank}: the replica leader (rank {groups.leader}) failed to send its "
        f"batch: {text}"
    )


_SETTLED = "_bcastbench_settled"


def settled(exc: BaseException) -> BaseException:
    """Mark ``exc`` as a failure every rank of the replica has learnt of (an enclosing call
    ships nothing more for it); returns it, to be raised."""
    setattr(exc, _SETTLED, True)
    return exc


def is_settled(exc: BaseException) -> bool:
    return getattr(exc, _SETTLED, False)


FAILURE_KEY = "__bcastbench_leader_failure__"
"""The one leaf of a failure batch: the leader's error as UTF-8 bytes. validate refuses it in
a caller's batch."""
FAILURE_MAX_BYTES = 60_000


def failure_batch(text: str, non_tensor: bool, device: torch.device) -> DataProto:
    """What a leader sends instead of a batch it cannot send: an ordinary batch, one dense
    uint8 leaf holding ``text`` (B = its length), so any strategy carries it through its own
    collectives, whatever they are. ``non_tensor``: the flag the receivers hold (theirs is the
    leader's meta_info), so a strategy whose receivers read it posts what the leader posts."""
    raw = text.encode()[:FAILURE_MAX_BYTES] or b"?"
    leaf = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    td = TensorDict({FAILURE_KEY: leaf}, batch_size=[len(raw)])
    return DataProto(td, {}, {NON_TENSOR_FLAG: non_tensor})


def failure_in(out) -> str | None:
    """The leader's error, when what arrived is a failure batch; None for a batch."""
    td = getattr(out, "batch", None)
    if not isinstance(td, TensorDict):
        return None
    entries = getattr(td, "_tensordict", None)  # a plain TensorDict: one dict lookup
    leaf = entries.get(FAILURE_KEY) if type(entries) is dict else td.get(FAILURE_KEY, None)
    if leaf is None:
        return None
    return leaf.cpu().numpy().tobytes().decode(errors="replace")


class Hop(NamedTuple):
    """One hop of a relay: the group, its gloo twin for host-side metadata, and its global
    ranks in group-rank order (``ranks[0]`` is the source)."""

    group: Any
    cpu_group: Any
    ranks: tuple[int, ...]


@dataclass
class ProcessGroups:
    """The groups a strategy may use, built once per layout and handed to every strategy."""

    tp_cp_group: Any
    """TP×CP group of this rank's stage (Megatron's tensor-and-context-parallel group)."""
    pp_group: Any
    """This rank's pipeline group: one rank per stage, same tp/cp coordinate."""
    replica_group: Any
    """All tp·cp·pp ranks of this rank's DP replica (who must end with the same batch)."""
    tp_cp_ranks: tuple[int, ...]
    """Global ranks of ``tp_cp_group`` in group-rank order."""
    pp_ranks: tuple[int, ...]
    """Global ranks of ``pp_group`` in group-rank order (stage order)."""
    replica_ranks: tuple[int, ...]
    """Global ranks of ``replica_group``; ``replica_ranks[0]`` is the leader."""
    pp_rank: int
    """This rank's pipeline stage."""
    tp_cp_rank: int
    """This rank's index in ``tp_cp_group``."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where received tensors live: CPU on gloo, this rank's GPU on NCCL."""
    cpu_tp_cp_group: Any = None
    """Gloo twin of ``tp_cp_group`` for host-side metadata (the same group on gloo)."""
    cpu_pp_group: Any = None
    """Gloo twin of ``pp_group``."""
    cpu_replica_group: Any = None
    """Gloo twin of ``replica_group``."""
    rank: int = 0
    """This rank's global rank."""
    replicas: int = 1
    """Number of DP replicas in the world (each has its own groups of the same shape)."""
    node_of: tuple[int, ...] = ()
    """Every global rank's node (ranks with the same number share a host and its memory),
    ``strategies.core.groups.node_indices``; empty: unknown, taken as one node."""

    def __post_init__(self) -> None:
        self.cpu_tp_cp_group = self.cpu_tp_cp_group or self.tp_cp_group
        self.cpu_pp_group = self.cpu_pp_group or self.pp_group
        self.cpu_replica_group = self.cpu_replica_group or self.replica_group

    @property
    def leader(self) -> int:
        return self.replica_ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def tp_cp_size(self) -> int:
        return len(self.tp_cp_ranks)

    @property
    def replica_nodes(self) -> tuple[tuple[int, ...], ...]:
        """This rank's replica split by node (``groups.node_split``): one tuple per node, the
        leader's node first; each tuple's first rank is that node's leader."""
        return node_split(self.replica_ranks, self.node_of)

    @property
    def node_local_ranks(self) -> tuple[int, ...]:
        """The ranks of this rank's replica on this rank's node (in replica order)."""
        return next(n for n in self.replica_nodes if self.rank in n)

    @property
    def node_leaders(self) -> tuple[int, ...]:
        """One rank per node of this rank's replica, the replica leader first."""
        return tuple(n[0] for n in self.replica_nodes)

    def seed_hops(self) -> list[Hop]:
        """The hops this rank takes part in, in the seed's order: TP×CP if it is on pipeline
        stage 0 and tp·cp > 1, then PP if pp > 1 (``Layout.seed_hop_groups`` for a plan)."""
        hops = []
        if self.pp_rank == 0 and self.tp_cp_size > 1:
            hops.append(Hop(self.tp_cp_group, self.cpu_tp_cp_group, self.tp_cp_ranks))
        if self.pp_size > 1:
            hops.append(Hop(self.pp_group, self.cpu_pp_group, self.pp_ranks))
        return hops

    @property
    def pp_size(self) -> int:
        return len(self.pp_ranks)

    @classmethod
    def from_megatron(
        cls, order: str | None = None, device: torch.device | None = None, node: str | None = None
    ):
        """Build from an initialized ``megatron.core.parallel_state``; every rank must call it
        (it gathers each rank's groups over the world and creates the replica groups).
        ``node`` names this rank's host (None: ``groups.node_key`` from the launcher's
        environment); it travels in the same gather, so which ranks share a node costs no
        collective of its own.

        The replica group (all tp·cp·pp ranks of a DP replica; megatron-core builds none) is
        derived from megatron-core's own TP×CP and PP groups and checked against its DP,
        DP×CP, CP, TP and model-parallel groups (``strategies.core.groups``); any mismatch
        raises ``GroupMismatch`` on every rank, naming the ranks, before a strategy exists.
        ``order`` is optional: when given, the groups it implies are compared as well.
        """
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron.core.parallel_state is not initialized; call "
                "initialize_model_parallel(...) first"
            )
        rank = dist.get_rank()
        views: list = [None] * dist.get_world_size()
        dist.all_gather_object(
            views, replace(_megatron_view(parallel_state, rank), node=node or node_key())
        )
        replicas = derive_replicas(views)
        if order is not None:
            _check_against_order(order, views, replicas)
        backend = dist.get_backend()
        replica_group, cpu_replica = _new_groups(replicas.values(), rank, backend, twin=True)
        tp_cp_group = parallel_state.get_tensor_and_context_parallel_group()
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        cpu_tp_cp = cpu_pp = None
        if backend != "gloo":
            cpu_tp_cp = _new_groups((v.tp_cp for v in views), rank, "gloo")[0]
            cpu_pp = _new_groups((v.pp for v in views), rank, "gloo")[0]
        device = _device_of(backend) if device is None else device
        mine = views[rank]
        return cls(
            tp_cp_group=tp_cp_group,
            pp_group=pp_group,
            replica_group=replica_group,
            tp_cp_ranks=mine.tp_cp,
            pp_ranks=mine.pp,
            replica_ranks=replicas[rank],
            pp_rank=mine.pp.index(rank),
            tp_cp_rank=mine.tp_cp.index(rank),
            device=device,
            cpu_tp_cp_group=cpu_tp_cp,
            cpu_pp_group=cpu_pp,
            cpu_replica_group=cpu_replica,
            rank=rank,
            replicas=len(set(replicas.values())),
            node_of=node_indices([v.node for v in views]),
        )


def _device_of(backend: str) -> torch.device:
    """Where a backend's received tensors live by default: this rank's GPU on NCCL."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )


def _megatron_view(parallel_state, rank: int) -> MegatronView:
    """This rank's groups as megatron-core built them (global ranks, group-rank order)."""

    def ranks(group) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group))

    return MegatronView(
        rank=rank,
        tp=ranks(parallel_state.get_tensor_model_parallel_group()),
        cp=ranks(parallel_state.get_context_parallel_group()),
        tp_cp=ranks(parallel_state.get_tensor_and_context_parallel_group()),
        pp=ranks(parallel_state.get_pipeline_model_parallel_group()),
        dp=ranks(parallel_state.get_data_parallel_group(with_context_parallel=False)),
        dp_cp=ranks(parallel_state.get_data_parallel_group(with_context_parallel=True)),
        mp=ranks(parallel_state.get_model_parallel_group()),
    )


def _check_against_order(order: str, views, replicas) -> None:

    v = views[0]
    cp = len(v.cp)
    layout = Layout(dp=len(v.dp), pp=len(v.pp), tp=len(v.tp), cp=cp, order=order)
    groups = {axes: layout.groups(axes) for axes in ("tp-cp", "pp", "dp", "tp-cp-pp")}
    check_order(groups, views, replicas, order)


def _new_groups(rank_lists, rank: int, backend: str, twin: bool = False):
    """One group per distinct rank list, created in the same order on every rank (group
    creation is collective); returns this rank's group and, with ``twin``, its gloo twin
    (the same group on gloo)."""
    mine = mine_cpu = None
    for ranks in sorted(set(tuple(sorted(r)) for r in rank_lists)):
        group = dist.new_group(list(ranks), backend="gloo" if backend == "gloo" else None)
        cpu = group
        if twin and backend != "gloo":
            cpu = dist.new_group(list(ranks), backend="gloo")
        if rank in ranks:
            mine, mine_cpu = group, cpu
    return mine, mine_cpu


class Strategy:
    """One way to run ``get_data_input``. Subclasses set ``name`` and implement ``transfer``.

    A strategy is built once per layout with its groups and options, then called on every
    rank of the world with the entry state; it returns the exit state (docs/writing-a-strategy.md).

    ``get_data_input`` is this class's and no subclass replaces it: it holds the contract for
    every strategy, a user's included. On the leader it refuses, before any collective, every
    leaf kind no strategy can carry (``contract.validate``) and whatever the strategy's
    ``check`` refuses; a failure there, or in the strategy's own leader work before its first
    collective (encoding, pickling), travels as a failure batch through the strategy's own
    ``transfer``, and every receiver raises ``LeaderFailed`` naming the leader's rank and
    error. A failure after the leader's first collective went out is finished by replaying
    its send path with the collectives already posted answered locally
    (``strategies.core.completion``): every collective the receivers wait for goes out with
    the batch's bytes, then the leader raises. Either way no rank waits, and the next call on
    the same instance starts from a state every rank agrees on.

    What ``transfer`` must keep to for that: it posts collectives only on ``self.groups``'
    groups (those are the ones counted), and its leader does nothing that can fail after its
    first collective (a replay repeats a failure of its own code and cannot finish it).

    A subclass written against the older interface (its own ``get_data_input``) has that
    method taken as its ``transfer``, so it gets the same protocol.
    """

    name: ClassVar[str] = ""
    selectable: ClassVar[bool] = True
    """False for the floor, which is a measured limit rather than a way to ship data."""
    claims: ClassVar[str] = ""
    """Collectives per call, in words (checked by the tests that count them)."""
    raw_bytes: ClassVar[bool] = False
    """True for a strategy that moves bytes ``prepare`` packed rather than the batch it is
    handed (the floor): ``get_data_input`` runs its ``transfer`` as it is."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("get_data_input")
        if own is None or own is Strategy.get_data_input:
            return
        if "transfer" in cls.__dict__:
            raise TypeError(
                f"{cls.__qualname__} defines both get_data_input and transfer; define transfer "
                "only (Strategy.get_data_input runs it and holds the contract)"
            )
        cls.transfer = own  # the older interface: its body is the hook
        cls.get_data_input = Strategy.get_data_input

    def __init__(self, groups: ProcessGroups, **options: Any) -> None:
        self.groups = groups
        if options:
            raise TypeError(
                f"strategy {self.name!r} takes no options {sorted(options)}; "
                "see its module docstring for the options it has"
            )

    def prepare(self, batch: DataProto) -> None:
        """Untimed set-up before a run of calls (the floor packs its buffer here)."""

    def check(self, batch) -> None:
        """Leader, before any collective: raise for anything this strategy cannot carry that
        the contract allows (a dtype, a jagged leaf, a shape). The batch has passed
        ``contract.validate`` already; what this raises reaches every rank."""

    def transfer(self, batch) -> DataProto:
        """The collectives of one call, on every rank of the replica: the leader sends what it
        holds (or a failure batch, which it sends like any other); a receiver returns the
        object it was handed with what arrived set on it. Leader-side work that can fail
        belongs before the first collective."""
        raise NotImplementedError(f"strategy {self.name!r} implements no transfer")

    def get_data_input(self, batch: DataProto) -> DataProto:
        """ROLL's call, on every rank of the world (see the class docstring)."""
        g = self.groups
        if self.raw_bytes:
            return self.transfer(batch)
        if g.replica_ranks == (g.rank,):
            return batch  # a replica of one: nothing to send
        if not g.is_leader:
            out = self.transfer(batch)
            text = failure_in(out)
            if text is not None:
                raise settled(leader_failed(g, text))
            return out
        try:
            sending = self.leader_view(batch)
        except Exception as exc:  # noqa: BLE001 -- any type: it travels to the receivers
            self._ship(batch, exc)
            raise
        watched = self._watched_groups()
        before = marks(watched)
        try:
            self.transfer(sending)
        except Exception as exc:  # noqa: BLE001 -- see below: finished, then raised
            if is_settled(exc):
                raise
            posted = posted_since(watched, before)
            if posted == {}:  # nothing went out: the failure can still take the batch's place
                self._ship(batch, exc)
            elif posted is not None:
                self._finish(sending, posted, exc)
            settled(exc)
            raise
        return batch

    def leader_view(self, batch):
        """Leader, before any collective: validate ``batch`` (every leaf kind), run ``check``
        and return what ``transfer`` sends (``batch``, or a copy with lazy views resolved). A
        strategy overrides it only to do the same work faster (``PackedStrategy`` caches it
        per batch structure)."""
        lazy: list = []
        validate(batch, self.groups.rank, self.groups.device, lazy=lazy)
        self.check(batch)
        return resolve_lazy_views(batch, lazy)

    def _ship(self, batch, exc: Exception) -> None:
        """Leader: send a failure batch for ``exc`` through ``transfer`` and mark ``exc``
        settled (the caller raises it)."""
        g = self.groups
        sent = failure_batch(failure_text(exc), wants_non_tensor(batch), g.device)
        try:
            self.transfer(sent)
        except Exception as ship_exc:  # noqa: BLE001 -- reported with the leader's own error
            exc.add_note(
                f"rank {g.rank}: shipping this failure to the replica failed too, so its "
                f"receivers may still wait: {failure_text(ship_exc)}"
            )
        settled(exc)

    def _finish(self, sending, posted: dict[int, int], exc: Exception) -> None:
        """Leader: post every collective of this call that had not gone out when ``exc``
        was raised, with the batch's bytes (``completion.Replay``)."""
        try:
            with Replay(posted):
                self.transfer(sending)
        except Exception as replay_exc:  # noqa: BLE001 -- reported with the leader's own error
            exc.add_note(
                f"rank {self.groups.rank}: finishing the collectives announced before this "
                f"failure failed too, so receivers may still wait: {failure_text(replay_exc)}"
            )

    def _watched_groups(self) -> tuple:
        watched = self.__dict__.get("_watched")
        if watched is None:
            g = self.groups
            watched = distinct_groups(
                (
                    g.tp_cp_group,
                    g.pp_group,
                    g.replica_group,
                    g.cpu_tp_cp_group,
                    g.cpu_pp_group,
                    g.cpu_replica_group,
                )
            )
            self.__dict__["_watched"] = watched
        return watched

    @classmethod
    def plan(cls, layout, spec):
        """The collectives and local work of one call, for every replica (strategies.core.plan)."""
        raise NotImplementedError(f"strategy {cls.name!r} states no plan")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.groups.rank})"
