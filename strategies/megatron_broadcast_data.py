"""``megatron_broadcast_data``: Megatron-LM's ``tensor_parallel/data.py::broadcast_data``, applied
over the seed's two hops (TP×CP on stage 0, then PP).

Kept on purpose (the original's algorithm and its flaws):

- a fixed int64 header of 5 slots per key holding the shape, where a 0 ends a shape: a tensor
  with a zero-size dim cannot be described, and neither can one with 5 or more dims (the
  original asserts ``dim() < 5``, since a fifth dim would leave no terminating 0). Both are
  refused with a ``ContractError`` naming the key and the leader's rank, raised on EVERY rank
  of the replica (see below), never a hang;
- the header is broadcast on the device group and copied to the host (a sync on CUDA) before
  any buffer is sized;
- ONE flat buffer per dtype: ``torch.cat`` of that dtype's tensors (``.contiguous().view(-1)``;
  views contribute only their own elements), one broadcast per dtype; receivers
  ``narrow().view()`` it, so results are views of the per-dtype buffers.

Adapted to fit the ``get_data_input`` contract:

- Megatron's callers pass the key list and one dtype per call; here receivers know neither, so
  a small table (keys, dtype per key, batch_size) is pickled with ``broadcast_object_list`` over
  the hop's gloo twin group first. What the header cannot describe (zero-size dim, ndim >= 5)
  is refused by the leader before that (``refuse``), and a refusal, a broken DataProto or any
  exception reaches every rank as a failure batch (``strategies.Strategy.get_data_input``);
  a table that cannot be pickled travels as a ``ShippedFailure`` in its place;
- one header for all keys instead of one per dtype call (the original's callers pay one header
  per dtype); dtype buffers go in order of each dtype's first key;
- ``non_tensor_batch``, when ``meta_info['_broadcast_non_tensor_batch']`` is set, rides pickled
  inside that table (Megatron has no non-tensor data);
- nested TensorDict keys travel as key tuples in the table and are rebuilt (the original takes
  flat string keys);
- a jagged NestedTensor or a NonTensorData/NonTensorStack leaf has no place in that header:
  the leader refuses it, so every rank raises naming the key;
- the original hard-codes CUDA and TP only; here the device is ``groups.device`` (gloo/CPU or
  NCCL/CUDA) and the call runs per hop. Stage-0 ranks forward the table, header and flat buffers
  they received unchanged on the PP hop (no second ``torch.cat``).

Per hop: 2 collectives for the table (sizes, pickle) + 1 header + 1 per dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from strategies.core.contract import (
    ContractError,
    DataProto,
    ShippedFailure,
    _key_name,
    broadcast_objects,
    deliver,
    raise_failure,
    wants_non_tensor,
)
from strategies.core.contract import leaves as all_leaves
from strategies.core.footprint import Footprint
from strategies.core.parts import transportable
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan
from strategies.core.refusals import refuse_not_dense
from strategies.core.strategy_base import Strategy
from strategies.core.trace import WORK

MAX_DATA_DIM = 5
"""Header slots per key (Megatron's ``_MAX_DATA_DIM``); a shape must leave room for its 0."""


class _Message:
    """What one hop moves: the pickled table, the int64 header, one flat buffer per dtype."""

    def __init__(
        self,
        table: dict,
        header: torch.Tensor | None,
        flats: list[torch.Tensor],
        sizes_cpu: torch.Tensor | None = None,
        failure: Exception | None = None,
    ):
        self.table = table
        self.header = header
        self.flats = flats
        self.sizes_cpu = sizes_cpu
        self.failure = failure  # the leader's own exception, re-raised after the last hop


def _key_tuple(key) -> tuple[str, ...]:
    return key if isinstance(key, tuple) else (key,)


def _check_leaf(key, t: torch.Tensor, rank: int) -> None:
    if t.dim() >= MAX_DATA_DIM:
        raise ContractError(
            f"rank {rank}: batch[{key!r}] has {t.dim()} dims {list(t.shape)}; megatron "
            f"broadcast_data's header holds at most {MAX_DATA_DIM - 1} dims per key "
            f"({MAX_DATA_DIM} slots, the last one ending the shape)"
        )
    if 0 in t.shape:
        raise ContractError(
            f"rank {rank}: batch[{key!r}] has shape {list(t.shape)} with a zero-size dim; "
            "megatron broadcast_data's header ends a shape at its first 0, so it cannot carry "
            "zero-size dims (use another strategy for empty tensors)"
        )


def refuse(batch: DataProto, rank: int) -> None:
    """Leader, before any collective: what broadcast_data's header cannot describe (a leaf
    that is not dense, five or more dims, a zero-size dim) raises ContractError naming the key,
    which reaches every rank of the replica."""
    why = (
        "megatron broadcast_data carries dense tensors only (its header holds one dense shape "
        "per key)"
    )
    for key, value in all_leaves(batch.batch):
        refuse_not_dense(key, value, rank, why)
        _check_leaf(_key_name(key), value, rank)


def build_message(batch: DataProto) -> _Message:
    """Leader: table + header + per-dtype flat buffers of a batch ``refuse`` passed."""
    leaves = list(batch.batch.items(include_nested=True, leaves_only=True))
    keys = [_key_tuple(k) for k, _ in leaves]
    dtypes = [t.dtype for _, t in leaves]
    sizes = [0] * (MAX_DATA_DIM * len(leaves))
    for i, (_, t) in enumerate(leaves):
        sizes[i * MAX_DATA_DIM : i * MAX_DATA_DIM + t.dim()] = list(t.shape)
    device = leaves[0][1].device if leaves else torch.device("cpu")
    header = torch.tensor(sizes, dtype=torch.int64, device=device)
    flats = []
    for dtype in dict.fromkeys(dtypes):
        parts = []
        for _, t in leaves:
            if t.dtype == dtype:
                if not t.is_contiguous():
                    WORK["copied_bytes"] += t.numel() * t.element_size()
                parts.append(t.contiguous().view(-1))
        flat = torch.cat(parts, dim=0)
        WORK["packed_bytes"] += flat.numel() * flat.element_size()
        flats.append(flat)
    table = {
        "error": None,
        "batch_size": list(batch.batch.batch_size),
        "keys": keys,
        "dtypes": dtypes,
        "non_tensor": batch.non_tensor_batch if wants_non_tensor(batch) else None,
    }
    return _Message(table, header, flats)


def broadcast_message(
    msg: _Message | None, src: int, group, cpu_group, device: torch.device
) -> _Message:
    """One hop: every rank of ``group`` ends with the message of ``src`` (a global rank)."""
    box = [msg.table if msg is not None else None]
    unpicklable = broadcast_objects(box, src, cpu_group)
    table = box[0]
    if isinstance(table, ShippedFailure):  # the source could not pickle its table
        return _Message({"error": table.text}, None, [], failure=unpicklable)
    if table["error"] is not None:  # raised after the last hop, so no rank is left waiting
        return _Message(table, None, [])
    if msg is not None:
        if msg.header.numel():
            dist.broadcast(msg.header, src=src, group=group)
        for flat in msg.flats:
            dist.broadcast(transportable(flat), src=src, group=group)
        return msg
    n_keys = len(table["keys"])
    header = torch.empty(MAX_DATA_DIM * n_keys, dtype=torch.int64, device=device)
    if n_keys:
        dist.broadcast(header, src=src, group=group)
    sizes_cpu = header.cpu()  # the original's host copy: a sync on CUDA
    numel: dict[torch.dtype, int] = {}
    for i, dtype in enumerate(table["dtypes"]):
        numel[dtype] = numel.get(dtype, 0) + _numel(_shape(sizes_cpu, i))
    flats = []
    for dtype, n in numel.items():
        flat = torch.empty(n, dtype=dtype, device=device)
        dist.broadcast(transportable(flat), src=src, group=group)
        flats.append(flat)
    return _Message(table, header, flats, sizes_cpu)


def _shape(sizes_cpu: torch.Tensor, i: int) -> list[int]:
    shape = []
    for s in sizes_cpu[i * MAX_DATA_DIM : (i + 1) * MAX_DATA_DIM].tolist():
        if s == 0:
            break
        shape.append(s)
    return shape


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def unflatten(msg: _Message) -> tuple[TensorDict, dict | None]:
    """Receivers: views of the per-dtype buffers, nested keys rebuilt."""
    sizes_cpu = msg.sizes_cpu if msg.sizes_cpu is not None else msg.header.cpu()
    by_dtype = dict(zip(dict.fromkeys(msg.table["dtypes"]), msg.flats))
    offsets = dict.fromkeys(by_dtype, 0)
    nested: dict = {}
    for i, (key, dtype) in enumerate(zip(msg.table["keys"], msg.table["dtypes"])):
        shape = _shape(sizes_cpu, i)
        n = _numel(shape)
        value = by_dtype[dtype].narrow(0, offsets[dtype], n).view(shape)
        offsets[dtype] += n
        node = nested
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return TensorDict(nested, batch_size=msg.table["batch_size"]), msg.table["non_tensor"]


class MegatronBroadcastData(Strategy):
    name = "megatron_broadcast_data"
    footprint = Footprint(leader=1.15, receiver=1.05, leader_kept=0.45)
    """Measured by the node memory phase (one buffer per dtype on each side)."""
    claims = (
        "per hop: 2 (pickled key/dtype table) + 1 int64 header + 1 per dtype; hops: TP×CP on "
        "stage 0 if tp·cp>1, then PP if pp>1"
    )

    def check(self, batch: DataProto) -> None:
        refuse(batch, self.groups.rank)

    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        msg = build_message(batch) if g.is_leader else None
        failure = None
        for hop in g.seed_hops():
            msg = broadcast_message(msg, hop.ranks[0], hop.group, hop.cpu_group, g.device)
            failure = failure or msg.failure
        if msg.table["error"] is not None:
            raise_failure(g, msg.table["error"], failure)
        if not g.is_leader:
            td, non_tensor = unflatten(msg)
            deliver(batch, td, non_tensor)
        return batch

    @classmethod
    def plan(cls, layout, spec: PayloadSpec) -> Plan:
        """``spec.dtype_bytes`` must list the bytes per dtype in order of each dtype's first
        leaf; without it the data is planned as one buffer (``exact=False``)."""
        nt = spec.sent_non_tensor_bytes
        buffers = [(b, True) for b in spec.dtype_bytes]
        if not buffers and spec.tensor_bytes:
            buffers = [(spec.tensor_bytes, False)]
        comms: list[Comm] = []
        step = 0
        for groups in layout.seed_hop_groups():
            what = [
                (8, "sizes", True),
                (nt, "pickle", False),  # table (+ non_tensor_batch): size not predicted
            ]
            if spec.n_tensors:
                what.append((8 * MAX_DATA_DIM * spec.n_tensors, "header", True))
            what += [(b, "payload", exact) for b, exact in buffers]
            for nbytes, kind, exact in what:
                for ranks in groups:
                    comms.append(
                        Comm("broadcast", tuple(ranks), ranks[0], nbytes, step, kind, exact)
                    )
                step += 1
        return Plan(
            cls.name,
            comms,
            leader=LocalWork(packed_bytes=spec.tensor_bytes, pickled_bytes=nt),
            receiver=LocalWork(pickled_bytes=nt),
            forwarder=LocalWork(pickled_bytes=2 * nt),
        )


STRATEGY = MegatronBroadcastData
