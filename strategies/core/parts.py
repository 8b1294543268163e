"""What a message carries: a batch's leaves as parts, the non-tensor blob, and tensor bytes.

A leaf travels as one or more parts (``message_parts``): a dense tensor as itself; a jagged
NestedTensor (``layout=torch.jagged``) as its values, offsets and (when present) lengths, each
an entry of its own kind, rebuilt as a jagged NestedTensor on arrival; a NonTensorData /
NonTensorStack leaf as its pickle, an entry flagged KIND_OBJECT (like the non_tensor_batch
blob), unpickled on arrival. ``structure`` is what fixes a message's layout.
"""

from __future__ import annotations

import pickle

import numpy as np
import torch
from tensordict import TensorDict

from strategies.core.contract import is_non_tensor_leaf, leaves
from strategies.core.header_format import (
    KIND_DENSE,
    KIND_LENGTHS,
    KIND_OBJECT,
    KIND_OFFSETS,
    KIND_VALUES,
    HeaderError,
)
from strategies.core.phase_clock import CLOCK
from strategies.core.trace import WORK


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own elements as flat uint8 (copies only when its layout requires).

    ``reshape(-1)`` of a one-element strided view keeps a stride != 1, which ``view(uint8)``
    refuses; one element may take any stride, so it is re-strided in place.
    """
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    flat = t.reshape(-1)
    if flat.stride(0) != 1:  # only a single element can be "contiguous" with another stride
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


# Dtypes gloo and NCCL reduce/broadcast natively; others (int16, ...) travel as their bytes.
_NATIVE = {
    torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
}  # fmt: skip


def transportable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a uint8 view of its bytes when the backends cannot carry its dtype
    (gloo raises 'Invalid scalar type' for int16). Sender and receiver apply the same rule to
    contiguous tensors, so the bytes land where they belong."""
    return t if t.dtype in _NATIVE else as_bytes(t)


def leaf_on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A leaf as a leader sends it from its own device (``areal_broadcast``,
    ``mindspeed_transfer_dock``): moved to ``device`` (counted as ``h2d_bytes``, or
    ``d2h_bytes`` onto the CPU) and made contiguous, since a process group sends contiguous
    tensors only (counted as ``copied_bytes``); each only where needed."""
    if t.device != device:
        t = t.to(device)
        WORK["h2d_bytes" if device.type != "cpu" else "d2h_bytes"] += t.nbytes
    if not t.is_contiguous():
        t = t.contiguous()
        WORK["copied_bytes"] += t.nbytes
    return t


Part = tuple  # (key, kind, aux, tensor): one entry of the message


def message_parts(batch: TensorDict, rank: int = 0) -> list[Part]:
    """Every piece the message carries, in leaf order: ``(key, kind, aux, tensor)``. A
    non-tensor leaf is pickled here (its bytes as a uint8 tensor)."""
    flat = _flat_dense_parts(batch)
    return flat if flat is not None else _walk_parts(batch, rank)


def _walk_parts(batch: TensorDict, rank: int) -> list[Part]:
    """``message_parts`` by tensordict's own walk over every leaf (any batch)."""
    out: list[Part] = []
    for key, value in leaves(batch):
        name = key if len(key) > 1 else key[0]
        if is_non_tensor_leaf(value):
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            WORK["pickled_bytes"] += len(blob)
            out.append((key, KIND_OBJECT, 0, torch.frombuffer(bytearray(blob), dtype=torch.uint8)))
        elif value.is_nested:
            if value.layout != torch.jagged:
                raise HeaderError(
                    f"rank {rank}: batch[{name!r}] is a nested tensor with layout "
                    f"{value.layout}; the header carries dense tensors and layout=torch.jagged"
                )
            # The offsets come last: the entry that tells a receiver the leaf is complete.
            out.append((key, KIND_VALUES, value._ragged_idx, value.values()))
            if value.lengths() is not None:
                out.append((key, KIND_LENGTHS, 0, value.lengths()))
            out.append((key, KIND_OFFSETS, 0, value.offsets()))
        else:
            out.append((key, KIND_DENSE, 0, value))
    return out


def _flat_dense_parts(batch) -> list[Part] | None:
    """``message_parts`` of a TensorDict whose every entry is a plain dense tensor at the top
    level (an RL batch as verl and ROLL build it), read from its key->tensor dict; None for
    anything else (nested TensorDicts, jagged or strided nested tensors, non-tensor leaves,
    tensor subclasses, other TensorDict types), which takes the general walk. The result is
    the general walk's (a property test holds them equal), at a fraction of its cost:
    tensordict's generic iteration is most of the leader's Python per call for a flat batch,
    and every microsecond of Python on a rank costs several of wall time when ranks share
    cores."""
    if type(batch) is not TensorDict:
        return None
    entries = getattr(batch, "_tensordict", None)
    if type(entries) is not dict:
        return None
    out: list[Part] = []
    for key, value in entries.items():
        if type(value) is not torch.Tensor or value.is_nested or type(key) is not str:
            return None
        out.append(((key,), KIND_DENSE, 0, value))
    return out


