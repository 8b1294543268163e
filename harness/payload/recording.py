"""A batch a real client saved, as the payload (``payload=file payload.path=...``): loaded
safely, turned into this project's ``DataProto`` and resampled to ``payload.batch_size`` rows.

Formats read:
- a verl ``DataProto.save_to_disk`` file (a plain pickle of verl's class, whose state holds the
  batch as ``torch.save`` bytes): read by a restricted unpickler that knows verl's state layout,
  so verl need not be importable;
- a ``torch.save`` file of a ``TensorDict``, of a verl-style batch, or of this project's
  ``DataProto`` (``save`` below writes one);
- a ``TensorDict.memmap`` directory (``meta.json`` + one file per leaf), read by this module's
  own reader (``_MemmapDir``), not by ``TensorDict.load_memmap``.

Safe by default, the same way for every command that reads a recording (``bcastbench run``,
``bcastbench schema``, the pytest plugin's leaders): no pickle runs beyond numpy's array
rebuilders, this project's ``DataProto`` and verl's state layout unless the user passes the
trust flag; a file that needs another class is refused, naming it and that command's flag.
Recordings are opened read-only; only regular files and directories are read (a FIFO, device
or socket is refused unopened); every size a file claims is checked against the file and
against ``max_bytes`` before anything is allocated. Every failure is a ``PayloadFileError``
with one line saying what is wrong and what would work.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import stat
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from harness.files import write_atomic
from strategies import NON_TENSOR_FLAG, DataProto
from strategies.core.contract import leaves

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

DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in DTYPE_NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
"""The tensor dtypes a recording or a schema may name (``torch.<name>``), and no other
attribute of ``torch``."""

MAX_DEPTH = 32
"""Deepest nesting of keys (TensorDicts inside TensorDicts) read from a file or a schema."""
MAX_LEAVES = 10_000
"""Most leaves (and nested TensorDicts) one recording or schema may hold."""
MAX_DIMS = 16
"""Most dimensions one leaf may have."""
MAX_META_BYTES = 16 << 20
"""Largest ``meta.json`` read from a memmap directory (they hold shapes and small values)."""


class PayloadFileError(ValueError):
    """A recorded batch that cannot be used; raised before any rank starts."""


@dataclass(frozen=True)
class Flags:
    """How the command reading a recording spells its options, so a refusal names the one to
    type: ``bcastbench run`` takes ``payload.*`` overrides, ``bcastbench schema`` its flags."""

    prefix: str = "payload.path: "
    """Starts every message (the option that named the file)."""
    trust: str = "payload.trust=true"
    """Lifts the allow-list."""
    max_bytes: str = "payload.max_bytes"
    """Raises the byte limit."""


RUN_FLAGS = Flags()
SCHEMA_FLAGS = Flags(prefix="", trust="--trust", max_bytes="--max-bytes")


def trust_hint(flags: Flags = RUN_FLAGS) -> str:
    return f"if you trust this file, add {flags.trust} (it may run code when loaded)"


def default_max_bytes() -> int:
    """A quarter of this machine's physical memory: every replica leader on a host holds its
    batch and the strategy's buffers next to the recording being read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (AttributeError, OSError, ValueError):  # no sysconf: a 64 GiB host's quarter
        return 16 << 30


