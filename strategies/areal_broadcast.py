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
    BATCH_SIZE_KEY,
    NON_TENSOR_KEY,
    ContractError,
    broadcast_or_raise,
    deliver,
    leaves,
    wants_non_tensor,
)
from strategies.core.footprint import Footprint
from strategies.core.parts import leaf_on_device, transportable
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan
from strategies.core.refusals import refuse_jagged
from strategies.core.strategy_base import Strategy

TENSOR_TAG = ("tensor", None)
OBJECT_TAG = ("object", None)


def refuse(batch, rank: int) -> None:
    """Leader, before any collective: a jagged leaf (no dense shape) or a top-level key this
    strategy reserves raises ContractError naming it, which reaches every rank."""
    why = "AReaL's broadcast_tensor describes a tensor by one dense shape and cannot carry it"
    refuse_jagged(batch, rank, why)
    for name in (BATCH_SIZE_KEY, NON_TENSOR_KEY):
        if name in batch.batch.keys():
            raise ContractError(
                f"rank {rank}: batch[{name!r}] is a key areal_broadcast reserves in its "
                "container for the DataProto's own fields; rename it"
            )


def to_container(batch, device: torch.device) -> dict:
    """Leader: the DataProto as the nested dict AReaL walks (a batch ``refuse`` passed). Each
    tensor leaf on the device (AReaL's ``tensor_container_to``) and contiguous
    (``broadcast_tensor``'s own ``.contiguous()``), before the walk's first collective."""
    out: dict = {}
    for key, value in leaves(batch.batch):
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = leaf_on_device(value, device) if isinstance(value, torch.Tensor) else value
    out[BATCH_SIZE_KEY] = tuple(batch.batch.batch_size)
    if wants_non_tensor(batch):
        # Its items as a tuple: one object node (a dict would be walked, a node per array).
        out[NON_TENSOR_KEY] = tuple(batch.non_tensor_batch.items())
    return out


def _send_object(obj, g) -> None:
    # An object the leader cannot pickle goes as a ShippedFailure, and the walk ends there on
    # every rank: the leader raises its own error, each receiver LeaderFailed.
    broadcast_or_raise(obj, g, g.replica_group)


def _receive_object(g) -> Any:
    return broadcast_or_raise(None, g, g.replica_group)


def send_container(value, g) -> None:
    """The leader's walk over ``g.replica_group``: each node's tag, then what the tag
    announces."""
    if isinstance(value, dict):
        _send_object(("dict", list(value.keys())), g)
        for child in value.values():
            send_container(child, g)
    elif isinstance(value, torch.Tensor):
        _send_object(TENSOR_TAG, g)
        meta = {"shape": list(value.shape), "dtype": value.dtype, "device_type": value.device.type}
        _send_object(meta, g)
        dist.broadcast(transportable(value), src=g.leader, group=g.replica_group)
    else:
        _send_object(OBJECT_TAG, g)
        _send_object(value, g)


def receive_container(g):
    """A receiver's walk: each node's tag decides what follows it."""
    kind, info = _receive_object(g)
    if kind == "dict":
        return {key: receive_container(g) for key in info}
    if kind == "tensor":
        meta = _receive_object(g)
        where = torch.device("cpu") if meta["device_type"] == "cpu" else g.device
        t = torch.empty(meta["shape"], dtype=meta["dtype"], device=where)
        dist.broadcast(transportable(t), src=g.leader, group=g.replica_group)
        return t
    if kind == "object":
        return _receive_object(g)
    raise ValueError(f"areal_broadcast: unknown node kind {kind!r} from rank {g.leader}")


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
        if g.is_leader:
            send_container(to_container(batch, g.device), g)
            return batch
        return deliver(batch, *from_container(receive_container(g)))

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
