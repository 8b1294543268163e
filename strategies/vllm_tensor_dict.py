"""``vllm_tensor_dict``: vLLM's ``GroupCoordinator.broadcast_tensor_dict``, applied over the
seed's two hops (TP×CP on stage 0, then PP).

Kept on purpose (the original's algorithm and its flaws):

- the dict is split into a metadata list — (key, TensorMeta(device type, dtype, shape)) per
  tensor, non-tensor values inline — and a tensor list; the metadata list is pickled with
  ``broadcast_object_list`` over the CPU (gloo) group (vLLM's ``cpu_group``; its shared-memory
  queue is not reproduced);
- then ONE async broadcast per tensor — a CUDA tensor on the device group, a CPU tensor on the
  gloo group — and a wait on every handle at the end. Nothing is coalesced, so a batch of k
  leaves costs k broadcasts per hop, and async launches can skew ranks;
- zero-size tensors are skipped (receivers allocate them empty);
- a forwarding rank calls it again with what it received, so it re-pickles the metadata.

Adapted to fit the ``get_data_input`` contract:

- keys are TensorDict leaf keys (a nested key travels as its tuple), and ``batch_size`` rides as
  one more inline metadata entry; receivers rebuild the TensorDict;
- a leader that fails before sending (any exception) sends a failure batch instead
  (``strategies.Strategy.get_data_input``), and metadata its source cannot pickle travels as
  a ``ShippedFailure``, so every rank raises instead of waiting for tensors;
- ``non_tensor_batch``, when ``meta_info['_broadcast_non_tensor_batch']`` is set, travels inline
  in the metadata list as vLLM carries any non-tensor value;
- a NonTensorData/NonTensorStack leaf rides inline in the metadata list (vLLM carries any
  non-tensor value that way); a jagged NestedTensor has no dense TensorMeta, so the leader
  refuses it and every rank raises naming the key;
- receivers allocate CUDA tensors on their own ``groups.device`` (vLLM: its current device);
- vLLM broadcasts the sender's tensors as they are, which a process group refuses for
  non-contiguous tensors; here those are made contiguous first (a copy of the view's own
  elements only, counted as ``copied_bytes``). Contiguous views go as they are: only the view's
  bytes travel.

Per hop: 2 collectives (metadata sizes, pickled metadata) + 1 per non-empty tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from strategies.core.contract import (
    BATCH_SIZE_KEY,
    NON_TENSOR_KEY,
    DataProto,
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
from strategies.core.refusals import refuse_jagged
from strategies.core.strategy_base import Strategy
from strategies.core.trace import WORK

ERROR_KEY = "__leader_error__"
"""What ``broadcast_tensor_dict`` returns, on every rank, when its source could not pickle the
metadata list: ``{ERROR_KEY: why}``."""


@dataclass(frozen=True)
class TensorMeta:
    """vLLM's ``TensorMetadata``: what a receiver needs to allocate one tensor."""

    device: str
    dtype: torch.dtype
    shape: torch.Size


def broadcast_tensor_dict(
    tensor_dict: dict | None,
    src: int,
    group,
    cpu_group,
    device: torch.device,
    failures: list | None = None,
) -> dict:
    """vLLM's algorithm on one group; ``src`` is a global rank. Returns the dict on every rank.
    Metadata the source cannot pickle travels as ``{ERROR_KEY: why}`` instead (every rank
    returns that), and the source appends its exception to ``failures``."""
    if dist.get_rank() == src:
        return _send_tensor_dict(tensor_dict, src, group, cpu_group, failures)
    return _receive_tensor_dict(src, group, cpu_group, device)


def _send_tensor_dict(tensor_dict: dict, src: int, group, cpu_group, failures) -> dict:
    """The source: the metadata list (a tensor as its ``TensorMeta``, any other value as
    itself) in one object broadcast, then one async broadcast per non-empty tensor."""
    metadata, tensors = [], []
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            metadata.append((key, TensorMeta(value.device.type, value.dtype, value.shape)))
            tensors.append(value)
        else:
            metadata.append((key, value))
    box = [metadata]
    unpicklable = broadcast_objects(box, src, cpu_group)
    if unpicklable is not None:
        if failures is not None:
            failures.append(unpicklable)
        return {ERROR_KEY: box[0].text}
    handles = []
    for t in tensors:
        if t.numel() == 0:
            continue
        if not t.is_contiguous():
            t = t.contiguous()
            WORK["copied_bytes"] += t.numel() * t.element_size()
        on = cpu_group if t.is_cpu else group
        handles.append(dist.broadcast(transportable(t), src=src, group=on, async_op=True))
    for h in handles:
        h.wait()
    return tensor_dict


