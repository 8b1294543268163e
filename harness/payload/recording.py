"""A batch a real client saved, as the payload (``payload=file payload.path=...``): loaded
safely, turned into this project's ``DataProto`` and resampled to ``payload.batch_size`` rows.

Formats read:
- a verl ``DataProto.save_to_disk`` file (a plain pickle of verl's class, whose state holds the
  batch as ``torch.save`` bytes): read by a restricted unpickler that knows verl's state layout,
  so verl need not be importable;
- a ``torch.save`` file of a ``TensorDict``, of a verl-style batch, or of this project's
  ``DataProto`` (``save`` below writes one);
- a ``TensorDict.memmap`` directory (``meta.json`` + one file per leaf), read by this module's
  own reader (``harness.payload.memmap_reader``), not by ``TensorDict.load_memmap``.

Safe by default, the same way for every command that reads a recording (``bcastbench run``,
``bcastbench schema``, the pytest plugin's leaders): no pickle runs beyond numpy's array
rebuilders, this project's ``DataProto`` and verl's state layout unless the user passes the
trust flag; a file that needs another class is refused, naming it and that command's flag
(``harness.payload.safe_unpickling``). Recordings are opened read-only; only regular files and
directories are read (a FIFO, device or socket is refused unopened); every size a file claims
is checked against the file and against ``max_bytes`` before anything is allocated. Every
failure is a ``PayloadFileError`` (``harness.payload.user_files``) with one line saying what is
wrong and what would work.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase

from harness.files import write_atomic
from harness.payload.memmap_reader import read_memmap
from harness.payload.safe_unpickling import read_pickle, torch_load
from harness.payload.user_files import (
    RUN_FLAGS,
    Flags,
    PayloadFileError,
    ReadPolicy,
    default_max_bytes,
    file_kind,
    one_line,
    open_regular,
)
from strategies import NON_TENSOR_FLAG, DataProto
from strategies.core.contract import leaves

FORMATS = (
    "a torch.save file (TensorDict or DataProto), a TensorDict.memmap directory, "
    "or a verl DataProto.save_to_disk file"
)


# -- the loader --------------------------------------------------------------------------------
def _read(path: Path, policy: ReadPolicy, batch_size: int | None):
    """The object stored at ``path``, read by the safe route its format allows."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise PayloadFileError(f"no such file or directory: {path}") from None
    if stat.S_ISDIR(st.st_mode):
        if not os.path.lexists(path / "meta.json"):
            raise PayloadFileError(
                f"directory {path} is not a TensorDict.memmap directory (no meta.json); "
                f"expected {FORMATS}"
            )
        return read_memmap(path, policy, batch_size)
    if not stat.S_ISREG(st.st_mode):
        raise PayloadFileError(
            f"{path} is {file_kind(st.st_mode)}; a recording is a regular file or a directory"
        )
    if st.st_size > policy.max_bytes:
        raise PayloadFileError(f"{path} is {st.st_size:,} bytes > {policy.limit}")
    with open_regular(path, st.st_size) as f:
        # torch.save writes a zip; a pickle that embeds one (verl's) passes is_zipfile, so
        # the first bytes decide.
        if f.read(4) == b"PK\x03\x04":
            f.seek(0)
            return torch_load(f, st.st_size, str(path), policy)
    return read_pickle(path, st.st_size, policy)


def load(
    path: str | Path,
    trust: bool = False,
    *,
    max_bytes: int | None = None,
    batch_size: int | None = None,
    flags: Flags = RUN_FLAGS,
) -> DataProto:
    """The batch at ``path`` as a ``DataProto`` with a leading batch dimension B, checked.

    ``max_bytes`` (default ``default_max_bytes()``) bounds the recording and, when
    ``batch_size`` is given, the batch resampled to it. Raises PayloadFileError (one line,
    naming ``flags``' options) for a missing, unreadable, unsafe, oversized or shapeless file."""
    policy = ReadPolicy(bool(trust), default_max_bytes() if max_bytes is None else max_bytes, flags)
    path = Path(path).expanduser()
    try:
        # A hostile file must cost one line: torch's and tensordict's warnings about what they
        # were handed would print more.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dp = _as_dataproto(_read(path, policy, batch_size), path)
            _check_bytes(dp, batch_size, policy, path)
    except PayloadFileError as exc:
        raise PayloadFileError(one_line(f"{flags.prefix}{exc}")) from None
    except Exception as exc:  # noqa: BLE001 - any reader's failure is a bad file, said once
        raise _unreadable(path, exc, flags) from None
    return dp


def _unreadable(path: Path, exc: BaseException, flags: Flags) -> PayloadFileError:
    first = one_line((str(exc).strip().splitlines() or [""])[0])[:200]
    return PayloadFileError(
        one_line(
            f"{flags.prefix}{path} is not a batch bcastbench can read "
            f"({type(exc).__name__}: {first}); expected {FORMATS}"
        )
    )


