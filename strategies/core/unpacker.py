"""Unpacking a received message: every entry as a zero-copy view of the buffer, jagged leaves
rebuilt from their parts, pickled leaves and the non-tensor blob unpickled.
"""

from __future__ import annotations

import pickle

import numpy as np
import torch
from tensordict import TensorDict

from strategies.core.header_format import (
    DIRECT,
    ITEMSIZE,
    KIND_DENSE,
    KIND_LENGTHS,
    KIND_OBJECT,
    KIND_OFFSETS,
    KIND_VALUES,
    Entry,
    Header,
)
from strategies.core.parts import decode_non_tensor
from strategies.core.recent import remember
from strategies.core.trace import WORK


def _assemble(entry: Entry, t: torch.Tensor, pending: dict):
    """The leaf an entry completes, or None while a jagged leaf still waits for its offsets
    (its last part); ``pending`` keeps its parts meanwhile."""
    if entry.kind == KIND_DENSE:
        return t
    if entry.kind == KIND_OBJECT:
        WORK["unpickled_bytes"] += entry.nbytes
        return pickle.loads(t.cpu().numpy().tobytes())
    pending[entry.kind] = t
    if entry.kind == KIND_VALUES:
        pending["ragged"] = entry.aux
    if entry.kind != KIND_OFFSETS:
        return None
    return _jagged(pending)


def _jagged(pending: dict) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(
        pending[KIND_VALUES],
        pending[KIND_OFFSETS],
        lengths=pending.get(KIND_LENGTHS),
        jagged_dim=pending["ragged"],
    )


def unpack(
    buf: torch.Tensor,
    header: Header,
    td_device: torch.device | None = None,
    direct: list[torch.Tensor] = (),
) -> tuple[TensorDict, dict[str, np.ndarray] | None]:
    """Zero-copy views of every tensor in ``buf``; the non-tensor blob is unpickled. Entries
    at offset DIRECT take the tensors in ``direct``, in order."""
    return unpack_tensors(buf, header, td_device, direct), unpack_non_tensor(buf, header)


def unpack_tensors(
    buf: torch.Tensor,
    header: Header,
    td_device: torch.device | None = None,
    direct: list[torch.Tensor] = (),
) -> TensorDict:
    """``unpack``'s TensorDict alone. For a header whose entries are all dense it reads no
    byte of ``buf`` (views only), so it can be built before the message is written."""
    data = buf[header.header_len : header.total_bytes]
    views = _views(data, header)
    received = iter(direct)
    nested: dict = {}
    flat = True
    jagged: dict = {}  # key -> parts of a jagged leaf seen so far
    for e, t in zip(header.entries, views):
        if t is None:
            t = next(received)
        node = nested
        for part in e.key[:-1]:
            node = node.setdefault(part, {})
            flat = False
        if e.kind != KIND_DENSE:
            flat = False
            t = _assemble(e, t, jagged.setdefault(e.key, {}))
            if t is None:
                continue
        node[e.key[-1]] = t
    if flat and td_device is None:
        # The header was validated above: skip TensorDict's per-key checks, the slow part.
        return TensorDict._new_unsafe(nested, batch_size=torch.Size(header.batch_size))
    return TensorDict(nested, batch_size=list(header.batch_size), device=td_device)


def unpack_non_tensor(
    buf: torch.Tensor, header: Header, host: memoryview | None = None
) -> dict[str, np.ndarray] | None:
    """``unpack``'s non-tensor batch (None when the message carries none); ``host``: the
    buffer's bytes when the caller has them already (read in place, no tensor sliced)."""
    if header.non_tensor is None:
        return None
    off, n = header.non_tensor
    at = header.header_len + off
    if host is not None:
        raw = host[at : at + n]
    else:
        blob = buf[at : at + n]
        raw = blob.numpy() if blob.device.type == "cpu" else blob.cpu().numpy()
    WORK["unpickled_bytes"] += n
    return decode_non_tensor(raw)


def _views(data: torch.Tensor, header: Header) -> list[torch.Tensor | None]:
    """Every packed entry as a view of ``data`` (None for entries sent on their own): one
    typed view of the region per dtype, then one ``as_strided`` per entry. Offsets are
    64-byte aligned and the region's length too, so every dtype divides both."""
    typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
    out: list[torch.Tensor | None] = []
    for dtype, shape, strides, offset in _view_plan(header):
        if dtype is None:
            out.append(None)
            continue
        base = typed.get(dtype)
        if base is None:
            view = data.view(dtype)
            base = typed[dtype] = (view, view.storage_offset())
        out.append(base[0].as_strided(shape, strides, base[1] + offset))
    return out


def _view_plan(header: Header) -> list[tuple]:
    """Per entry: (dtype, shape, contiguous strides, offset in elements), or Nones for an
    entry sent on its own; cached for the last ``RECENT_SHAPES`` headers (``read_header``
    hands back the same Header object for a shape it decoded recently)."""
    cached = _PLANS.get(id(header))
    if cached is not None and cached[0] is header:
        return cached[1]
    plan = []
    for e in header.entries:
        if e.offset == DIRECT:
            plan.append((None, None, None, None))
            continue
        strides, step = [], 1
        for d in reversed(e.shape):
            strides.append(step)
            step *= max(d, 1)
        plan.append(
            (e.dtype, tuple(e.shape), tuple(reversed(strides)), e.offset // ITEMSIZE[e.dtype])
        )
    remember(_PLANS, id(header), (header, plan))  # the header held keeps its id unique
    return plan


_PLANS: dict = {}
