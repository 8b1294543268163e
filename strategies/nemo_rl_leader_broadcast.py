"""``nemo_rl_leader_broadcast``: NeMo-RL's leader-broadcast fetch (``_broadcast_batched_data_dict``
in ``nemo_rl/data_plane/worker_mixin.py``), written here from its described algorithm.

Reproduced:

- one hop over the whole TP×CP×PP replica group (NeMo-RL builds that group in its Megatron
  policy worker); the replica leader is the source; with a replica of one rank nothing is sent;
- a descriptor first, by ``broadcast_object_list`` on the same group: one entry per key, either
  (key, "tensor", dtype name, shape, device) or (key, "raw", value) for anything that is not a
  tensor;
- then one synchronous ``dist.broadcast`` per tensor, in descriptor order, on the device the
  group's backend carries (CUDA for NCCL, else CPU): the leader moves a tensor there if it lives
  elsewhere; receivers allocate empty tensors there and move them back to a tensor's original
  device type afterwards. Nothing is coalesced and zero-size tensors are broadcast as well.

Kept on purpose: the descriptor is pickled (with any raw values in it), and k leaves cost k
broadcasts, each waited on before the next.

Adapted to the ``get_data_input`` contract:

- keys are TensorDict leaf keys (a nested key travels as its tuple) and ``batch_size`` rides as
  one more raw entry; receivers rebuild the TensorDict;
- ``non_tensor_batch`` travels as one raw entry when ``meta_info['_broadcast_non_tensor_batch']``
  is set; tensordict's NonTensorData / NonTensorStack leaves travel as raw entries (NeMo-RL
  carries any non-tensor value that way);
- a jagged or otherwise non-strided leaf has no dense shape to describe: the leader refuses it
  and the refusal travels in the descriptor, so every rank raises (NeMo-RL would fail on the
  receivers' allocation and leave the others waiting);
- a tensor a process group refuses as it is (non-contiguous, or a dtype gloo cannot carry) is
  made contiguous (a copy of its own elements, ``copied_bytes``) and sent as its bytes
  (``strategies.core.parts.transportable``); receivers do the same to their buffers;
- receivers restore CUDA tensors on their own ``groups.device`` (NeMo-RL: the leader's device
  string, which under Ray names each worker's only visible GPU).

Whatever the leader raises while describing its batch, a failure batch goes out in its place
(``strategies.Strategy.get_data_input``), and a descriptor that will not pickle travels as a
``ShippedFailure``, so every rank raises it; all leader-side preparation runs before the
descriptor goes out, so nothing the leader can refuse comes after it.

Per call: 2 collectives (descriptor sizes, pickled descriptor) + 1 per tensor leaf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from strategies.core.contract import (
    BATCH_SIZE_KEY,
    NON_TENSOR_KEY,
    ShippedFailure,
    deliver,
    is_non_tensor_leaf,
    leaves,
    raise_failure,
    send_or_failure,
    wants_non_tensor,
)
from strategies.core.footprint import Footprint
from strategies.core.parts import transportable
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan
from strategies.core.strategy_base import Strategy
from strategies.core.trace import WORK


class Refused(ValueError):
    """A leaf this peer cannot describe (raised on the leader, shipped to every rank)."""


@dataclass(frozen=True)
class Prepared:
    """The leader's side of one call: the descriptor and the tensors to send, in order."""

    descriptor: list
    tensors: list[torch.Tensor]


