"""Serializers of the pickled path that keep tensor bytes out of the pickle stream, and the hop
that carries what they make (``pickled``'s ``serialization`` = ``pickle5`` | ``verl_numpy``).

- ``pickle5``: vLLM's way (``vllm/v1/serial_utils.py``, its shared-memory queue): pickle protocol
  5 with a ``buffer_callback``; every dense CPU tensor is reduced to (dtype, shape, its bytes as
  a uint8 numpy array), which protocol 5 hands out of band, so the stream holds no tensor byte.
  Receivers rebuild each tensor as a view of the bytes that arrived (vLLM's ``torch.frombuffer``
  of its aux frames): no copy after the transfer.
- ``verl_numpy``: verl's ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy`` (``verl/protocol.py``,
  ``serialize_tensordict``): a TensorDict becomes (batch_size, device, {key: (dtype, shape,
  uint8 numpy view)}) so Ray's protocol-5 pickling carries the arrays out of band; the receiver
  copies each array into a ``bytearray`` and ``torch.frombuffer``s it (one copy per tensor,
  which gives owned, writable tensors). Adapted: a nested TensorDict is reduced the same way,
  level by level (verl's batches are flat), and an entry that is not a dense tensor (jagged,
  NonTensorData) is pickled as it is, in band, where verl unbinds a jagged one.

Both are host-memory serializers (verl's runs on CPU tensors only): a leaf on a device is
copied to the host on the source and onto the receiving rank's own device of that type after
the transfer (as ``nemo_rl_leader_broadcast`` restores one), counted as d2h and h2d bytes.

The hop keeps ``broadcast_object_list``'s two collectives: the size (one int64, then a host
sync), then one byte buffer. The buffer is a frame table (count, then each frame's length, as
int64) and the frames, each on a 64-byte boundary: the in-band pickle first, then the
out-of-band buffers in the order pickle asked for them. The source copies each frame into the
buffer once (vLLM writes its frames into a shared chunk the same way); receivers unpickle with
the frames as views of it.
"""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from strategies.core.contract import ContractError, ShippedFailure, failure_text
from strategies.core.trace import WORK

OOB_SERIALIZATIONS = ("pickle5", "verl_numpy")
ALIGN = 64
"""Every frame starts on this boundary of the hop's buffer: a tensor rebuilt as a view of it is
as aligned as one torch allocates (an unaligned complex128 view crashes vectorized reads)."""
MAX_FRAMES = 1 << 20
"""More frames than this in a table is a corrupt or hostile message, not a batch."""


@dataclass
class Whole:
    """What a hop carries with the non-tensor flag set (as ROLL's DataProto pickles it)."""

    batch: TensorDict
    non_tensor_batch: dict
    meta_info: dict


def as_bytes(t) -> bool:
    """A tensor these serializers carry as its bytes: strided, not nested, no subclass (its
    dtype and shape say the rest); any other leaf is pickled as it is, in band."""
    return type(t) is torch.Tensor and t.layout == torch.strided and not t.is_nested


def _as_uint8(t: torch.Tensor) -> np.ndarray:
    """``t``'s elements as a flat uint8 numpy array: a view when ``t`` is dense on the CPU, else
    one copy (made contiguous, conjugate and negative bits resolved, or brought to the host)."""
    src = t.resolve_conj().resolve_neg()
    if src.device.type != "cpu":
        src = src.cpu()
        WORK["d2h_bytes"] += src.nbytes
    if not src.is_contiguous():
        src = src.contiguous()
        WORK["copied_bytes"] += src.nbytes
    flat = src.reshape(-1)
    if flat.numel() <= 1:  # torch calls a one-element tensor contiguous whatever its stride
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8).numpy()


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ContractError(f"a frame names dtype {name!r}, which this torch does not have")
    return dtype


def _here(device_type: str | None) -> torch.device | None:
    """This rank's device of ``device_type`` (its current CUDA device for ``cuda``, as
    ``nemo_rl_leader_broadcast`` restores a tensor), None for the host."""
    if device_type in (None, "cpu"):
        return None
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _onto(t: torch.Tensor, device_type: str | None) -> torch.Tensor:
    here = _here(device_type)
    if here is None:
        return t
    WORK["h2d_bytes"] += t.nbytes
    return t.to(here)


def tensor_view(dtype: str, shape: tuple, data: np.ndarray, device: str = "cpu") -> torch.Tensor:
    """vLLM's rebuild: a view of the bytes that arrived, in ``dtype`` and ``shape`` (a tensor
    that left a device is copied onto this rank's)."""
    return _onto(torch.from_numpy(data).view(_dtype(dtype)).view(shape), device)


def tensor_copy(dtype: str, shape: tuple, data: np.ndarray, device: str = "cpu") -> torch.Tensor:
    """verl's rebuild: the bytes copied into a bytearray, ``torch.frombuffer`` of it."""
    owned = bytearray(data)
    WORK["copied_bytes"] += len(owned)
    if not owned:  # frombuffer refuses an empty buffer
        return _onto(torch.empty(shape, dtype=_dtype(dtype)), device)
    return _onto(torch.frombuffer(owned, dtype=torch.uint8).view(_dtype(dtype)).view(shape), device)


def verl_tensordict(batch_size: tuple, device: str | None, items: dict) -> TensorDict:
    """verl's ``deserialize_tensordict``: every entry rebuilt (tensors by ``tensor_copy``; a
    nested TensorDict arrives rebuilt already, by its own reduction), on this rank's device of
    the sender's device type."""
    out = {k: tensor_copy(*v[1:]) if v[0] == "tensor" else v[1] for k, v in items.items()}
    here = _here(None if device is None else torch.device(device).type)
    return TensorDict(out, batch_size=batch_size, device=device if here is None else here)


