"""A schema file: the shape of a batch without its data, read through a bounded safe YAML loader
and checked whole (every field, then the bytes it would take) before anything is built.

``bcastbench schema FILE -o schema.yaml`` (``harness.payload.schema_command``) reads a recorded
batch and writes its keys, dtypes and shapes; for a jagged leaf the distribution of its row
lengths; for non-tensor data the kind of its items (and the distribution of string lengths);
meta_info's keys with their types (numbers, booleans and None keep their values: they are
settings, not data) (``harness.payload.schema_extract``). ``payload=schema`` regenerates a
batch of any row count from it, drawing jagged and string lengths from the recorded
distributions (``harness.payload.schema_replay``), so a team can share the shape of its batch,
not its data.
"""

from __future__ import annotations

import functools
import math
import os
import stat
from pathlib import Path

import numpy as np
import torch
import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.parser import Parser as PyParser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from harness.files import write_atomic
from harness.paths import CONF_DIR
from harness.payload.user_files import (
    DTYPES,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_LEAVES,
    default_max_bytes,
    is_dims,
    one_line,
    open_regular,
)

FORMAT = "bcastbench.schema/1"
QUANTILES = np.linspace(0, 100, 11)
"""Length distributions are kept as these percentiles; replay interpolates between them."""
SCALARS = (bool, int, float, type(None))


class SchemaError(ValueError):
    """A schema file that cannot be replayed; raised before any rank starts."""


class _NoAliases(yaml.SafeDumper):
    """Writes a value shared twice in full: ``read`` refuses aliases."""

    def ignore_aliases(self, data) -> bool:
        return True


def write(schema: dict, path: str | Path) -> Path:
    text = "# bcastbench batch schema: shapes and kinds only, no data (harness/payload/payload_schema.py)\n"
    body = yaml.dump(schema, Dumper=_NoAliases, sort_keys=False, width=100, default_flow_style=None)
    return write_atomic(path, text + body)


def resolve(path: str | Path) -> Path:
    """A schema path as given, or a bare name of one shipped in ``conf/schemas/``."""
    given = Path(path).expanduser()
    shipped = CONF_DIR / "schemas" / f"{path}.yaml"
    return (
        shipped if not given.exists() and given.name == str(path) and shipped.is_file() else given
    )


MAX_SCHEMA_BYTES = 256 << 10
"""Largest schema file read: a schema is a few kilobytes, and YAML parses slowly."""
MAX_YAML_DEPTH = 32
"""Deepest YAML nesting read (a schema nests four levels)."""
MAKE_ONE = "write one with `bcastbench schema FILE -o schema.yaml`"

_LEAF_FIELDS = {
    "tensor": {"key", "kind", "dtype", "shape"},
    "jagged": {"key", "kind", "dtype", "trailing_shape", "lengths"},
    "non_tensor_stack": {"key", "kind", "items", "lengths"},
    "non_tensor_data": {"key", "kind", "items", "value"},
}
"""Each leaf kind and the fields it may have."""
_ITEM_BYTES = 16
"""A non-tensor item's bytes besides its text: its slot in the list and the object."""
_TOP_FIELDS = ("format", "batch_size", "batch_dims", "leaves", "non_tensor_batch", "meta_info")


@functools.cache
def _bounded_loader():
    """PyYAML's safe loader (libyaml's parser where installed) composing nodes no deeper than
    MAX_YAML_DEPTH and refusing aliases, so a hostile file fails in its first bytes instead of
    recursing for seconds, and no alias can multiply what the checks walk."""
    try:  # libyaml's parser is optional: PyYAML builds without it
        from yaml._yaml import CParser as Parser

        mixins: tuple = ()
    except ImportError:  # pure-Python PyYAML
        Parser, mixins = PyParser, (Reader, Scanner)

    class Loader(Composer, *mixins, Parser, SafeConstructor, Resolver):
        def __init__(self, stream) -> None:
            for base in (*mixins, Parser):
                base.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
            self.depth = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise yaml.YAMLError("uses an alias (*name), which a schema never needs")
            self.depth += 1
            try:
                if self.depth > MAX_YAML_DEPTH:
                    raise yaml.YAMLError(f"nests deeper than {MAX_YAML_DEPTH} levels")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return Loader


