"""A TensorDict.memmap directory read without tensordict's loader: every meta.json planned and
checked before one leaf is read, then each leaf read, read-only, into a tensor of its own."""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from harness.payload.safe_unpickling import unpickle
from harness.payload.user_files import (
    DTYPES,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_LEAVES,
    PayloadFileError,
    ReadPolicy,
    file_kind,
    is_dims,
    one_line,
    open_regular,
    read_bytes,
    read_exact,
)

MAX_META_BYTES = 16 << 20
"""Largest ``meta.json`` read from a memmap directory (they hold shapes and small values)."""
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
    if is_dims(value):
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


def read_memmap(root: Path, policy: ReadPolicy, batch_size: int | None) -> TensorDict:
    """The TensorDict a memmap directory holds, read without tensordict's loader: every
    meta.json is read as JSON and every claim checked (``_MemmapPlan``) before one leaf is read;
    each leaf is then read, read-only, into a tensor of its own, so nothing stays mapped and no
    file can change."""
    plan = _MemmapPlan(root, policy)
    entries = plan.scan()
    total = sum(e.nbytes for e in entries)
    if total > policy.max_bytes:
        raise PayloadFileError(f"{plan.shown} holds {total:,} bytes of leaves > {policy.limit}")
    rows = entries[0].batch[0] if entries[0].batch else 0
    if rows and batch_size:
        problem = policy.too_big(f"{plan.shown}: payload.batch_size", batch_size, -(-total // rows))
        if problem:
            raise PayloadFileError(problem)
    values = {
        e.key: _read_non_tensor(e, plan.shown, policy)
        for e in entries
        if e.kind in ("data", "stack")
    }
    td = TensorDict({}, batch_size=entries[0].batch)
    for e in entries[1:]:
        if e.kind == "dict":
            value = TensorDict({}, batch_size=e.batch)
        elif e.kind in ("data", "stack"):
            value = values[e.key]
        else:
            value = _read_tensor(e)
        td.set(e.key, value)
    return td


class _MemmapPlan:
    """What a memmap directory holds, planned from its meta.json files before any data is
    read: dtypes from ``DTYPES``, shapes checked against the files' sizes, every path inside
    the directory."""

    def __init__(self, root: Path, policy: ReadPolicy) -> None:
        self.root = Path(os.path.realpath(root))
        self.shown = root
        self.policy = policy
        self.entries: list[_Entry] = []

    def scan(self) -> list[_Entry]:
        """Every entry, the root TensorDict first, each parent before its children."""
        self._scan_dict(self.root, (), None, 0)
        return self.entries

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
                f"{self._where(path)} ({what}) is {file_kind(st.st_mode)}; only regular files are read"
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
            meta = json.loads(read_bytes(path, size, follow=False))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise PayloadFileError(
                f"{self._where(path)} is not JSON ({one_line(exc)[:120]})"
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
            raise PayloadFileError(
                f"{where}: {path.name} is {file_kind(st.st_mode)}, not a directory"
            )
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
        rows = np.frombuffer(read_bytes(path, shape[0] * shape[1] * 8, False), dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= 1 << 48):
            raise PayloadFileError(f"{where}: its row shapes hold a negative or huge size")
        return rows.reshape(shape).tolist()


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


def _read_tensor(e: _Entry) -> torch.Tensor:
    raw = torch.empty(e.nbytes, dtype=torch.uint8)
    if e.nbytes:
        with open_regular(e.file, e.nbytes, follow=False) as f:
            read_exact(f, memoryview(raw.numpy()), e.file)
    # A bool byte other than 0 or 1 is undefined behaviour in torch's kernels.
    flat = raw != 0 if e.dtype == torch.bool else raw.view(e.dtype)
    if e.kind == "tensor":
        return flat.reshape(e.shape)
    sizes = [math.prod(r) for r in e.rows]
    parts = [p.reshape(r) for p, r in zip(flat.split(sizes), e.rows, strict=True)]
    if all(len(r) >= 1 and r[1:] == e.rows[0][1:] for r in e.rows):
        return torch.nested.nested_tensor(parts, layout=torch.jagged)  # what codecs carry
    return torch.nested.nested_tensor(parts)


def _read_non_tensor(e: _Entry, shown: Path, policy: ReadPolicy):
    value = e.value
    if e.file is not None:
        where = f"{shown} (leaf {_key_name(e.key)}, pickled in {e.file.name})"
        value = unpickle(read_bytes(e.file, e.nbytes, False), policy, where)
        if e.kind == "data":
            if not isinstance(value, dict) or "data" not in value:
                raise PayloadFileError(f"{e.file}: not a NonTensorData's pickled fields")
            value = value["data"]
    if e.kind == "data":
        return NonTensorData(value, batch_size=e.batch)
    if not isinstance(value, list) or len(value) != e.batch[0]:
        raise PayloadFileError(f"{e.file}: not a list of {e.batch[0]} items")
    return NonTensorStack.from_list(value)
