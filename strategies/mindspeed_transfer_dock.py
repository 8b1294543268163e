"""``mindspeed_transfer_dock``: MindSpeed-RL's hand-off after its TransferDock read: the rows'
index, then per key four int64 metadata tensors, the data and the row lengths, each broadcast
over the TP group and then the PP group, by every rank of the world.

Followed: Ascend/MindSpeed-RL at tag v2.3.0 (commit 4b30d034e4fb6abc5ce844a667491e8a3cc4909c;
master of 2026-04-22, 05a90d77, has the same sequence with its comments translated),
``mindspeed_rl/workers/base_worker.py``:

- ``dispatch_transfer_dock_data``: the rank with tp = cp = pp = 0 reads ``(batch_data, index)``
  from the TransferDock actor (``ray.get(td.get_experience.remote(...))``, CPU tensors) and packs
  each column (``pack_experience_columns`` in ``mindspeed_rl/trainer/utils/transfer_dock.py``:
  the rows end to end, an int32 length per row). Every rank then broadcasts the int64 index
  (``experience_count`` rows) over its TP group, then CP, then PP, each from that group's first
  rank; the receivers' ``experience_columns`` and ``experience_count`` come from their caller.
- ``broadcast_data_hccl``, for each key in ``experience_columns`` order: four int64 tensors,
  the shape (receivers post 2 slots, "at most 2-D"), a dtype code (1 for int32, 2 for anything
  else, which receivers allocate as float32), the lengths' shape and ndim, each broadcast on
  TP, then the four on CP, then on PP; receivers allocate; then the data on TP, CP, PP; then
  the lengths on TP, CP, PP. Every rank of the world takes part in every step, the TP groups
  of later stages too: their sources hold nothing yet, and what they send is overwritten by
  the PP step. Those broadcasts are reproduced: they are traffic MindSpeed pays.

Not reproduced: the TransferDock actor, its Ray read, the packing and the receivers' unpacking
and padding (``unpack_pad_experience``): the leader's batch stands for the read, each leaf for
its packed column (a dense leaf holds its rows end to end already), with one length per row
(the row's element count), and the index is rows 0..B-1. Nor the "dock is empty" return
(``index[0] == -1``; its read of ``index[0]``, a host sync, is kept), the multimodal columns'
second pass, or the ZMQ dispatch path.

Adapted to the ``get_data_input`` contract:

- MindSpeed's TP step and CP step run as one step over the TP×CP group (the groups a strategy
  receives hold no CP-only group; with cp = 1 MindSpeed's CP group is one rank and moves
  nothing); a step over a group of one rank (tp·cp = 1, pp = 1) is not posted;
- receivers know neither the keys nor B, so a table (keys, batch_size, shape slots, and
  ``non_tensor_batch`` when ``meta_info['_broadcast_non_tensor_batch']`` is set) goes first,
  pickled with ``broadcast_object_list`` over the replica's gloo twin; a table the leader
  cannot pickle travels as a ``ShippedFailure``, so every rank raises;
- dtype codes: MindSpeed's 1 (int32) and 2 (float32) are kept, every other dtype gets a code of
  its own (MindSpeed would allocate it as float32, of the wrong size); a dtype gloo refuses
  travels as its bytes (``strategies.core.parts.transportable``) on every side;
- shape slots: MindSpeed's receivers post 2 while its leader sends ndim (a count mismatch for a
  1-D column); here every rank posts the table's slots, max(2, the widest leaf's ndim), and
  the leader pads its shape with zeros;
- dense strided tensors only: a NonTensorData/NonTensorStack leaf or a jagged NestedTensor is
  refused by the leader naming the key, and every rank raises;
- MindSpeed's leader calls ``.cuda()`` on its CPU column at every hop, a fresh H2D copy each;
  here a leaf off ``groups.device`` is copied there once, with any non-contiguous leaf made
  contiguous, before the first collective (nothing the leader can fail on comes after it).

Per call: 2 (table) + per hop (TP×CP if tp·cp > 1, on every stage; PP if pp > 1): 1 index
+ 6 per key (shape, dtype, lengths' shape, ndim, data, lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from strategies.core.contract import broadcast_or_raise, deliver, leaves, wants_non_tensor
from strategies.core.footprint import Footprint
from strategies.core.parts import leaf_on_device, transportable
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan
from strategies.core.refusals import refuse_not_dense
from strategies.core.strategy_base import Strategy

MIN_SHAPE_SLOTS = 2
"""MindSpeed's receivers post two shape slots ("at most 2-D")."""
_BY_NAME = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
DTYPES = (torch.int32, torch.float32) + tuple(
    _BY_NAME[n] for n in sorted(_BY_NAME) if _BY_NAME[n] not in (torch.int32, torch.float32)
)
"""Dtype by code - 1: int32 and 2: float32 as MindSpeed numbers them, then every other dtype
this torch has, by name (the same order on every rank of one installation)."""
CODE_OF = {dtype: i + 1 for i, dtype in enumerate(DTYPES)}
DENSE_ONLY = (
    "MindSpeed-RL's per-key broadcast carries dense tensors only (a shape, a dtype code and the "
    "data per key)"
)
"""Why a non-tensor or jagged leaf is refused (``refuse_not_dense``)."""


