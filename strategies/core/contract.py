"""The get_data_input contract: DataProto, its validation (every leaf kind carried or refused),
and a leader's failure as it reaches its receivers (the failure batch, settled errors).

The groups a strategy receives are ``strategies.core.process_groups``; the Strategy base class
whose ``get_data_input`` holds this contract for every strategy is
``strategies.core.strategy_base``.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import NonTensorData, NonTensorStack, TensorDict, is_tensor_collection

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


BATCH_SIZE_KEY = "__batch_size__"
"""The entry that carries ``batch.batch_size`` where a strategy sends the DataProto as one dict
of entries, as its source sends a dict (``vllm_tensor_dict``, ``nemo_rl_leader_broadcast``,
``areal_broadcast``)."""
NON_TENSOR_KEY = "__non_tensor_batch__"
"""The entry that carries ``non_tensor_batch`` in such a dict, when the flag sends it."""


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


def follows_its_leader(exc: BaseException) -> bool:
    """Whether ``exc`` is (or was raised from) a ``LeaderFailed``: its rank failed because its
    replica leader did, whose own error is the one a world names."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LeaderFailed):
            return True
        seen.add(id(exc))
        # The chain a traceback prints: the cause, else the context unless ``from None``.
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return False


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


def send_or_failure(obj, group) -> tuple[Exception, ShippedFailure] | None:
    """``broadcast_objects`` from this hop's source (the group's first rank). None once sent; if pickling ``obj`` fails, a
    ShippedFailure goes in its place (receivers raise it) and (the error, that failure) is
    returned, so a rank that sends on later hops sends the failure there too."""
    box = [obj]
    exc = broadcast_objects(box, dist.get_process_group_ranks(group)[0], group)
    return None if exc is None else (exc, box[0])


def raise_failure(groups, text: str, exc: BaseException | None = None):
    """End of a call that carried a failure: the leader re-raises its own exception (or a
    ContractError with ``text``), a receiver raises LeaderFailed naming the leader's error.
    Either is marked settled: every rank already knows, so nothing more is sent for it."""
    if groups.is_leader:
        raise settled(exc if exc is not None else ContractError(text))
    raise settled(leader_failed(groups, text))


def broadcast_or_raise(obj, groups, group):
    """The leader's ``obj`` on every rank of ``group``, by one ``broadcast_objects`` from
    ``groups.leader`` (receivers pass None); returns it. An object the leader cannot pickle
    ends the call on every rank instead, each raising as ``raise_failure`` does."""
    box = [obj]
    unpicklable = broadcast_objects(box, groups.leader, group)
    if isinstance(box[0], ShippedFailure):
        raise_failure(groups, box[0].text, unpicklable)
    return box[0]


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
