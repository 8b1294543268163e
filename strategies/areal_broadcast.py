"""``areal_broadcast``: AReaL's ``broadcast_tensor_container``, applied as AReaL applies it: once
over the whole TP×CP×PP replica, a pair of object broadcasts per container node and one
broadcast per tensor.

Followed: inclusionAI/AReaL at tag v1.0.4 (commit 37d6c6400e99a05fa3409d6a067762a44df40d3b, the
``areal`` 1.0.4 release; master of 2026-05-21 has the same code in the files below):

- ``areal/utils/data.py``, ``broadcast_tensor_container``: a depth-first walk of the container
  in insertion order. Every node first costs one ``broadcast_object_list`` of its (kind, info)
  pair: ``("dict", list of keys)``, ``("list", length)``, ``("tensor", None)``,
  ``("object", None)`` or ``("none", None)``. A tensor then goes through ``broadcast_tensor``
  (same file): a second ``broadcast_object_list`` of ``{"shape", "dtype", "device_type"}``,
  then one ``dist.broadcast`` of the tensor made contiguous; receivers allocate it on the CPU
  when ``device_type`` is "cpu", else on their current device. An object goes as a second
  ``broadcast_object_list`` of itself. Each ``broadcast_object_list`` is two collectives
  (sizes, pickled bytes), so a tensor costs 5, a dict node 2 and an object 4.
- ``areal/engine/megatron_engine.py``, ``_init_context_and_model_parallel_group``: one
  "context and model parallel" group per DP replica (``RankGenerator(...).get_ranks("tp-cp-pp")``)
  on the device backend; ``current_data_parallel_head`` is its first rank.
- the callers (``areal/infra/dist_rollout.py`` ``_broadcast_and_redistribute_trajectories``,
  ``areal/trainer/sft_trainer.py`` ``_load_bcast_from``, the rw and dpo trainers alike) move the
  whole container to the current device (``tensor_container_to``) on the head, then call
  ``broadcast_tensor_container(batch, src_rank=head, group=context_and_model_parallel_group)``:
  one hop over the replica, every collective, the pickles included, on that device group.

Kept on purpose: every node's collectives, each waited on before the next (nothing coalesced:
k tensor leaves cost 5k collectives); the pickles travel on the device group (on NCCL: pickle,
H2D, broadcast, D2H); the leader moves its leaves to the device before the walk.

Not reproduced: the barriers ``dist_rollout`` puts around the call (a device synchronize and a
gloo barrier on each side) and its DP redistribution before it; they are not part of the
hand-off.

Adapted to the ``get_data_input`` contract:

- the DataProto as AReaL's container: one dict node holding the TensorDict's leaves in order (a
  nested TensorDict is a nested dict node, as ``TensorDict.to_dict`` gives), then
  ``__batch_size__`` (a tuple: one object node; a list would cost a node per dim) and, when
  ``meta_info['_broadcast_non_tensor_batch']`` is set, ``__non_tensor_batch__`` as one object
  node (its items as a tuple): the arrays go in one pickle, so a call's collectives depend on
  the leaves alone and ``plan`` can state them (walked as a dict, it would cost a dict node and
  an object node per array). A batch holding either key at its top is refused;
- a NonTensorData/NonTensorStack leaf is an object node (the walk pickles any value that is not
  a tensor, list or dict); a jagged NestedTensor has no dense shape for ``broadcast_tensor``'s
  metadata, so the leader refuses it and every rank raises naming the key;
- the leader makes its leaves contiguous (``broadcast_tensor`` does it per tensor, mid-walk)
  before its first collective, with its move to the device, so nothing it can fail on comes
  after that collective (``strategies.Strategy``); a tensor the backend cannot carry as it is
  (a dtype gloo refuses) goes as its bytes (``strategies.core.parts.transportable``), and
  receivers do the same to their buffers;
- receivers allocate device tensors on their own ``groups.device`` (AReaL: the current device);
- an object the leader cannot pickle travels as a ``ShippedFailure`` in its place: every rank
  ends the walk there and raises it. A failure before the walk travels as a failure batch
  (``strategies.Strategy.get_data_input``).

Per call: 2 (top dict) + 5 per tensor leaf + 2 per nested TensorDict + 4 per non-tensor leaf +
4 (batch size) + 4 when non_tensor_batch travels; none when the replica is one rank.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from strategies.core.contract import (
    ContractError,
    ShippedFailure,
    _key_name,
    broadcast_objects,
    deliver,
    leaves,
    raise_failure,
    wants_non_tensor,
)
from strategies.core.footprint import Footprint
from strategies.core.parts import transportable
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan
from strategies.core.strategy_base import Strategy
from strategies.core.trace import WORK

BATCH_SIZE_KEY = "__batch_size__"
NON_TENSOR_KEY = "__non_tensor_batch__"
TENSOR_TAG = ("tensor", None)
OBJECT_TAG = ("object", None)


class _Shipped(Exception):
    """An object the leader could not pickle went out as a ShippedFailure: the walk ends here
    on every rank (``exc`` is the leader's own error, None on a receiver)."""

    def __init__(self, text: str, exc: Exception | None = None):
        super().__init__(text)
        self.text, self.exc = text, exc


def refuse(batch, rank: int) -> None:
    """Leader, before any collective: a jagged leaf (no dense shape) or a top-level key this
    strategy reserves raises ContractError naming it, which reaches every rank."""
    for key, value in leaves(batch.batch):
        if isinstance(value, torch.Tensor) and value.is_nested:
            raise ContractError(
                f"rank {rank}: batch[{_key_name(key)!r}] is a jagged NestedTensor; AReaL's "
                "broadcast_tensor describes a tensor by one dense shape and cannot carry it; "
                "use header, flat, direct, pp_first or scatter_allgather"
            )
    for name in (BATCH_SIZE_KEY, NON_TENSOR_KEY):
        if name in batch.batch.keys():
            raise ContractError(
                f"rank {rank}: batch[{name!r}] is a key areal_broadcast reserves in its "
                "container for the DataProto's own fields; rename it"
            )


def _ready(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A leaf as the leader sends it: on the device (AReaL's ``tensor_container_to``) and
    contiguous (``broadcast_tensor``'s own ``.contiguous()``)."""
    if t.device != device:
        t = t.to(device)
        WORK["h2d_bytes" if device.type != "cpu" else "d2h_bytes"] += t.nbytes
    if not t.is_contiguous():
        t = t.contiguous()
        WORK["copied_bytes"] += t.nbytes
    return t


def to_container(batch, device: torch.device) -> dict:
    """Leader: the DataProto as the nested dict AReaL walks (a batch ``refuse`` passed)."""
    out: dict = {}
    for key, value in leaves(batch.batch):
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = _ready(value, device) if isinstance(value, torch.Tensor) else value
    out[BATCH_SIZE_KEY] = tuple(batch.batch.batch_size)
    if wants_non_tensor(batch):
        # Its items as a tuple: one object node (a dict would be walked, a node per array).
        out[NON_TENSOR_KEY] = tuple(batch.non_tensor_batch.items())
    return out


def _send_object(obj, src: int, group) -> None:
    box = [obj]
    unpicklable = broadcast_objects(box, src, group)
    if unpicklable is not None:
        raise _Shipped(box[0].text, unpicklable)


def _receive_object(src: int, group) -> Any:
    box = [None]
    broadcast_objects(box, src, group)
    if isinstance(box[0], ShippedFailure):
        raise _Shipped(box[0].text)
    return box[0]


def send_container(value, src: int, group) -> None:
    """The source's walk: each node's tag, then what the tag announces."""
    if isinstance(value, dict):
        _send_object(("dict", list(value.keys())), src, group)
        for child in value.values():
            send_container(child, src, group)
    elif isinstance(value, torch.Tensor):
        _send_object(TENSOR_TAG, src, group)
        meta = {"shape": list(value.shape), "dtype": value.dtype, "device_type": value.device.type}
        _send_object(meta, src, group)
        dist.broadcast(transportable(value), src=src, group=group)
    else:
        _send_object(OBJECT_TAG, src, group)
        _send_object(value, src, group)


def receive_container(src: int, group, device: torch.device):
    """A receiver's walk: each node's tag decides what follows it."""
    kind, info = _receive_object(src, group)
    if kind == "dict":
        return {key: receive_container(src, group, device) for key in info}
    if kind == "tensor":
        meta = _receive_object(src, group)
        where = torch.device("cpu") if meta["device_type"] == "cpu" else device
        t = torch.empty(meta["shape"], dtype=meta["dtype"], device=where)
        dist.broadcast(transportable(t), src=src, group=group)
        return t
    if kind == "object":
        return _receive_object(src, group)
    raise ValueError(f"areal_broadcast: unknown node kind {kind!r} from rank {src}")


def from_container(container: dict) -> tuple[TensorDict, Any]:
    batch_size = container.pop(BATCH_SIZE_KEY)
    items = container.pop(NON_TENSOR_KEY, None)
    non_tensor = dict(items) if items is not None else None
    return TensorDict(container, batch_size=list(batch_size)), non_tensor


def _pickled(obj) -> int:
    # torch's broadcast_object_list pickles each object with pickle.Pickler's defaults.
    return len(pickle.dumps(obj))


def _tree(keys: list[tuple[str, ...]], sizes: list[int]) -> dict:
    """The leaves' bytes nested as the container nests their keys."""
    tree: dict = {}
    for key, nbytes in zip(keys, sizes):
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = nbytes
    return tree


TENSOR_META_BYTES = _pickled({"shape": [0, 0], "dtype": torch.float32, "device_type": "cpu"})
"""A 2-D tensor's ``broadcast_tensor`` metadata pickled: the estimate for every tensor's."""


def _walk_steps(tree: dict, exact: bool, known: bool, extra_keys: tuple = ()) -> list:
    """(nbytes, what, exact) of each collective of a dict node's walk, in order. ``known``:
    whether the keys are the batch's own (the key list's pickle is then exact);
    ``extra_keys``: the top node's entries after the leaves, which the caller walks."""
    keys = [*tree, *extra_keys]
    steps = [(8, "sizes", True), (_pickled(("dict", keys)), "pickle", known)]
    for child in tree.values():
        if isinstance(child, dict):
            steps += _walk_steps(child, exact, known)
            continue
        steps += [(8, "sizes", True), (_pickled(TENSOR_TAG), "pickle", True)]
        steps += [(8, "sizes", True), (TENSOR_META_BYTES, "pickle", False)]
        steps.append((child, "leaf", exact))
    return steps


class ArealBroadcast(Strategy):
    name = "areal_broadcast"
    footprint = Footprint(leader=0, receiver=1.05)
    """Estimated as ``nemo_rl_leader_broadcast``'s (one broadcast per tensor from the leader's
    own tensors, receivers allocate each); the node memory phase measures it."""
    claims = (
        "one hop over the TP×CP×PP replica group: 2 (top dict) + 5 per tensor leaf + 2 per "
        "nested TensorDict + 4 per non-tensor leaf + 4 (batch size), +4 when non_tensor_batch "
        "travels; none when the replica is one rank"
    )

    def check(self, batch) -> None:
        refuse(batch, self.groups.rank)

    def transfer(self, batch):
        g = self.groups
        try:
            if g.is_leader:
                send_container(to_container(batch, g.device), g.leader, g.replica_group)
                return batch
            container = receive_container(g.leader, g.replica_group, g.device)
        except _Shipped as shipped:
            raise_failure(g, shipped.text, shipped.exc)
        return deliver(batch, *from_container(container))

    @classmethod
    def plan(
        cls,
        layout,
        spec: PayloadSpec,
        leaf_bytes: tuple[int, ...] | None = None,
        leaf_keys: tuple[tuple[str, ...], ...] | None = None,
    ) -> Plan:
        """``leaf_bytes``: bytes of each tensor leaf in TensorDict order
        (``PayloadSpec.leaf_nbytes``). ``leaf_keys``: each leaf's key as a tuple, in the same
        order; nested keys add their dict nodes and the key lists' pickles become exact
        (without them the leaves are planned flat). The tensors' metadata and the batch size
        pickle to sizes not predicted (inexact)."""
        sizes, exact = spec.leaf_nbytes(leaf_bytes)
        known = leaf_keys is not None
        keys = list(leaf_keys) if known else [(f"leaf_{i}",) for i in range(len(sizes))]
        extra = (BATCH_SIZE_KEY, NON_TENSOR_KEY) if spec.broadcast_non_tensor else (BATCH_SIZE_KEY,)
        steps = _walk_steps(_tree(keys, sizes), exact, known, extra)
        steps += [(8, "sizes", True), (_pickled(OBJECT_TAG), "pickle", True)]
        steps += [(8, "sizes", True), (_pickled((0,)), "pickle", False)]
        nt = spec.sent_non_tensor_bytes
        if spec.broadcast_non_tensor:
            steps += [(8, "sizes", True), (_pickled(OBJECT_TAG), "pickle", True)]
            steps += [(8, "sizes", True), (nt, "pickle", False)]
        replicas = layout.replica_groups() if layout.replica_size > 1 else []
        comms = [
            Comm("broadcast", tuple(ranks), ranks[0], nbytes, step, what, ok)
            for step, (nbytes, what, ok) in enumerate(steps)
            for ranks in replicas
        ]
        work = LocalWork(pickled_bytes=nt) if replicas else LocalWork()
        return Plan(cls.name, comms, leader=work, receiver=work, forwarder=LocalWork())


STRATEGY = ArealBroadcast
