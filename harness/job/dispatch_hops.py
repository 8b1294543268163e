"""The rank side of the two dispatch modes that carry the chunk on from the ranks Ray handed it
to with hops of their own (no broadcast strategy): ``edge_stages`` and ``chain``
(``harness.job.dispatch`` runs them from the driver; ``harness.model.dispatch_ranks`` says who
gets what).

- ``edge_stages`` reproduces a verl fork's dispatch (issue 39, quoting it: "significantly reduces
  the extra data sent via Ray" at tp = 8, pp = 4-8): the driver sends each replica's chunk
  through Ray only to TP×CP rank 0 of the first and of the last pipeline stage, each of which
  broadcasts it over its stage's TP×CP group as one pickled object
  (``broadcast_object_list``). The middle stages receive nothing: in training they get
  activations from the stage before. Left out: the fork's own worker classes and how it splits
  the batch's fields between the first stage (inputs) and the last (labels, masks); both edge
  stages get the whole chunk here.
- ``chain`` reproduces TensorRT-LLM's request hand-out (its PyTorch executor): the chunk goes to
  the replica leader, is broadcast as one pickled object on the first stage's TP×CP group, then
  chained down the pipeline, each rank of stage k sending it to its counterpart of stage k + 1
  (``send_object_list`` / ``recv_object_list`` on the PP group), so every rank holds it. Left
  out: MPI (TensorRT-LLM's transport; here torch.distributed on the job's groups) and its
  request objects (here the DataProto chunk).

Each has a floor (``:raw``): the same hops with the chunk's bytes as one flat uint8 tensor
(``dist.broadcast``, ``dist.send``/``dist.recv``), its receivers sized before the call as the
``floor`` strategy's are. The groups are the job's, derived from megatron-core's parallel state
(``ProcessGroups``: ``tp_cp_group``, ``pp_group`` and their gloo twins for objects).
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from harness.job.verification import digest, tensor_digest
from harness.model.dispatch_ranks import CHAIN, EDGE_STAGES
from strategies import DataProto
from strategies.core.process_groups import ProcessGroups


def _edge(groups: ProcessGroups) -> bool:
    return groups.pp_rank in (0, groups.pp_size - 1)


def on_device(dp: DataProto, device: torch.device) -> DataProto:
    """``dp`` with its TensorDict on ``device`` (moved in place; host memory stays)."""
    if device.type != "cpu" and dp.batch is not None:
        dp.batch = dp.batch.to(device)
    return dp


# -- pickled objects (the sources' own form) -------------------------------------------------
def _tp_cp_object(groups: ProcessGroups, box: list) -> None:
    """The stage's TP×CP rank 0 hands its object to the rest of its TP×CP group."""
    if groups.tp_cp_size > 1:
        src = groups.tp_cp_ranks[0]
        dist.broadcast_object_list(box, src=src, group=groups.cpu_tp_cp_group)


def _chain_object(groups: ProcessGroups, box: list) -> None:
    """Stage k's rank passes the object it holds to its counterpart on stage k + 1."""
    stage, ranks = groups.pp_rank, groups.pp_ranks
    if stage > 0:
        dist.recv_object_list(box, src=ranks[stage - 1], group=groups.cpu_pp_group)
    if stage < groups.pp_size - 1:
        dist.send_object_list(box, dst=ranks[stage + 1], group=groups.cpu_pp_group)


def object_hops(kind: str, groups: ProcessGroups, data: DataProto | None) -> DataProto | None:
    """``kind``'s hops with ``data`` (the chunk on a rank Ray handed it to, else None) as a
    pickled object; what this rank holds at the end (None on an ``edge_stages`` middle stage)."""
    box = [data]
    if kind == EDGE_STAGES:
        if not _edge(groups):
            return None
        _tp_cp_object(groups, box)
    elif kind == CHAIN:
        if groups.pp_rank == 0:
            _tp_cp_object(groups, box)
        _chain_object(groups, box)
    else:
        raise ValueError(f"dispatch hops: {kind!r} is not one of {[EDGE_STAGES, CHAIN]}")
    return on_device(box[0], groups.device)


# -- the floors: one flat uint8 tensor -------------------------------------------------------
def _buffer(cache: dict, data: np.ndarray | None, nbytes: int, device) -> torch.Tensor:
    """The chunk's bytes on a rank Ray handed them to; a receive buffer of ``nbytes`` on any
    other, kept between calls as the floor strategy keeps its own (allocation is not dispatch)."""
    if data is not None:
        with warnings.catch_warnings():  # Ray's array is read-only; a source only reads it
            warnings.filterwarnings("ignore", message=".*not writable.*")
            return torch.from_numpy(data).to(device)
    buf = cache.get("hops_buffer")
    if buf is None or buf.numel() != nbytes or buf.device != device:
        buf = cache["hops_buffer"] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf


def raw_hops(kind: str, groups: ProcessGroups, buf: torch.Tensor) -> torch.Tensor | None:
    """``kind``'s hops with the flat bytes in ``buf`` (filled on a rank Ray handed them to);
    the buffer this rank holds at the end (None on an ``edge_stages`` middle stage)."""
    stage, ranks = groups.pp_rank, groups.pp_ranks
    if kind == EDGE_STAGES and not _edge(groups):
        return None
    if kind not in (EDGE_STAGES, CHAIN):
        raise ValueError(f"dispatch hops: {kind!r} is not one of {[EDGE_STAGES, CHAIN]}")
    if groups.tp_cp_size > 1 and (kind == EDGE_STAGES or stage == 0):
        dist.broadcast(buf, src=groups.tp_cp_ranks[0], group=groups.tp_cp_group)
    if kind == CHAIN:
        if stage > 0:
            dist.recv(buf, src=ranks[stage - 1], group=groups.pp_group)
        if stage < groups.pp_size - 1:
            dist.send(buf, dst=ranks[stage + 1], group=groups.pp_group)
    return buf


# -- one call, as the driver submits it ------------------------------------------------------
def hops_call(ctx, kind: str, data, raw: bool, nbytes: int, verify: bool):
    """One dispatch call of ``kind`` on this rank: ``data`` is what Ray handed it (the chunk, its
    flat bytes, or None), ``nbytes`` the flat bytes' size (a floor's receive buffer). Returns
    (end time in ns, what verification needs: None where this rank holds nothing)."""
    groups = ctx.cache["dispatch_groups"]
    if raw:
        held = raw_hops(kind, groups, _buffer(ctx.cache, data, nbytes, groups.device))
    else:
        held = object_hops(kind, groups, data)
    end = time.time_ns()
    if not verify or held is None:
        return end, None
    if raw:
        return end, tensor_digest(held)
    return end, (digest(held, True), held.meta_info)
