"""Pickled recordings read without running their code: a restricted unpickler (plain pickles,
verl's save_to_disk), torch's weights-only load after its zip is checked, refusals named."""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import zipfile
from pathlib import Path

import numpy as np
import torch

from harness.payload.user_files import (
    PayloadFileError,
    ReadPolicy,
    one_line,
    read_bytes,
    trust_hint,
)
from strategies import DataProto

_NUMPY_REBUILD = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "scalar"),
}
"""What a pickled numpy array (object arrays of strings included) needs to be rebuilt."""


# -- the restricted unpickler ------------------------------------------------------------------
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


def unpickle(data: bytes, policy: ReadPolicy, where: str):
    """A pickle's object from bytes already read (so a length the pickle claims can never make
    the reader allocate past the file); a global the policy does not allow is refused, naming
    it and ``where`` the pickle was."""
    try:
        return _SafeUnpickler(io.BytesIO(data), policy.trust).load()
    except pickle.UnpicklingError as exc:
        need = _refused_global(exc) if str(exc).startswith("needs ") else None
        if need is None:
            raise
        raise _needs(where, need, policy) from None


def _refused_global(exc: BaseException) -> str | None:
    """The class a refusing unpickler named: ours says ``needs X``; torch's weights-only reader
    names it in one of a few phrasings inside a long message."""
    text = str(exc)
    if text.startswith("needs "):
        return text[len("needs ") :]
    for pattern in (r"GLOBAL ([\w.]+)", r"unrecognized function ([\w.]+)", r"class ([\w.]+)"):
        found = re.search(pattern, text)
        if found:
            return found.group(1).rstrip(".")
    return None


_STRING_OPS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
               "SHORT_BINUNICODE", "BINUNICODE8"}  # fmt: skip