@dataclass(frozen=True)
class _Policy:
    """What one read may do: run pickles (trust), allocate how much, and how to say so."""

    trust: bool
    max_bytes: int
    flags: Flags

    def too_big(self, what: str, rows: int, row_bytes: int) -> str | None:
        total = rows * row_bytes
        if total <= self.max_bytes:
            return None
        return (
            f"{what}: {rows:,} rows × {row_bytes:,} bytes per row = {total:,} bytes > "
            f"{self.flags.max_bytes}={self.max_bytes:,}"
        )


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# -- opening files: regular files only, read-only, sizes checked ---------------------------------
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symlink",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: Path, size: int | None = None, follow: bool = True):
    """``path`` opened read-only as a binary file, after checking (on the open descriptor, so a
    file swapped for a FIFO in between is caught) that it is a regular file of ``size`` bytes.
    O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever. ``follow=False`` for
    a path already resolved and checked: a symlink put there since is refused."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
        os.close(fd)
        what = _kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else f"{st.st_size:,} bytes"
        raise PayloadFileError(f"{path} changed while being read (now {what})")
    return os.fdopen(fd, "rb")


def _read_exact(f, buffer: memoryview, path: Path) -> None:
    got = 0
    while got < len(buffer):
        n = f.readinto(buffer[got:])
        if not n:
            raise PayloadFileError(f"{path} is truncated: {got:,} of {len(buffer):,} bytes read")
        got += n


def _read_bytes(path: Path, size: int, follow: bool = True) -> bytes:
    data = bytearray(size)
    with open_regular(path, size, follow) as f:
        _read_exact(f, memoryview(data), path)
    return bytes(data)


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


def _unpickle(data: bytes, trust: bool):
    """A pickle's object from bytes already read (so a length the pickle claims can never make
    the reader allocate past the file)."""
    return _SafeUnpickler(io.BytesIO(data), trust).load()


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
    import pickletools

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


def _check_zip(source, size: int, where: str, policy: _Policy) -> bytes:
    """A torch.save zip, complete and within the byte limit, checked from its directory of
    entries before torch reads any of it; its pickle (``*/data.pkl``), read and checked against
    its CRC, so a damaged one is said to be damaged and a refusal can name its globals."""
    try:
        archive = zipfile.ZipFile(source)
        entries = archive.infolist()
    except Exception as exc:  # noqa: BLE001 - a damaged zip fails in many ways, all the same
        raise PayloadFileError(
            f"{where} is a truncated or corrupt torch.save file ({size:,} bytes; starts as a "
            f"zip but {_one_line(exc) or type(exc).__name__}): a torch.save file is a complete "
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
        raise PayloadFileError(
            f"{where}: its zip entries hold {storages:,} bytes > "
            f"{policy.flags.max_bytes}={policy.max_bytes:,}"
        )
    name = next((e.filename for e in entries if e.filename.endswith("data.pkl")), None)
    try:
        pickled = archive.read(name) if name is not None else b""
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise PayloadFileError(
            f"{where} is a corrupt torch.save file ({_one_line(exc)}); copy or save it again"
        ) from None
    source.seek(0)
    return pickled


def _torch_load(source, size: int, where: str, policy: _Policy):
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


def _needs(where: str, need: str, policy: _Policy) -> PayloadFileError:
    return PayloadFileError(
        f"{where} needs {need} to load, which safe loading does not allow; "
        f"{trust_hint(policy.flags)}"
    )


# -- plain pickles (verl's save_to_disk) -------------------------------------------------------
def _read_pickle(path: Path, size: int, policy: _Policy):
    data = _read_bytes(path, size)
    if b"bcastbench.schema/" in data[:4096]:
        raise PayloadFileError(
            f"{path} is a bcastbench schema, not a recorded batch: replay it with payload=schema"
        )
    try:
        obj = _unpickle(data, policy.trust)
    except pickle.UnpicklingError as exc:
        need = _refused_global(exc) if str(exc).startswith("needs ") else None
        if need is not None:
            raise _needs(str(path), need, policy) from None
        raise
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
        batch = _torch_load(io.BytesIO(batch_bytes), len(batch_bytes), f"{path}'s batch", policy)
    if not isinstance(non_tensor, dict | None) or not isinstance(meta, dict | None):
        raise PayloadFileError(f"{path}: verl's non_tensor_batch and meta_info must be dicts")
    return DataProto(batch, dict(non_tensor or {}), dict(meta or {}))


# -- TensorDict.memmap directories -------------------------------------------------------------
_FS_UNSAFE = set('/<>:"|?*\\ \0%') | {chr(i) for i in range(32)} | {chr(127)}
_FS_ENCODE = str.maketrans({c: f"%{ord(c):02X}" for c in _FS_UNSAFE})


def _file_key(key: str) -> str:
    """A key's file name as tensordict's robust encoding writes it (``_utils_key_json``)."""
    if not key:
        return "%"
    if key in (".", ".."):
        return "%2E" * len(key)
    return key.translate(_FS_ENCODE)


def _legacy_ok(key: str, collection: bool) -> bool:
    """Whether a key may also be read under its raw name (older tensordict's layout)."""
    if "/" in key or "\\" in key or (len(key) >= 2 and key[0].isalpha() and key[1] == ":"):
        return False
    return not collection or key not in ("", ".", "..")


def _dims(value, where: str) -> list[int]:
    """A shape as written: a list of non-negative ints (never bools, floats or strings)."""
    ok = isinstance(value, list) and len(value) <= MAX_DIMS
    if ok and all(type(d) is int and 0 <= d < 1 << 48 for d in value):
        return list(value)
    raise PayloadFileError(
        f"{where}: shape {str(value)[:80]} is not a list of at most {MAX_DIMS} non-negative "
        "integers"
    )


def _dtype(name, where: str) -> torch.dtype:
    short = name.removeprefix("torch.") if isinstance(name, str) else None
    if short in DTYPES:
        return DTYPES[short]
    raise PayloadFileError(f"{where}: unknown dtype {str(name)[:40]!r}; valid: {', '.join(DTYPES)}")


def _key_name(key: tuple[str, ...]) -> str:
    return ".".join(key) or "<root>"


@dataclass
class _Entry:
    """One thing a memmap directory holds, planned from its meta.json before any data read."""

    key: tuple[str, ...]
    kind: str
    """dict (a nested TensorDict) | tensor | nested (a NestedTensor) | data | stack (non-tensor)"""
    batch: list[int]
    dtype: torch.dtype | None = None
    shape: list[int] = field(default_factory=list)
    rows: list[list[int]] = field(default_factory=list)
    """A NestedTensor's row shapes."""
    file: Path | None = None
    """A tensor's data, or a non-tensor leaf's pickle."""
    nbytes: int = 0
    value: Any = None
    """A non-tensor leaf's JSON data."""


class _MemmapDir:
    """A TensorDict.memmap directory read without tensordict's loader: every meta.json is read as
    JSON and every claim checked (dtype from ``DTYPES``, shapes against the files' sizes, paths
    inside the directory) before one leaf is read; each leaf is then read, read-only, into a
    tensor of its own, so nothing stays mapped and no file can change."""

    def __init__(self, root: Path, policy: _Policy) -> None:
        self.root = Path(os.path.realpath(root))
        self.shown = root
        self.policy = policy
        self.entries: list[_Entry] = []

    def load(self, batch_size: int | None) -> TensorDict:
        self._scan_dict(self.root, (), None, 0)
        total = sum(e.nbytes for e in self.entries)
        if total > self.policy.max_bytes:
            raise PayloadFileError(
                f"{self.shown} holds {total:,} bytes of leaves > "
                f"{self.policy.flags.max_bytes}={self.policy.max_bytes:,}"
            )
        rows = self.entries[0].batch[0] if self.entries[0].batch else 0
        if rows and batch_size:
            problem = self.policy.too_big(
                f"{self.shown}: payload.batch_size", batch_size, -(-total // rows)
            )
            if problem:
                raise PayloadFileError(problem)
        values = {e.key: self._non_tensor(e) for e in self.entries if e.kind in ("data", "stack")}
        td = TensorDict({}, batch_size=self.entries[0].batch)
        for e in self.entries[1:]:
            if e.kind == "dict":
                value = TensorDict({}, batch_size=e.batch)
            elif e.kind in ("data", "stack"):
                value = values[e.key]
            else:
                value = self._tensor(e)
            td.set(e.key, value)
        return td

    # -- planning ------------------------------------------------------------------------------
    def _where(self, path: Path) -> str:
        return (
            str(self.shown / path.relative_to(self.root)) if path != self.root else str(self.shown)
        )

    def _inside(self, path: Path, what: str) -> Path:
        """``path`` with symlinks resolved, refused if that leaves the recording's directory."""
        real = Path(os.path.realpath(path))
        if os.path.commonpath([self.root, real]) != str(self.root):
            raise PayloadFileError(
                f"{self.shown}: {what} {path.name!r} points outside the directory (to {real})"
            )
        return real

    def _find(self, directory: Path, key: str, suffix: str, collection: bool = False):
        """The path a key's file or directory has, inside the tree, or None."""
        names = [_file_key(key) + suffix]
        if _legacy_ok(key, collection) and key + suffix not in names:
            names.append(key + suffix)
        for name in names:
            path = directory / name
            if os.path.lexists(path):
                return self._inside(path, "leaf")
        return None

    def _file_size(self, path: Path, what: str) -> int:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise PayloadFileError(
                f"{self._where(path)} ({what}) is {_kind(st.st_mode)}; only regular files are read"
            )
        return st.st_size

    def _meta(self, directory: Path) -> dict:
        path = directory / "meta.json"
        if not os.path.lexists(path):
            raise PayloadFileError(f"{self._where(directory)} has no meta.json")
        path = self._inside(path, "meta.json")
        size = self._file_size(path, "meta.json")
        if size > MAX_META_BYTES:
            raise PayloadFileError(
                f"{self._where(path)} is {size:,} bytes > {MAX_META_BYTES:,}: not tensordict's"
            )
        try:
            meta = json.loads(_read_bytes(path, size, follow=False))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise PayloadFileError(
                f"{self._where(path)} is not JSON ({_one_line(exc)[:120]})"
            ) from None
        if not isinstance(meta, dict):
            raise PayloadFileError(f"{self._where(path)} is not a JSON object")
        return meta

    def _add(self, entry: _Entry) -> None:
        if len(self.entries) >= MAX_LEAVES:
            raise PayloadFileError(f"{self.shown} holds more than {MAX_LEAVES:,} leaves")
        self.entries.append(entry)

    def _scan_dict(self, directory: Path, key: tuple, parent: list[int] | None, depth: int):
        where = f"{self._where(directory)}/meta.json"
        if depth > MAX_DEPTH:
            raise PayloadFileError(f"{where}: TensorDicts nested more than {MAX_DEPTH} deep")
        meta = self._meta(directory)
        saved = _saved_class(meta)
        if saved != "TensorDict":
            raise PayloadFileError(
                f"{where} saved a {saved}; a memmap recording is read as TensorDicts, "
                "NonTensorData and NonTensorStacks only: save the batch as a TensorDict"
            )
        batch = _dims(meta.get("shape", []), where)
        if parent is not None and batch[: len(parent)] != parent:
            raise PayloadFileError(
                f"{where}: batch size {batch} does not start with its parent's {parent}"
            )
        if parent is None and (not batch or batch[0] < 1):
            raise PayloadFileError(
                f"{where}: batch size {batch} has no rows; a payload needs batch_size=[B, ...]"
            )
        self._add(_Entry(key, "dict", batch))
        for name, entry in meta.items():
            if not isinstance(entry, dict):
                continue  # the TensorDict's own metadata: shape, device, _type, ...
            child = (*key, name)
            if "type" in entry:
                self._scan_collection(directory, child, entry["type"], batch, depth)
            elif "dtype" in entry and "shape" in entry:
                self._scan_tensor(directory, child, entry, batch)
            else:
                raise PayloadFileError(
                    f"{where}: entry {name!r} is neither a tensor (dtype, shape) nor a "
                    "collection (type)"
                )

    def _scan_collection(self, directory: Path, key: tuple, kind, batch: list[int], depth):
        path = self._find(directory, key[-1], "", collection=True)
        where = f"{self._where(directory)}/meta.json: {_key_name(key)}"
        if path is None:
            raise PayloadFileError(f"{where}: its directory is missing")
        if not path.is_dir():
            st = os.stat(path)
            raise PayloadFileError(f"{where}: {path.name} is {_kind(st.st_mode)}, not a directory")
        if kind == "TensorDict":
            return self._scan_dict(path, key, batch, depth + 1)
        if kind not in ("NonTensorData", "NonTensorStack"):
            raise PayloadFileError(
                f"{where} is a {str(kind)[:60]}; a memmap recording is read as TensorDicts, "
                "NonTensorData and NonTensorStacks only"
            )
        meta = self._meta(path)
        if _saved_class(meta) != kind:
            raise PayloadFileError(f"{where}: its meta.json saved a {_saved_class(meta)}")
        entry = _Entry(key, "data" if kind == "NonTensorData" else "stack", batch)
        # tensordict pickles what JSON cannot hold: a NonTensorData's fields to other.pickle
        # (its meta.json then has no "data"), a stack's items to the pickle.pkl it names.
        pickled = "other.pickle" if kind == "NonTensorData" else "pickle.pkl"
        data = meta.get("data")
        if ("data" not in meta) if kind == "NonTensorData" else data == pickled:
            entry.file = self._find(path, pickled, "")
            if entry.file is None:
                raise PayloadFileError(f"{where}: its pickled data ({pickled}) is missing")
            entry.nbytes = self._file_size(entry.file, pickled)
        elif kind == "NonTensorStack" and not isinstance(data, list):
            raise PayloadFileError(f"{where}: a NonTensorStack whose data is not a list")
        elif kind == "NonTensorStack" and len(data) != batch[0]:
            raise PayloadFileError(f"{where}: {len(data)} items for {batch[0]} rows")
        else:
            entry.value = data
        self._add(entry)

    def _scan_tensor(self, directory: Path, key: tuple, meta: dict, batch: list[int]):
        where = f"{self._where(directory)}/meta.json: {_key_name(key)}"
        dtype = _dtype(meta.get("dtype"), where)
        shape = _dims(meta.get("shape"), where)
        nested = meta.get("is_nested", False)
        if not isinstance(nested, bool):
            raise PayloadFileError(f"{where}: is_nested is {nested!r}, not true or false")
        entry = _Entry(key, "nested" if nested else "tensor", batch, dtype, shape)
        entry.file = self._find(directory, key[-1], ".memmap")
        if nested:
            entry.rows = self._row_shapes(directory, key, shape, batch, where)
            numel = sum(math.prod(r) for r in entry.rows)
        else:
            if shape[: len(batch)] != batch:
                raise PayloadFileError(
                    f"{where}: shape {shape} does not start with the batch size {batch}"
                )
            numel = math.prod(shape)
        entry.nbytes = numel * dtype.itemsize
        if entry.file is None:
            if entry.nbytes == 0 and not nested:
                return self._add(entry)  # torch writes no file for an empty tensor
            raise PayloadFileError(
                f"{where}: its file {_file_key(key[-1])}.memmap is missing "
                f"({entry.nbytes:,} bytes expected)"
            )
        self._check_size(entry.file, entry.nbytes, where, f"shape {shape} of {dtype}")
        self._add(entry)

    def _check_size(self, path: Path, expected: int, where: str, claim: str) -> None:
        size = self._file_size(path, "leaf")
        if size != expected:
            state = "truncated" if size < expected else "longer than its shape"
            raise PayloadFileError(
                f"{where}: {path.name} is {state}: {size:,} bytes, but meta.json claims "
                f"{claim} = {expected:,} bytes"
            )

    def _row_shapes(self, directory, key, shape, batch, where) -> list[list[int]]:
        """A NestedTensor's row shapes, from its ``.shape.memmap`` (int64 [rows, dims])."""
        if len(shape) != 2 or len(batch) != 1 or shape[0] != batch[0] or shape[1] > MAX_DIMS:
            raise PayloadFileError(
                f"{where}: a nested tensor's shape must be [rows={batch[:1]}, dims <= "
                f"{MAX_DIMS}] in a 1-D batch, got {shape} in {batch}"
            )
        path = self._find(directory, key[-1], ".shape.memmap")
        if path is None:
            name = f"{_file_key(key[-1])}.shape.memmap"
            raise PayloadFileError(f"{where}: its row shapes ({name}) are missing")
        self._check_size(path, shape[0] * shape[1] * 8, where, f"row shapes {shape} of int64")
        rows = np.frombuffer(_read_bytes(path, shape[0] * shape[1] * 8, False), dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= 1 << 48):
            raise PayloadFileError(f"{where}: its row shapes hold a negative or huge size")
        return rows.reshape(shape).tolist()

    # -- reading -------------------------------------------------------------------------------
    def _tensor(self, e: _Entry) -> torch.Tensor:
        raw = torch.empty(e.nbytes, dtype=torch.uint8)
        if e.nbytes:
            with open_regular(e.file, e.nbytes, follow=False) as f:
                _read_exact(f, memoryview(raw.numpy()), e.file)
        # A bool byte other than 0 or 1 is undefined behaviour in torch's kernels.
        flat = raw != 0 if e.dtype == torch.bool else raw.view(e.dtype)
        if e.kind == "tensor":
            return flat.reshape(e.shape)
        sizes = [math.prod(r) for r in e.rows]
        parts = [p.reshape(r) for p, r in zip(flat.split(sizes), e.rows, strict=True)]
        if all(len(r) >= 1 and r[1:] == e.rows[0][1:] for r in e.rows):
            return torch.nested.nested_tensor(parts, layout=torch.jagged)  # what codecs carry
        return torch.nested.nested_tensor(parts)

    def _non_tensor(self, e: _Entry):
        value = e.value
        if e.file is not None:
            try:
                value = _unpickle(_read_bytes(e.file, e.nbytes, False), self.policy.trust)
            except pickle.UnpicklingError as exc:
                need = _refused_global(exc) if str(exc).startswith("needs ") else None
                if need is None:
                    raise
                where = f"{self.shown} (leaf {_key_name(e.key)}, pickled in {e.file.name})"
                raise _needs(where, need, self.policy) from None
            if e.kind == "data":
                if not isinstance(value, dict) or "data" not in value:
                    raise PayloadFileError(f"{e.file}: not a NonTensorData's pickled fields")
                value = value["data"]
        if e.kind == "data":
            return NonTensorData(value, batch_size=e.batch)
        if not isinstance(value, list) or len(value) != e.batch[0]:
            raise PayloadFileError(f"{e.file}: not a list of {e.batch[0]} items")
        return NonTensorStack.from_list(value)


def _saved_class(meta: dict) -> str:
    """The class a meta.json says it saved, short when it is tensordict's own, else in full:
    a name is only read, never imported."""
    class_id, type_name = meta.get("_class"), meta.get("_type")
    if isinstance(class_id, str) and class_id.startswith("tensordict:"):
        return class_id.removeprefix("tensordict:")
    if isinstance(type_name, str):
        name = type_name.removeprefix("<class '").removesuffix("'>")
        if name.startswith("tensordict."):
            return name.rpartition(".")[2]
        return name[:80]
    return str(class_id or "an unnamed class")[:80]


# -- the loader --------------------------------------------------------------------------------
def _read(path: Path, policy: _Policy, batch_size: int | None):
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
        return _MemmapDir(path, policy).load(batch_size)
    if not stat.S_ISREG(st.st_mode):
        raise PayloadFileError(
            f"{path} is {_kind(st.st_mode)}; a recording is a regular file or a directory"
        )
    if st.st_size > policy.max_bytes:
        raise PayloadFileError(
            f"{path} is {st.st_size:,} bytes > {policy.flags.max_bytes}={policy.max_bytes:,}"
        )
    with open_regular(path, st.st_size) as f:
        # torch.save writes a zip; a pickle that embeds one (verl's) passes is_zipfile, so
        # the first bytes decide.
        if f.read(4) == b"PK\x03\x04":
            f.seek(0)
            return _torch_load(f, st.st_size, str(path), policy)
    return _read_pickle(path, st.st_size, policy)


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
    policy = _Policy(bool(trust), default_max_bytes() if max_bytes is None else max_bytes, flags)
    path = Path(path).expanduser()
    try:
        # A hostile file must cost one line: torch's and tensordict's warnings about what they
        # were handed would print more.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dp = _as_dataproto(_read(path, policy, batch_size), path)
            _check_bytes(dp, batch_size, policy, path)
    except PayloadFileError as exc:
        raise PayloadFileError(_one_line(f"{flags.prefix}{exc}")) from None
    except Exception as exc:  # noqa: BLE001 - any reader's failure is a bad file, said once
        raise _unreadable(path, exc, flags) from None
    return dp


def _unreadable(path: Path, exc: BaseException, flags: Flags) -> PayloadFileError:
    first = _one_line((str(exc).strip().splitlines() or [""])[0])[:200]
    return PayloadFileError(
        _one_line(
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


def _check_bytes(dp: DataProto, batch_size: int | None, policy: _Policy, path: Path) -> None:
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