def parts_and_structure(batch: TensorDict, rank: int = 0) -> tuple[list[Part], tuple]:
    """``message_parts`` and ``structure`` of a batch, the two in one pass over a flat batch
    of plain dense tensors (``_flat_dense_parts``' batches), where the leader's every call
    needs both: equal to ``(parts, structure(batch, parts))``, which every other batch gets."""
    entries = getattr(batch, "_tensordict", None) if type(batch) is TensorDict else None
    if type(entries) is dict:
        parts: list[Part] = []
        shape = []
        for key, t in entries.items():
            if type(t) is not torch.Tensor or t.is_nested or type(key) is not str:
                break
            k = (key,)
            parts.append((k, KIND_DENSE, 0, t))
            shape.append((k, KIND_DENSE, 0, t.dtype, t.shape, t.device, torch.Tensor, t.layout))
        else:
            return parts, (TensorDict, tuple(batch.batch_size), tuple(shape))
    parts = _walk_parts(batch, rank)
    return parts, structure(batch, parts)


def encode_non_tensor(non_tensor_batch: dict[str, np.ndarray]) -> bytes:
    """The non_tensor_batch blob: one pickle of the dict, with every 1-D object array (the
    prompts, uids and per-sample dicts RL frameworks carry) as the list of its elements.
    Pickling an object ndarray goes through numpy's reduce machinery, a fixed cost that
    dominated small batches; a list pickles in C, element by element, the same objects. A
    timed call's clock counts it as ``encode`` (``phase_clock``)."""
    before = CLOCK.switch("encode")
    try:
        return _pickled(non_tensor_batch)
    finally:
        CLOCK.switch(before)


def _pickled(non_tensor_batch: dict[str, np.ndarray]) -> bytes:
    return pickle.dumps(
        {
            k: a.tolist() if type(a) is np.ndarray and a.dtype == object and a.ndim == 1 else a
            for k, a in non_tensor_batch.items()
        },
        protocol=pickle.HIGHEST_PROTOCOL,
    )


BLOB_MIN_ROOM = 256
BLOB_POW2_UPTO = 64 << 10


def blob_room(nbytes: int) -> int:
    """The room a message gives a non-tensor blob of ``nbytes``: a power of two from 256 B up
    to 64 KiB, above that the next multiple of an eighth of its power of two. The header
    records the room, not the length (a pickle ends itself: ``pickle.loads`` reads up to its
    STOP and no further), so a batch whose prompts change by a few bytes from step to step, as
    every RL step's do, keeps its header bytes: the leader's encoded header, the receivers'
    decoded one and shm's guessed TensorDict all hold. At most a byte of room per byte of
    blob below 64 KiB, an eighth above; only the blob's own bytes are written."""
    if nbytes <= BLOB_MIN_ROOM:
        return BLOB_MIN_ROOM
    power = 1 << (nbytes - 1).bit_length()  # the least power of two >= nbytes
    if power <= BLOB_POW2_UPTO:
        return power
    step = power // 16  # an eighth of the power of two below
    return -(-nbytes // step) * step


def decode_non_tensor(raw) -> dict[str, np.ndarray]:
    """``encode_non_tensor`` undone (``raw``: any bytes-like object, read in place): a list
    becomes a 1-D object array holding exactly its elements (``fromiter`` never reads a
    list-valued element as another dimension, as ``np.array`` would)."""
    out = pickle.loads(raw)
    for k, v in out.items():
        if type(v) is list:
            out[k] = np.fromiter(v, dtype=object, count=len(v))
    return out


def structure(batch: TensorDict, parts: list[Part]) -> tuple:
    """What fixes a message's layout: the batch's type and size, and each part's key, kind,
    dtype, shape and device. Equal structures pack into equal headers. Each part's class and
    layout come last: they do not change the header, but a leaf of another kind (sparse, a
    subclass) with the same dtype and shape is a new structure, which the leader validates."""
    return (
        type(batch),
        tuple(batch.batch_size),
        tuple(
            (k, kind, aux, t.dtype, t.shape, t.device, type(t), t.layout)
            for k, kind, aux, t in parts
        ),
    )