def _bcast_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sendable(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor as a process group takes it: on the broadcast device, contiguous, in a dtype
    the backend carries (else as its bytes)."""
    if t.device.type != device.type:
        t = t.to(device)
        WORK["d2h_bytes" if device.type == "cpu" else "h2d_bytes"] += t.nbytes
    if not t.is_contiguous():
        t = t.contiguous()
        WORK["copied_bytes"] += t.nbytes
    return transportable(t)


def _name(key: tuple[str, ...]):
    return key if len(key) > 1 else key[0]


def refuse(batch, rank: int) -> None:
    """Leader, before any collective: a leaf with no dense shape (jagged, any non-strided
    layout) raises ``Refused`` naming the key, which reaches every rank of the replica."""
    for key, value in leaves(batch.batch):
        if not is_non_tensor_leaf(value) and (value.layout != torch.strided or value.is_nested):
            raise Refused(
                f"rank {rank}: batch[{_name(key)!r}] has layout {value.layout}; NeMo-RL's "
                "descriptor records one dense shape per tensor, so only strided tensors travel"
            )


def describe(batch, device: torch.device) -> Prepared:
    """Leader: NeMo-RL's descriptor for a batch ``refuse`` passed, and the tensors to
    broadcast after it."""
    descriptor: list = [(BATCH_SIZE_KEY, "raw", list(batch.batch.batch_size))]
    tensors: list[torch.Tensor] = []
    for key, value in leaves(batch.batch):
        if is_non_tensor_leaf(value):
            descriptor.append((key, "raw", value))
            continue
        descriptor.append((key, "tensor", str(value.dtype), tuple(value.shape), str(value.device)))
        tensors.append(_sendable(value, device))
    if wants_non_tensor(batch):
        descriptor.append((NON_TENSOR_KEY, "raw", batch.non_tensor_batch))
    return Prepared(descriptor, tensors)


def _receive(descriptor: list, src: int, group, device: torch.device, own: torch.device):
    """Receivers: allocate and receive every tensor in descriptor order; return the entries."""
    out: dict[Any, Any] = {}
    for entry in descriptor:
        key, kind = entry[0], entry[1]
        if kind != "tensor":
            out[key] = entry[2]
            continue
        dtype = getattr(torch, entry[2].removeprefix("torch."))
        t = torch.empty(entry[3], dtype=dtype, device=device)
        dist.broadcast(transportable(t), src=src, group=group)
        src_type = torch.device(entry[4]).type
        if src_type != device.type:  # back to the leader's device type, on this rank's device
            t = t.to(own if own.type == src_type else torch.device(src_type))
        out[key] = t
    return out


def _rebuild(entries: dict) -> tuple[TensorDict, Any]:
    nested: dict = {}
    for key, value in entries.items():
        if key in (BATCH_SIZE_KEY, NON_TENSOR_KEY):
            continue
        parts = key if isinstance(key, tuple) else (key,)
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return TensorDict(nested, batch_size=entries[BATCH_SIZE_KEY]), entries.get(NON_TENSOR_KEY)


class NemoRlLeaderBroadcast(Strategy):
    name = "nemo_rl_leader_broadcast"
    footprint = Footprint(leader=0, receiver=1.05)
    """Measured by the node memory phase (one broadcast per tensor from the leader's own
    tensors)."""
    claims = (
        "one hop over the TP×CP×PP replica group: 2 (descriptor sizes, pickled descriptor) "
        "+ 1 broadcast per tensor leaf; none when the replica is one rank"
    )

    def check(self, batch) -> None:
        refuse(batch, self.groups.rank)

    def transfer(self, batch):
        g = self.groups
        device = _bcast_device(g.replica_group)
        if not g.is_leader:
            box = [None]
            dist.broadcast_object_list(box, src=g.leader, group=g.replica_group)
            if isinstance(box[0], ShippedFailure):
                raise_failure(g, box[0].text)
            entries = _receive(box[0], g.leader, g.replica_group, device, g.device)
            return deliver(batch, *_rebuild(entries))
        prepared = describe(batch, device)
        failed = send_or_failure(prepared.descriptor, g.replica_group)
        if failed is not None:  # the descriptor would not pickle; every rank got why
            raise_failure(g, failed[1].text, failed[0])
        for t in prepared.tensors:
            dist.broadcast(t, src=g.leader, group=g.replica_group)
        return batch

    @classmethod
    def plan(cls, layout, spec: PayloadSpec, leaf_bytes: tuple[int, ...] | None = None) -> Plan:
        """``leaf_bytes``: bytes of each tensor leaf in TensorDict order (``PayloadSpec.leaf_nbytes``).
        The descriptor's pickled size is not predicted (inexact)."""
        sizes, exact = spec.leaf_nbytes(leaf_bytes)
        nt = spec.sent_non_tensor_bytes
        comms: list[Comm] = []
        replicas = layout.replica_groups() if layout.replica_size > 1 else []
        steps = [(8, "sizes", True), (nt, "pickle", False)] + [(n, "leaf", exact) for n in sizes]
        for step, (nbytes, what, ok) in enumerate(steps):
            for ranks in replicas:
                comms.append(Comm("broadcast", tuple(ranks), ranks[0], nbytes, step, what, ok))
        work = LocalWork(pickled_bytes=nt) if replicas else LocalWork()
        return Plan(cls.name, comms, leader=work, receiver=work, forwarder=LocalWork())


STRATEGY = NemoRlLeaderBroadcast