@dataclass
class _Column:
    """One key on one rank: the four metadata tensors, then (once allocated) data and lengths."""

    shape: torch.Tensor
    code: torch.Tensor
    lengths_shape: torch.Tensor
    ndim: torch.Tensor
    data: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    @property
    def metadata(self) -> tuple[torch.Tensor, ...]:
        return self.shape, self.code, self.lengths_shape, self.ndim


def _int64(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _leader_column(t: torch.Tensor, rows: int, slots: int, device: torch.device) -> _Column:
    """The leader's column for one leaf: metadata, data on the device, one length per row."""
    t = leaf_on_device(t, device)  # once, where MindSpeed's .cuda() copies at every hop
    shape = list(t.shape) + [0] * (slots - t.dim())
    per_row = t.numel() // rows if rows else 0
    lengths = torch.full((rows,), per_row, dtype=torch.int32, device=device)
    return _Column(
        _int64(shape, device),
        _int64([CODE_OF[t.dtype]], device),
        _int64([rows], device),
        _int64([t.dim()], device),
        t,
        lengths,
    )


def _empty_column(slots: int, device: torch.device) -> _Column:
    # Zeros, not empty: a later stage's TP source sends these before its PP step fills them.
    z = torch.zeros
    return _Column(
        z(slots, dtype=torch.int64, device=device),
        z(1, dtype=torch.int64, device=device),
        z(1, dtype=torch.int64, device=device),
        z(1, dtype=torch.int64, device=device),
    )


def _allocate(column: _Column, device: torch.device) -> None:
    """A receiver, after every hop's metadata: its data and lengths buffers (a host sync)."""
    ndim = int(column.ndim.item())
    shape = column.shape.tolist()[:ndim]
    dtype = DTYPES[int(column.code.item()) - 1]
    column.data = torch.empty(shape, dtype=dtype, device=device)
    column.lengths = torch.empty(int(column.lengths_shape.item()), dtype=torch.int32, device=device)


def _hops(g) -> list[tuple]:
    """(group, source) of each hop this rank takes, in MindSpeed's order: TP(×CP), then PP."""
    hops = []
    if g.tp_cp_size > 1:
        hops.append((g.tp_cp_group, g.tp_cp_ranks[0]))
    if g.pp_size > 1:
        hops.append((g.pp_group, g.pp_ranks[0]))
    return hops


def _broadcast_all(t: torch.Tensor, hops: list[tuple]) -> None:
    for group, src in hops:
        dist.broadcast(transportable(t), src=src, group=group)


def _rebuild(keys: list, columns: list[_Column], batch_size: list[int]) -> TensorDict:
    nested: dict = {}
    for key, column in zip(keys, columns):
        node = nested
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = column.data
    return TensorDict(nested, batch_size=batch_size)


class MindspeedTransferDock(Strategy):
    name = "mindspeed_transfer_dock"
    footprint = Footprint(leader=0, receiver=1.05)
    """Estimated as ``nemo_rl_leader_broadcast``'s (per-key broadcasts from the leader's own
    tensors, receivers allocate each); the node memory phase measures it."""
    claims = (
        "2 (pickled table over the replica) + per hop (TP×CP on every stage if tp·cp>1, then PP "
        "if pp>1): 1 index + 6 per key (shape, dtype, lengths' shape, ndim, data, lengths)"
    )

    def check(self, batch) -> None:
        """Leader, before any collective: what MindSpeed's per-key broadcast cannot carry (a
        non-tensor leaf, a jagged tensor) raises ContractError naming the key on every rank."""
        for key, value in leaves(batch.batch):
            refuse_not_dense(key, value, self.groups.rank, DENSE_ONLY)

    def transfer(self, batch):
        g = self.groups
        device = g.device
        if g.rank == g.leader:
            keys = [key for key, _ in leaves(batch.batch)]
            rows = int(batch.batch.batch_size[0])
            slots = max([MIN_SHAPE_SLOTS] + [t.dim() for _, t in leaves(batch.batch)])
            columns = [_leader_column(t, rows, slots, device) for _, t in leaves(batch.batch)]
            index = torch.arange(rows, dtype=torch.int64, device=device)
            nt = batch.non_tensor_batch if wants_non_tensor(batch) else None
            size = list(batch.batch.batch_size)
            table = {"keys": keys, "batch_size": size, "slots": slots, "non_tensor": nt}
        else:
            table = None
        table = broadcast_or_raise(table, g, g.cpu_replica_group)
        if g.rank != g.leader:
            rows = int(table["batch_size"][0])
            columns = [_empty_column(table["slots"], device) for _ in table["keys"]]
            index = torch.empty(rows, dtype=torch.int64, device=device)
        self._exchange(index, columns, _hops(g), g.rank == g.leader)
        if g.rank == g.leader:
            return batch
        td = _rebuild(table["keys"], columns, table["batch_size"])
        return deliver(batch, td, table["non_tensor"])

    @staticmethod
    def _exchange(index, columns: list[_Column], hops: list[tuple], is_leader: bool) -> None:
        """Every rank of the world: the index, then per key its metadata on every hop, its
        buffers allocated, its data on every hop, its lengths on every hop."""
        _broadcast_all(index, hops)
        if index.numel():  # MindSpeed's "dock empty" test (index[0] == -1): a host sync
            int(index[0].item())
        for column in columns:
            for group, src in hops:
                for t in column.metadata:
                    dist.broadcast(t, src=src, group=group)
            if not is_leader:
                _allocate(column, index.device)
            _broadcast_all(column.data, hops)
            _broadcast_all(column.lengths, hops)

    @classmethod
    def plan(
        cls,
        layout,
        spec: PayloadSpec,
        leaf_bytes: tuple[int, ...] | None = None,
        batch_size: int | None = None,
        shape_slots: int | None = None,
    ) -> Plan:
        """``leaf_bytes``: bytes of each tensor leaf in TensorDict order
        (``PayloadSpec.leaf_nbytes``); ``batch_size`` (B: the index and each key's lengths) and
        ``shape_slots`` (max(2, the widest leaf's ndim)) are not in a PayloadSpec: without
        them those sizes are planned for B = 1 and 2 slots (inexact). The table's pickle is
        not predicted (inexact)."""
        sizes, exact = spec.leaf_nbytes(leaf_bytes)
        rows = 1 if batch_size is None else batch_size
        slots = MIN_SHAPE_SLOTS if shape_slots is None else shape_slots
        nt = spec.sent_non_tensor_bytes
        if layout.replica_size == 1:
            return Plan(cls.name, [])
        steps = [([(8, "sizes", True)], layout.replica_groups())]
        steps.append(([(nt, "pickle", False)], layout.replica_groups()))
        hops = []
        if layout.tp_cp > 1:
            hops.append(layout.groups("tp-cp"))
        if layout.pp > 1:
            hops.append(layout.groups("pp"))
        metadata = [(8 * slots, "header", shape_slots is not None)] + [(8, "header", True)] * 3
        lengths = (4 * rows, "header", batch_size is not None)
        steps += [([(8 * rows, "header", batch_size is not None)], groups) for groups in hops]
        for nbytes in sizes:
            steps += [(metadata, groups) for groups in hops]
            steps += [([(nbytes, "leaf", exact)], groups) for groups in hops]
            steps += [([lengths], groups) for groups in hops]
        comms: list[Comm] = []
        step = 0
        for what, groups in steps:
            for nbytes, kind, ok in what:
                for ranks in groups:
                    comms.append(Comm("broadcast", tuple(ranks), ranks[0], nbytes, step, kind, ok))
                step += 1
        work = LocalWork(pickled_bytes=nt)
        return Plan(cls.name, comms, leader=work, receiver=work, forwarder=LocalWork())


STRATEGY = MindspeedTransferDock