def pickle_globals(data: bytes) -> list[str]:
    """The ``module.name`` globals a pickle refers to, read from its opcodes without running
    it (as far as the bytes parse): what it would import and call."""
    found, memo, pushed, last = [], {}, [], None
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL" or op.name == "INST":
                found.append(".".join(str(arg).split(" ", 1)))
            elif op.name == "STACK_GLOBAL" and len(pushed) >= 2:
                found.append(f"{pushed[-2]}.{pushed[-1]}")
            if op.name in _STRING_OPS:
                last = arg if isinstance(arg, str) else None
            elif op.name in ("BINGET", "LONG_BINGET", "GET"):
                last = memo.get(int(arg))
            elif op.name in ("MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
                memo[len(memo) if op.name == "MEMOIZE" else int(arg)] = last
                continue
            else:
                last = None
            pushed = (pushed + [last])[-2:]
    except Exception:  # noqa: BLE001, S110 - garbage after the globals read so far
        pass
    return found


def _named_in(pickled: bytes, said: str | None) -> str | None:
    """The global a refusal is about: the pickle's own ``module.name`` for the (often bare) name
    torch's message gave, or, when it gave none, the pickle's first global outside torch's."""
    names = pickle_globals(pickled)
    if said is not None:
        return next((g for g in names if g == said or g.endswith(f".{said}")), said)
    own = ("torch.", "collections.", "tensordict.", "strategies.", "numpy.", "_codecs.")
    return next((g for g in names if not g.startswith(own)), None)


def _weights_only_reason(exc: BaseException) -> str:
    """torch's weights-only refusal without its boilerplate: the line that says what failed."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    boiler = ("Weights only load failed", "Check the documentation", "(1)", "(2)")
    useful = [line for line in lines if not line.startswith(boiler)]
    return (useful or lines or [type(exc).__name__])[0].removeprefix("WeightsUnpickler error: ")


# -- torch.save files --------------------------------------------------------------------------
def _safe_globals() -> list:
    found = [DataProto, np.ndarray, np.dtype, type(np.dtype(object))]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            found.append(__import__(module, fromlist=["_reconstruct"])._reconstruct)
            break
        except (ImportError, AttributeError):
            continue
    return found


def _check_zip(source, size: int, where: str, policy: ReadPolicy) -> bytes:
    """A torch.save zip, complete and within the byte limit, checked from its directory of
    entries before torch reads any of it; its pickle (``*/data.pkl``), read and checked against
    its CRC, so a damaged one is said to be damaged and a refusal can name its globals."""
    try:
        archive = zipfile.ZipFile(source)
        entries = archive.infolist()
    except Exception as exc:  # noqa: BLE001 - a damaged zip fails in many ways, all the same
        raise PayloadFileError(
            f"{where} is a truncated or corrupt torch.save file ({size:,} bytes; starts as a "
            f"zip but {one_line(exc) or type(exc).__name__}): a torch.save file is a complete "
            "zip whose directory of entries ends the file; copy or save it again"
        ) from None
    storages = 0
    for info in entries:
        if info.header_offset + info.compress_size > size:
            raise PayloadFileError(
                f"{where} is a truncated or corrupt torch.save file: entry {info.filename!r} "
                f"ends past the file's {size:,} bytes; copy or save it again"
            )
        if info.compress_type != zipfile.ZIP_STORED:
            raise PayloadFileError(
                f"{where}: entry {info.filename!r} is compressed, which torch.save never "
                "writes; save the batch with torch.save"
            )
        storages += info.file_size
    if storages > policy.max_bytes:
        raise PayloadFileError(f"{where}: its zip entries hold {storages:,} bytes > {policy.limit}")
    name = next((e.filename for e in entries if e.filename.endswith("data.pkl")), None)
    try:
        pickled = archive.read(name) if name is not None else b""
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise PayloadFileError(
            f"{where} is a corrupt torch.save file ({one_line(exc)}); copy or save it again"
        ) from None
    source.seek(0)
    return pickled


def torch_load(source, size: int, where: str, policy: ReadPolicy):
    """A torch.save file's object: its zip checked first (``_check_zip``), then read by torch's
    weights-only reader with only ``_safe_globals`` allowed, unless the policy trusts it."""
    pickled = _check_zip(source, size, where, policy)
    if policy.trust:
        return torch.load(source, weights_only=False, map_location="cpu")
    with torch.serialization.safe_globals(_safe_globals()):
        try:
            return torch.load(source, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as exc:
            need = _named_in(pickled, _refused_global(exc))
            if need is None:
                raise PayloadFileError(
                    f"{where}: safe loading cannot read it (torch's weights-only reader: "
                    f"{_weights_only_reason(exc)}); {trust_hint(policy.flags)}"
                ) from None
            raise _needs(where, need, policy) from None


def _needs(where: str, need: str, policy: ReadPolicy) -> PayloadFileError:
    return PayloadFileError(
        f"{where} needs {need} to load, which safe loading does not allow; "
        f"{trust_hint(policy.flags)}"
    )


# -- plain pickles (verl's save_to_disk) -------------------------------------------------------
def read_pickle(path: Path, size: int, policy: ReadPolicy):
    """A plain pickle's object; a verl DataProto's state made into this project's DataProto
    (its batch a torch.save file of its own, read as one)."""
    data = read_bytes(path, size)
    if b"bcastbench.schema/" in data[:4096]:
        raise PayloadFileError(
            f"{path} is a bcastbench schema, not a recorded batch: replay it with payload=schema"
        )
    obj = unpickle(data, policy, str(path))
    if not isinstance(obj, _VerlState):
        return obj
    if not (isinstance(obj.state, tuple | list) and len(obj.state) == 3):
        raise PayloadFileError(f"{path}: a verl DataProto whose state is not (batch, ...)")
    batch_bytes, non_tensor, meta = obj.state
    if not isinstance(batch_bytes, bytes | None):
        raise PayloadFileError(
            f"{path} is a verl DataProto saved with VERL_DATAPROTO_SERIALIZATION_METHOD=numpy, "
            "which is not read; save it with verl's default serialization"
        )
    batch = None
    if batch_bytes:
        batch = torch_load(io.BytesIO(batch_bytes), len(batch_bytes), f"{path}'s batch", policy)
    if not isinstance(non_tensor, dict | None) or not isinstance(meta, dict | None):
        raise PayloadFileError(f"{path}: verl's non_tensor_batch and meta_info must be dicts")
    return DataProto(batch, dict(non_tensor or {}), dict(meta or {}))
