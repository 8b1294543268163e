"""A batch a real client saved, as the payload (``payload=file payload.path=...``): loaded
safely, turned into this project's ``DataProto`` and resampled to ``payload.batch_size`` rows.

Formats read:
- a verl ``DataProto.save_to_disk`` file (a plain pickle of verl's class, whose state holds the
  batch as ``torch.save`` bytes): read by a restricted unpickler that knows verl's state layout,
  so verl need not be importable;
- a ``torch.save`` file of a ``TensorDict``, of a verl-style batch, or of this project's
  ``DataProto`` (``save`` below writes one);
- a ``TensorDict.memmap`` directory (``meta.json`` + one file per leaf).

Safe by default: ``torch.load(weights_only=True)`` with only numpy's array rebuilders and this
project's ``DataProto`` added, a pickle reader that allows the same names, or a memmap; a file
that needs any other class is refused, naming it, unless ``trust=True`` (``payload.trust=true``)
lifts the allow-list. Every failure is a ``PayloadFileError`` with one line saying what is wrong
and what would work.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from harness.files import write_atomic
from strategies import NON_TENSOR_FLAG, DataProto

TRUST_HINT = "if you trust this file, add payload.trust=true (it may run code when loaded)"
FORMATS = (
    "a torch.save file (TensorDict or DataProto), a TensorDict.memmap directory, "
    "or a verl DataProto.save_to_disk file"
)
_NUMPY_REBUILD = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "scalar"),
}
"""What a pickled numpy array (object arrays of strings included) needs to be rebuilt."""


class PayloadFileError(ValueError):
    """A recorded batch that cannot be used; raised before any rank starts."""


class _VerlState:
    """Stands in for ``verl.protocol.DataProto`` while unpickling: keeps the state verl's
    ``__getstate__`` wrote (batch as torch.save bytes, non_tensor_batch, meta_info)."""

    def __setstate__(self, state) -> None:
        self.state = state


class _SafeUnpickler(pickle.Unpickler):
    """Plain pickle restricted to numpy's array rebuilders and verl's DataProto (as state)."""

    def __init__(self, file, trust: bool) -> None:
        super().__init__(file)
        self.trust = trust

    def find_class(self, module: str, name: str):
        if (module, name) == ("verl.protocol", "DataProto"):
            return _VerlState
        if (module, name) in _NUMPY_REBUILD or (module, name) == ("copyreg", "_reconstructor"):
            return super().find_class(module, name)
        if module == "builtins" and name in ("object", "set", "frozenset", "complex", "slice"):
            return super().find_class(module, name)
        if self.trust:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"needs {module}.{name}")


def _safe_globals() -> list:
    found = [DataProto, np.ndarray, np.dtype, type(np.dtype(object))]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            found.append(__import__(module, fromlist=["_reconstruct"])._reconstruct)
            break
        except (ImportError, AttributeError):
            continue
    return found


def _torch_load(source, trust: bool):
    if trust:
        return torch.load(source, weights_only=False, map_location="cpu")
    with torch.serialization.safe_globals(_safe_globals()), warnings.catch_warnings():
        # verl pickles its batch with protocol 4, which the weights-only reader warns about
        # and reads.
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        return torch.load(source, weights_only=True, map_location="cpu")


def _read(path: Path, trust: bool):
    """The object stored at ``path``, read by the safe route its format allows."""
    if path.is_dir():
        if not (path / "meta.json").exists():
            raise PayloadFileError(
                f"payload.path: directory {path} is not a TensorDict.memmap directory "
                f"(no meta.json); expected {FORMATS}"
            )
        return TensorDict.load_memmap(path)
    with path.open("rb") as f:
        # torch.save writes a zip; a pickle that embeds one (verl's) passes is_zipfile, so
        # the first bytes decide.
        is_zip = f.read(4) == b"PK\x03\x04"
    if is_zip:
        return _torch_load(path, trust)
    with path.open("rb") as f:
        obj = _SafeUnpickler(f, trust).load()
    if isinstance(obj, _VerlState):
        batch_bytes, non_tensor, meta = obj.state
        if not isinstance(batch_bytes, bytes | None):
            raise PayloadFileError(
                f"payload.path: {path} is a verl DataProto saved with "
                "VERL_DATAPROTO_SERIALIZATION_METHOD=numpy, which is not read; save it with "
                "verl's default serialization"
            )
        batch = _torch_load(io.BytesIO(batch_bytes), trust) if batch_bytes else None
        return DataProto(batch, dict(non_tensor or {}), dict(meta or {}))
    return obj


def load(path: str | Path, trust: bool = False) -> DataProto:
    """The batch at ``path`` as a ``DataProto`` with a leading batch dimension B, checked.
    Raises PayloadFileError (one line) for a missing, unreadable, unsafe or shapeless file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise PayloadFileError(f"payload.path: no such file or directory: {path}")
    try:
        obj = _read(path, trust)
    except PayloadFileError:
        raise
    except pickle.UnpicklingError as exc:
        what = str(exc)
        if what.startswith("needs ") or "Unsupported global" in what:
            need = what[len("needs ") :] if what.startswith("needs ") else _global_named(what)
            raise PayloadFileError(
                f"payload.path: {path} needs {need} to load, which safe loading does not "
                f"allow; {TRUST_HINT}"
            ) from None
        raise _unreadable(path, exc) from None
    except Exception as exc:  # noqa: BLE001 - any reader's failure is a bad file, said once
        raise _unreadable(path, exc) from None
    return _as_dataproto(obj, path)