def _what_binary(head: bytes) -> str:
    if head.startswith(b"PK\x03\x04"):
        return "a torch.save file"
    if head.startswith(b"\x80"):
        return "a pickle"
    return "binary, not UTF-8 text"


def _text_of(path: Path) -> str:
    """The schema file's text, read only if it is a small regular UTF-8 file."""
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise SchemaError(
            f"payload.path: {path} is a directory (a TensorDict.memmap recording?), not a "
            f"schema YAML: use payload=file for a recording, or {MAKE_ONE}"
        )
    if not stat.S_ISREG(st.st_mode):
        raise SchemaError(f"payload.path: {path} is not a regular file; a schema is a YAML file")
    if st.st_size > MAX_SCHEMA_BYTES:
        raise SchemaError(
            f"payload.path: {path} is {st.st_size:,} bytes > {MAX_SCHEMA_BYTES:,}, too large for "
            f"a schema YAML; {MAKE_ONE}"
        )
    with open_regular(path, st.st_size) as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SchemaError(
            f"payload.path: {path} is not a schema YAML (it is {_what_binary(data[:4])}): use "
            f"payload=file for a recorded batch, or {MAKE_ONE}"
        ) from None


def read(path: str | Path, batch_size: int | None = None, max_bytes: int | None = None) -> dict:
    """A schema file, checked whole (``validate``) before anything is built; SchemaError names
    what is wrong in one line."""
    path = resolve(path)
    if not os.path.lexists(path):
        shipped = sorted(p.stem for p in (CONF_DIR / "schemas").glob("*.yaml"))
        raise SchemaError(
            f"payload.path: no such schema file: {path} (shipped schemas, by name: {shipped})"
        )
    text = _text_of(path)
    try:
        schema = yaml.load(text, Loader=_bounded_loader())  # noqa: S506 - a safe loader
    except Exception as exc:  # noqa: BLE001 - whatever the parser raises, the file is no schema
        first = one_line(exc)[:160]
        raise SchemaError(f"payload.path: {path} is not a schema YAML: {first}") from None
    if not isinstance(schema, dict) or schema.get("format") != FORMAT:
        raise SchemaError(
            f"payload.path: {path} is not a bcastbench schema (format: {FORMAT} expected; "
            f"{MAKE_ONE})"
        )
    try:
        validate(schema, batch_size, max_bytes)
    except SchemaError as exc:
        raise SchemaError(f"payload.path: {path}: {exc}") from None
    return schema


# -- validation: every field, then the bytes it would take -----------------------------------------
def _dims(value, where: str) -> list[int]:
    if is_dims(value):
        return value
    raise SchemaError(
        f"{where} must be a list of at most {MAX_DIMS} non-negative integers, got {str(value)[:60]}"
    )


def _max_length(lengths, where: str) -> int:
    """The longest length a ``lengths`` entry can draw (its top percentile, rounded up)."""
    pct = lengths.get("percentiles") if isinstance(lengths, dict) else None
    numbers = isinstance(pct, list) and len(pct) == len(QUANTILES)
    numbers = numbers and all(type(x) in (int, float) for x in pct)
    if not numbers or set(lengths) != {"percentiles"}:
        raise SchemaError(
            f"{where}.lengths must be {{percentiles: [{len(QUANTILES)} numbers]}}, got "
            f"{str(lengths)[:60]}"
        )
    if not all(math.isfinite(x) and 0 <= x < 2**48 for x in pct) or pct != sorted(pct):
        raise SchemaError(
            f"{where}.lengths.percentiles must be finite, non-negative and non-decreasing, got "
            f"{str(pct)[:80]}"
        )
    return math.ceil(pct[-1])