def _receive_tensor_dict(src: int, group, cpu_group, device: torch.device) -> dict:
    """A receiver: the metadata list, then a tensor allocated per ``TensorMeta`` (on the CPU
    or ``device``, as the source's was) and filled by its async broadcast."""
    box = [None]
    broadcast_objects(box, src, cpu_group)
    if isinstance(box[0], ShippedFailure):
        return {ERROR_KEY: box[0].text}
    out, handles = {}, []
    for key, value in box[0]:
        if not isinstance(value, TensorMeta):
            out[key] = value
            continue
        on_cpu = value.device == "cpu"
        t = torch.empty(value.shape, dtype=value.dtype, device="cpu" if on_cpu else device)
        out[key] = t
        if t.numel() == 0:
            continue
        on = cpu_group if on_cpu else group
        handles.append(dist.broadcast(transportable(t), src=src, group=on, async_op=True))
    for h in handles:
        h.wait()
    return out


def refuse(batch: DataProto, rank: int = 0) -> None:
    """Leader, before any collective: a jagged NestedTensor has no dense TensorMeta, so it is
    refused naming the key (every rank of the replica raises it)."""
    why = (
        "vLLM's broadcast_tensor_dict describes each tensor by one dense shape and cannot carry it"
    )
    refuse_jagged(batch, rank, why)


def to_tensor_dict(batch: DataProto) -> dict:
    """Leader: the DataProto as the flat dict vLLM broadcasts (a batch ``refuse`` passed)."""
    out: dict = {BATCH_SIZE_KEY: list(batch.batch.batch_size)}
    for key, value in leaves(batch.batch):
        out[_key_name(key)] = value  # a non-tensor leaf rides inline, as vLLM carries any value
    if wants_non_tensor(batch):
        out[NON_TENSOR_KEY] = batch.non_tensor_batch
    return out


def from_tensor_dict(d: dict) -> tuple[TensorDict, dict | None]:
    nested: dict = {}
    for key, value in d.items():
        if key in (BATCH_SIZE_KEY, NON_TENSOR_KEY):
            continue
        parts = key if isinstance(key, tuple) else (key,)
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return TensorDict(nested, batch_size=d[BATCH_SIZE_KEY]), d.get(NON_TENSOR_KEY)


class VllmTensorDict(Strategy):
    name = "vllm_tensor_dict"
    footprint = Footprint(leader=0, receiver=1)
    """Measured by the node memory phase (one broadcast per tensor from the leader's own
    tensors)."""
    claims = (
        "per hop: 2 (pickled metadata over gloo) + 1 async broadcast per non-empty tensor; "
        "hops: TP×CP on stage 0 if tp·cp>1, then PP if pp>1"
    )

    def check(self, batch: DataProto) -> None:
        refuse(batch, self.groups.rank)

    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        d = to_tensor_dict(batch) if g.is_leader else None
        failures: list = []
        for hop in g.seed_hops():
            d = broadcast_tensor_dict(d, hop.ranks[0], hop.group, hop.cpu_group, g.device, failures)
        if ERROR_KEY in d:
            raise_failure(g, d[ERROR_KEY], next(iter(failures), None))
        if not g.is_leader:
            td, non_tensor = from_tensor_dict(d)
            deliver(batch, td, non_tensor)
        return batch

    @classmethod
    def plan(cls, layout, spec: PayloadSpec, leaf_bytes: tuple[int, ...] | None = None) -> Plan:
        """``leaf_bytes``: bytes of each tensor leaf in TensorDict order
        (``PayloadSpec.leaf_nbytes``)."""
        sizes, exact = spec.leaf_nbytes(leaf_bytes)
        nt = spec.sent_non_tensor_bytes
        comms: list[Comm] = []
        step = 0
        for groups in layout.seed_hop_groups():
            what = [(8, "sizes", True), (nt, "pickle", False)]
            what += [(n, "payload", exact) for n in sizes if n]
            for nbytes, kind, ok in what:
                for ranks in groups:
                    comms.append(Comm("broadcast", tuple(ranks), ranks[0], nbytes, step, kind, ok))
                step += 1
        return Plan(
            cls.name,
            comms,
            leader=LocalWork(pickled_bytes=nt),
            receiver=LocalWork(pickled_bytes=nt),
            forwarder=LocalWork(pickled_bytes=2 * nt),
        )


STRATEGY = VllmTensorDict