def _as_dataproto(obj, path: Path) -> DataProto:
    if isinstance(obj, TensorDictBase):
        obj = DataProto(obj, {}, {})
    elif isinstance(obj, dict) and "batch" in obj:
        obj = DataProto(obj["batch"], obj.get("non_tensor_batch") or {}, obj.get("meta_info") or {})
    if not all(hasattr(obj, a) for a in ("batch", "non_tensor_batch", "meta_info")):
        raise PayloadFileError(
            f"{path} holds a {type(obj).__name__}, not a batch; expected {FORMATS}"
        )
    batch = obj.batch
    if not isinstance(batch, TensorDictBase) or len(batch.batch_size) == 0:
        shape = list(batch.batch_size) if isinstance(batch, TensorDictBase) else type(batch)
        raise PayloadFileError(
            f"{path} has no leading batch dimension (batch: {shape}); a payload "
            "needs a TensorDict with batch_size=[B, ...]"
        )
    rows = batch.batch_size[0]
    if rows < 1:
        raise PayloadFileError(f"{path} has no rows (batch_size {list(batch.batch_size)})")
    if not isinstance(obj.non_tensor_batch, dict) or not isinstance(obj.meta_info, dict):
        raise PayloadFileError(f"{path}: non_tensor_batch and meta_info must be dicts")
    for key, value in obj.non_tensor_batch.items():
        rows_of = isinstance(value, list | tuple) or (isinstance(value, np.ndarray) and value.ndim)
        if not rows_of:
            raise PayloadFileError(
                f"{path}: non_tensor_batch[{key!r}] is a {type(value).__name__}, not one "
                "item per row"
            )
        if len(value) != rows:
            raise PayloadFileError(
                f"{path}: non_tensor_batch[{key!r}] has {len(value)} rows but the batch has {rows}"
            )
    return DataProto(batch, dict(obj.non_tensor_batch), dict(obj.meta_info))


# -- sizes -------------------------------------------------------------------------------------
def _object_bytes(obj, seen: set[int]) -> int:
    """What a non-tensor value holds, each object counted once (a pickle can share one list
    a million times; counting it each time would take as long)."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, str | bytes | bytearray):
        return len(obj) + 8
    if isinstance(obj, np.ndarray):
        if obj.dtype != object:
            return obj.nbytes
        return obj.nbytes + sum(_object_bytes(x, seen) for x in obj.reshape(-1).tolist())
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
        return 8 * len(items) + sum(_object_bytes(x, seen) for x in items)
    if isinstance(obj, list | tuple | set | frozenset):
        return 8 * len(obj) + sum(_object_bytes(x, seen) for x in obj)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return 8


def batch_bytes(dp: DataProto) -> int:
    """Bytes ``dp`` holds, by its shapes (an expanded view counts as what a copy would take):
    every tensor leaf, every non-tensor leaf and array."""
    seen: set[int] = set()
    total = 0
    for _, value in leaves(dp.batch):
        if isinstance(value, NonTensorData):
            total += _object_bytes(value.data, seen)
        elif isinstance(value, NonTensorStack):
            total += _object_bytes(value.tolist(), seen)
        else:
            total += value.numel() * value.element_size()
    return total + sum(_object_bytes(v, seen) for v in dp.non_tensor_batch.values())


def _check_bytes(dp: DataProto, batch_size: int | None, policy: ReadPolicy, path: Path) -> None:
    rows = dp.batch.batch_size[0]
    row_bytes = -(-batch_bytes(dp) // rows)
    problem = policy.too_big(f"{path} holds", rows, row_bytes)
    if problem is None and batch_size is not None:
        problem = policy.too_big(f"{path}: payload.batch_size", batch_size, row_bytes)
    if problem is not None:
        raise PayloadFileError(problem)


def seq_len_of(dp: DataProto) -> int | None:
    """The batch's real sequence length: the widest 2-D leaf's second dimension (a jagged
    [B, j] leaf counts its longest row); None when no leaf is 2-D."""
    widths = []
    for _, value in leaves(dp.batch):
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            continue
        if value.is_nested:
            rows = value.unbind(0)
            widths.append(max((int(r.shape[0]) for r in rows), default=0))
        else:
            widths.append(int(value.shape[1]))
    return max(widths, default=None)


# -- the payload -------------------------------------------------------------------------------
def resample(dp: DataProto, batch_size: int) -> DataProto:
    """``batch_size`` rows: the recording's rows repeated in order, or its first ones."""
    rows = dp.batch.batch_size[0]
    if batch_size == rows:
        return dp
    index = torch.arange(batch_size) % rows
    non_tensor = {k: np.asarray(v)[index.numpy()] for k, v in dp.non_tensor_batch.items()}
    return DataProto(dp.batch[index], non_tensor, dict(dp.meta_info))


def make(
    path: str,
    batch_size: int,
    trust: bool = False,
    broadcast_non_tensor: bool | None = None,
    max_bytes: int | None = None,
) -> DataProto:
    """The payload of ``payload=file``: load, resample, set the non-tensor flag if asked."""
    loaded = load(path, trust, max_bytes=max_bytes, batch_size=batch_size)
    dp = resample(loaded, batch_size)
    if broadcast_non_tensor is not None:
        dp.meta_info[NON_TENSOR_FLAG] = broadcast_non_tensor
    return dp


def save(dp: DataProto, path: str | Path) -> Path:
    """This project's own recording: ``torch.save`` of a ``DataProto`` (read back safely)."""
    return write_atomic(path, lambda f: torch.save(dp, f))