class _Pickle5(pickle.Pickler):
    """Protocol 5: dense tensors as their bytes, out of band."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and as_bytes(obj):
            shape, kind = tuple(obj.shape), obj.device.type
            return tensor_view, (str(obj.dtype), shape, _as_uint8(obj), kind)
        return NotImplemented


class _VerlNumpy(pickle.Pickler):
    """Protocol 5: a TensorDict as verl's (batch_size, device, items), arrays out of band."""

    def reducer_override(self, obj):
        if not isinstance(obj, TensorDict):
            return NotImplemented
        items = {}
        for key, value in obj.items():  # one level, as verl's; a nested TensorDict recurses
            if isinstance(value, torch.Tensor) and as_bytes(value):
                shape, kind = tuple(value.shape), value.device.type
                items[key] = ("tensor", str(value.dtype), shape, _as_uint8(value), kind)
            else:
                items[key] = ("raw", value)
        device = None if obj.device is None else str(obj.device)
        return verl_tensordict, (tuple(obj.batch_size), device, items)


PICKLERS = {"pickle5": _Pickle5, "verl_numpy": _VerlNumpy}


def dumps(obj, serialization: str) -> list:
    """The frames of ``obj``: the in-band pickle, then every out-of-band buffer (as raw
    memoryviews of the tensors' bytes: no copy yet)."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    PICKLERS[serialization](stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    inband = stream.getbuffer()
    WORK["pickled_bytes"] += inband.nbytes
    return [inband, *(b.raw() for b in buffers)]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _offsets(sizes) -> tuple[list[int], int]:
    """Where each frame starts in the hop's buffer (after the table, each on an ``ALIGN``
    boundary), and the buffer's bytes."""
    at = _align(8 * (1 + len(sizes)))
    starts = []
    for n in sizes:
        starts.append(at)
        at = _align(at + n)
    return starts, at


def frames_bytes(frames: list) -> int:
    """The bytes of the hop's buffer that carries ``frames`` (table and padding included)."""
    return _offsets([f.nbytes for f in frames])[1]


def _join(frames: list) -> torch.Tensor:
    """Source: the frame table and the frames in one uint8 tensor (each frame copied once)."""
    sizes = [f.nbytes for f in frames]
    starts, total = _offsets(sizes)
    table = struct.pack(f"<{1 + len(frames)}q", len(frames), *sizes)
    out = np.zeros(total, dtype=np.uint8)
    out[: len(table)] = np.frombuffer(table, dtype=np.uint8)
    for f, at in zip(frames, starts):
        out[at : at + f.nbytes] = np.frombuffer(f, dtype=np.uint8)
    WORK["copied_bytes"] += sum(sizes)
    return torch.from_numpy(out)


def _split(buf: torch.Tensor, rank: int) -> list[memoryview]:
    """Receiver: the frames in ``buf`` as views of it; a table that does not fit ``buf`` is
    refused naming this rank and what it expected."""
    raw = memoryview(buf.numpy())
    total = len(raw)
    count = struct.unpack_from("<q", raw, 0)[0] if total >= 8 else -1
    if not 1 <= count <= MAX_FRAMES or 8 * (1 + count) > total:
        raise ContractError(
            f"rank {rank}: pickled: a hop's frame table claims {count} frames in {total} bytes; "
            f"expected 1 to {MAX_FRAMES} frames whose table fits the buffer"
        )
    sizes = struct.unpack_from(f"<{count}q", raw, 8)
    if min(sizes) < 0 or _offsets(sizes)[1] != total:
        raise ContractError(
            f"rank {rank}: pickled: a hop's frames need {_offsets(sizes)[1]} bytes with their "
            f"padding; the buffer holds {total}"
        )
    return [raw[at : at + n] for at, n in zip(_offsets(sizes)[0], sizes)]


def _on(group) -> torch.device:
    """Where a hop's tensors go: the current CUDA device for NCCL (as broadcast_object_list)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send(obj, serialization: str, group) -> tuple[Exception, ShippedFailure] | None:
    """A hop's source: ``obj`` by ``serialization``, as the size then the buffer. None once
    sent; if serializing fails, a ShippedFailure goes in its place and (the error, that failure)
    is returned, as ``strategies.core.contract.send_or_failure`` does."""
    failed = None
    try:
        frames = dumps(obj, serialization)
    except Exception as exc:  # noqa: BLE001 -- any type: it travels to the receivers
        failed = (exc, ShippedFailure(failure_text(exc)))
        frames = [memoryview(pickle.dumps(failed[1]))]
    buf = _join(frames)
    device = _on(group)
    src = dist.get_process_group_ranks(group)[0]
    dist.broadcast(torch.tensor([buf.numel()], dtype=torch.int64, device=device), src, group)
    dist.broadcast(buf.to(device), src, group)
    return failed


def receive(group, rank: int, max_bytes: int):
    """A hop's receiver: the object the source sent (a ShippedFailure included)."""
    device = _on(group)
    src = dist.get_process_group_ranks(group)[0]
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group)
    total = int(size.item())  # the host sync broadcast_object_list has too
    if not 8 <= total <= max_bytes:
        raise ContractError(
            f"rank {rank}: pickled: rank {src} announced a hop of {total} bytes; expected 8 to "
            f"max_bytes={max_bytes}"
        )
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src, group)
    inband, *buffers = _split(buf.cpu(), rank)
    obj = pickle.loads(inband, buffers=buffers)
    WORK["unpickled_bytes"] += inband.nbytes
    return obj