def _dtype(name, where: str) -> torch.dtype:
    if isinstance(name, str) and name in DTYPES:
        return DTYPES[name]
    raise SchemaError(
        f"{where} has an unknown dtype {str(name)[:40]!r}; valid: {', '.join(DTYPES)}"
    )


def _key(entry: dict, where: str) -> tuple[str, ...]:
    key = entry.get("key")
    if not (isinstance(key, list) and 1 <= len(key) <= MAX_DEPTH):
        raise SchemaError(
            f"{where}.key must be a list of 1 to {MAX_DEPTH} names, got {str(key)[:60]}"
        )
    if not all(isinstance(k, str) and k for k in key):
        raise SchemaError(f"{where}.key must hold non-empty strings, got {str(key)[:60]}")
    return tuple(key)


def _leaf_row_bytes(entry, where: str, batch_dims: list[int]) -> tuple[int, str]:
    """One leaf checked; the bytes one row of it takes, and how that was reckoned."""
    if not isinstance(entry, dict):
        raise SchemaError(f"{where} must be a mapping, got {type(entry).__name__}")
    kind = entry.get("kind")
    if kind not in _LEAF_FIELDS:
        raise SchemaError(f"{where}.kind is {str(kind)[:40]!r}; valid: {', '.join(_LEAF_FIELDS)}")
    extra = set(entry) - _LEAF_FIELDS[kind]
    if extra:
        raise SchemaError(
            f"{where} ({kind}) has unknown fields {sorted(map(str, extra))}; valid: "
            f"{sorted(_LEAF_FIELDS[kind])}"
        )
    if kind in ("jagged", "non_tensor_stack") and batch_dims:
        raise SchemaError(f"{where}: a {kind} leaf is replayed one item per row: batch_dims: []")
    if kind in ("non_tensor_stack", "non_tensor_data") and not isinstance(
        entry.get("items", ""), str
    ):
        raise SchemaError(f"{where}.items must be a type name")
    if kind == "non_tensor_data":
        if not isinstance(entry.get("value"), SCALARS):
            raise SchemaError(f"{where}.value must be a number, a boolean or null")
        return _ITEM_BYTES, "one value"
    if kind == "non_tensor_stack":
        if "lengths" not in entry:
            return _ITEM_BYTES, "one item per row"
        longest = _max_length(entry["lengths"], where)
        return longest + _ITEM_BYTES, f"strings up to {longest:,} long (its top percentile)"
    itemsize = _dtype(entry.get("dtype"), f"{where}.dtype").itemsize
    if kind == "tensor":
        shape = _dims(entry.get("shape"), f"{where}.shape")
        if shape[: len(batch_dims)] != batch_dims:  # a leaf's shape after B holds batch_dims
            raise SchemaError(f"{where}.shape {shape} does not start with batch_dims {batch_dims}")
        return math.prod(shape) * itemsize, f"shape {shape}"
    trailing = _dims(entry.get("trailing_shape"), f"{where}.trailing_shape")
    longest = _max_length(entry.get("lengths"), where)
    row = longest * math.prod(trailing) * itemsize + 8
    return row, f"rows up to {longest:,} long (its top percentile) × {trailing}"


def _non_tensor_row_bytes(entry, where: str) -> tuple[int, str]:
    if not isinstance(entry, dict) or not set(entry) <= {"dtype", "items", "lengths"}:
        raise SchemaError(f"{where} must be a mapping of dtype, items and lengths")
    try:
        dtype = np.dtype(entry.get("dtype", "object"))
    except (TypeError, ValueError, SyntaxError):
        raise SchemaError(
            f"{where}.dtype {str(entry.get('dtype'))[:40]!r} is not a numpy dtype"
        ) from None
    if dtype.kind not in "biufcOUS" or dtype.shape or dtype.fields:
        raise SchemaError(
            f"{where}.dtype {dtype} is not a plain numpy dtype (bool, number, str, object)"
        )
    if not isinstance(entry.get("items", ""), str):
        raise SchemaError(f"{where}.items must be a type name")
    longest = _max_length(entry["lengths"], where) if "lengths" in entry else 0
    # An object array holds a pointer per row and the object; a fixed-width one holds its text.
    row = dtype.itemsize + (longest + 8 if dtype.kind == "O" else 0)
    texts = f", strings up to {longest:,} long (its top percentile)" if "lengths" in entry else ""
    return row, f"dtype {dtype}{texts}"