def _global_named(text: str) -> str:
    """The class torch's weights-only reader refused, out of its long message."""
    marker = "Unsupported global: GLOBAL "
    if marker in text:
        return text.split(marker, 1)[1].split()[0].rstrip(".,")
    return "a class outside the allow-list"


def _unreadable(path: Path, exc: BaseException) -> PayloadFileError:
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return PayloadFileError(
        f"payload.path: {path} is not a batch bcastbench can read "
        f"({type(exc).__name__}: {first}); expected {FORMATS}"
    )


def _as_dataproto(obj, path: Path) -> DataProto:
    if isinstance(obj, TensorDictBase):
        obj = DataProto(obj, {}, {})
    elif isinstance(obj, dict) and "batch" in obj:
        obj = DataProto(obj["batch"], obj.get("non_tensor_batch") or {}, obj.get("meta_info") or {})
    if not all(hasattr(obj, a) for a in ("batch", "non_tensor_batch", "meta_info")):
        raise PayloadFileError(
            f"payload.path: {path} holds a {type(obj).__name__}, not a batch; expected {FORMATS}"
        )
    batch = obj.batch
    if not isinstance(batch, TensorDictBase) or len(batch.batch_size) == 0:
        shape = list(batch.batch_size) if isinstance(batch, TensorDictBase) else type(batch)
        raise PayloadFileError(
            f"payload.path: {path} has no leading batch dimension (batch: {shape}); a payload "
            "needs a TensorDict with batch_size=[B, ...]"
        )
    rows = batch.batch_size[0]
    for key, value in obj.non_tensor_batch.items():
        if len(value) != rows:
            raise PayloadFileError(
                f"payload.path: {path}: non_tensor_batch[{key!r}] has {len(value)} rows but "
                f"the batch has {rows}"
            )
    return DataProto(batch, dict(obj.non_tensor_batch), dict(obj.meta_info))


def resample(dp: DataProto, batch_size: int) -> DataProto:
    """``batch_size`` rows: the recording's rows repeated in order, or its first ones."""
    rows = dp.batch.batch_size[0]
    if batch_size == rows:
        return dp
    index = torch.arange(batch_size) % rows
    non_tensor = {k: np.asarray(v)[index.numpy()] for k, v in dp.non_tensor_batch.items()}
    return DataProto(dp.batch[index], non_tensor, dict(dp.meta_info))


def make(
    path: str, batch_size: int, trust: bool = False, broadcast_non_tensor: bool | None = None
) -> DataProto:
    """The payload of ``payload=file``: load, resample, set the non-tensor flag if asked."""
    dp = resample(load(path, trust), batch_size)
    if broadcast_non_tensor is not None:
        dp.meta_info[NON_TENSOR_FLAG] = broadcast_non_tensor
    return dp


def save(dp: DataProto, path: str | Path) -> Path:
    """This project's own recording: ``torch.save`` of a ``DataProto`` (read back safely)."""
    return write_atomic(path, lambda f: torch.save(dp, f))