def _check_keys(keys: list[tuple[str, ...]]) -> None:
    seen = set(keys)
    if len(seen) != len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise SchemaError(f"leaf {list(twice)} appears twice")
    for key in keys:
        for cut in range(1, len(key)):
            if key[:cut] in seen:
                raise SchemaError(f"leaf {list(key[:cut])} is both a leaf and holds {list(key)}")


def validate(schema: dict, batch_size: int | None = None, max_bytes: int | None = None) -> int:
    """Every field of a schema checked (kinds, dtypes from ``user_files.DTYPES``, dims, keys,
    length percentiles); with ``batch_size``, the batch it replays to checked against
    ``max_bytes`` (default ``user_files.default_max_bytes()``). Returns the bytes per row."""
    unknown = set(schema) - set(_TOP_FIELDS)
    if unknown:
        raise SchemaError(f"unknown fields {sorted(map(str, unknown))}; valid: {list(_TOP_FIELDS)}")
    if "batch_size" in schema and not (
        type(schema["batch_size"]) is int and schema["batch_size"] >= 0
    ):
        raise SchemaError(
            f"batch_size must be a non-negative integer, got {schema['batch_size']!r}"
        )
    batch_dims = _dims(schema.get("batch_dims", []), "batch_dims")
    entries = schema.get("leaves")
    if not isinstance(entries, list) or len(entries) > MAX_LEAVES:
        raise SchemaError(f"leaves must be a list of at most {MAX_LEAVES:,} leaves")
    rows: list[tuple[int, str, str]] = []
    keys = []
    for i, entry in enumerate(entries):
        where = f"leaves[{i}]"
        row, why = _leaf_row_bytes(entry, where, batch_dims)
        keys.append(_key(entry, where))
        rows.append((row, f"leaf {list(keys[-1])}", why))
    _check_keys(keys)
    for name, part in (("non_tensor_batch", _non_tensor_row_bytes), ("meta_info", None)):
        section = schema.get(name, {})
        if not isinstance(section, dict) or len(section) > MAX_LEAVES:
            raise SchemaError(f"{name} must be a mapping of at most {MAX_LEAVES:,} keys")
        for key, entry in section.items():
            where = f"{name}[{str(key)[:40]!r}]"
            if not isinstance(key, str):
                raise SchemaError(f"{where}: keys must be strings")
            if part is None:
                _check_meta(entry, where)
            else:
                row, why = part(entry, where)
                rows.append((row, where, why))
    per_row = sum(r for r, _, _ in rows)
    if batch_size is not None:
        _check_total(per_row, rows, batch_size, max_bytes)
    return per_row


def _check_meta(entry, where: str) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
        raise SchemaError(f"{where} must be {{type: <name>}} with an optional value")
    if not set(entry) <= {"type", "value"}:
        raise SchemaError(f"{where} has fields {sorted(map(str, entry))}; valid: type, value")
    if "value" in entry and not isinstance(entry["value"], SCALARS):
        raise SchemaError(f"{where}.value must be a number, a boolean or null")


def _check_total(per_row: int, rows, batch_size: int, max_bytes: int | None) -> None:
    limit = default_max_bytes() if max_bytes is None else max_bytes
    total = batch_size * per_row
    if total <= limit:
        return
    row, what, why = max(rows)
    raise SchemaError(
        f"payload.batch_size={batch_size:,} rows × {per_row:,} bytes per row = {total:,} bytes "
        f"> payload.max_bytes={limit:,} (largest: {what}, {row:,} bytes per row: {why})"
    )
