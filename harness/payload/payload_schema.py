"""The shape of a batch without its data, and seeded batches of that shape (``payload=schema``).

``bcastbench schema FILE -o schema.yaml`` reads a recorded batch (``harness.payload.recording``) and
writes its keys, dtypes and shapes; for a jagged leaf the distribution of its row lengths; for
non-tensor data the kind of its items (and the distribution of string lengths); meta_info's
keys with their types (numbers, booleans and None keep their values: they are settings, not
data). ``replay`` regenerates a batch of any row count from it, drawing jagged and string
lengths from the recorded distributions, so a team can share the shape of its batch, not its
data.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import stat
import sys
from pathlib import Path

import numpy as np
import torch
import yaml
from tensordict import NonTensorData, NonTensorStack, TensorDict

from harness.files import write_atomic
from harness.paths import CONF_DIR
from harness.payload.recording import load
from harness.payload.user_files import (
    DTYPES,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_LEAVES,
    SCHEMA_FLAGS,
    PayloadFileError,
    default_max_bytes,
    open_regular,
)
from strategies import DataProto
from strategies.core.contract import leaves

FORMAT = "bcastbench.schema/1"
QUANTILES = np.linspace(0, 100, 11)
"""Length distributions are kept as these percentiles; replay interpolates between them."""
SCALARS = (bool, int, float, type(None))


class SchemaError(ValueError):
    """A schema file that cannot be replayed; raised before any rank starts."""


def _lengths(values) -> dict:
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        arr = np.zeros(1)
    return {"percentiles": [round(float(x), 3) for x in np.percentile(arr, QUANTILES)]}


def _item_kind(items) -> dict:
    kinds = sorted({type(x).__name__ for x in items})
    out: dict = {"items": kinds[0] if len(kinds) == 1 else "mixed"}
    if all(isinstance(x, str) for x in items):
        out["lengths"] = _lengths(len(x) for x in items)
    return out


def _tensor_entry(key: tuple[str, ...], value) -> dict:
    if isinstance(value, NonTensorStack):
        return {"key": list(key), "kind": "non_tensor_stack", **_item_kind(value.tolist())}
    if isinstance(value, NonTensorData):
        data = value.data
        entry = {"key": list(key), "kind": "non_tensor_data", "items": type(data).__name__}
        return entry | ({"value": data} if isinstance(data, SCALARS) else {})
    dtype = str(value.dtype).removeprefix("torch.")
    if value.is_nested:
        rows = value.unbind(0)
        return {
            "key": list(key),
            "kind": "jagged",
            "dtype": dtype,
            "trailing_shape": list(rows[0].shape[1:]) if rows else [],
            "lengths": _lengths(r.shape[0] for r in rows),
        }
    return {"key": list(key), "kind": "tensor", "dtype": dtype, "shape": list(value.shape[1:])}


def extract(dp: DataProto) -> dict:
    """The schema of ``dp`` (a plain dict, ready for YAML); shapes exclude the batch dim."""
    non_tensor = {
        k: {"dtype": str(np.asarray(v).dtype), **_item_kind(list(v))}
        for k, v in dp.non_tensor_batch.items()
    }
    meta = {
        k: (
            {"type": type(v).__name__, "value": v}
            if isinstance(v, SCALARS)
            else {"type": type(v).__name__}
        )
        for k, v in dp.meta_info.items()
    }
    return {
        "format": FORMAT,
        "batch_size": int(dp.batch.batch_size[0]),
        "batch_dims": [int(d) for d in dp.batch.batch_size[1:]],
        "leaves": [_tensor_entry(key, value) for key, value in leaves(dp.batch)],
        "non_tensor_batch": non_tensor,
        "meta_info": meta,
    }


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
    from yaml.composer import Composer
    from yaml.constructor import SafeConstructor
    from yaml.resolver import Resolver

    try:
        from yaml._yaml import CParser as Parser

        mixins: tuple = ()
    except ImportError:  # pure-Python PyYAML
        from yaml.parser import Parser
        from yaml.reader import Reader
        from yaml.scanner import Scanner

        mixins = (Reader, Scanner)

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
        first = " ".join(str(exc).split())[:160]
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
    ok = isinstance(value, list) and len(value) <= MAX_DIMS
    if ok and all(type(d) is int and 0 <= d < 1 << 48 for d in value):
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


# -- replay ---------------------------------------------------------------------------------------
def _draw_lengths(lengths: dict, n: int, gen: np.random.Generator) -> np.ndarray:
    """n lengths from the recorded percentiles (inverse CDF, linear between them)."""
    values = np.interp(gen.random(n) * 100, QUANTILES, lengths["percentiles"])
    return np.rint(values).astype(np.int64)


def _random(shape: list[int], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)


def _text(n: int, lengths: dict, gen: np.random.Generator) -> list[str]:
    # Bytes, not one str per letter: a string costs its length, not 50 times it.
    draws = _draw_lengths(lengths, n, gen)
    return [gen.choice(_LETTERS, size=int(k)).tobytes().decode("ascii") for k in draws]


def _items(entry: dict, n: int, gen: np.random.Generator) -> list:
    if "lengths" in entry:
        return _text(n, entry["lengths"], gen)
    if entry.get("items") == "int":
        return [int(x) for x in gen.integers(0, 1000, n)]
    if entry.get("items") == "float":
        return [float(x) for x in gen.random(n)]
    return [None] * n


def _leaf(entry: dict, b: int, g: torch.Generator, gen: np.random.Generator):
    kind = entry["kind"]
    if kind == "non_tensor_stack":
        return NonTensorStack.from_list(_items(entry, b, gen))
    if kind == "non_tensor_data":
        value = entry.get("value", _items(entry, 1, gen)[0])
        return NonTensorData(value, batch_size=[b])
    dtype = DTYPES[entry["dtype"]]
    if kind == "jagged":
        rows = [
            _random([int(k), *entry["trailing_shape"]], dtype, g)
            for k in _draw_lengths(entry["lengths"], b, gen)
        ]
        return torch.nested.nested_tensor(rows, layout=torch.jagged)
    return _random([b, *entry["shape"]], dtype, g)


def replay(schema: dict, batch_size: int, seed: int) -> DataProto:
    """A seeded batch of ``batch_size`` rows with exactly the schema's keys, dtypes and shapes."""
    g = torch.Generator().manual_seed(seed)
    gen = np.random.default_rng(seed)
    td = TensorDict({}, batch_size=[batch_size, *schema.get("batch_dims", [])])
    for entry in schema.get("leaves", []):
        td.set(tuple(entry["key"]), _leaf(entry, batch_size, g, gen))
    non_tensor = {}
    for key, entry in schema.get("non_tensor_batch", {}).items():
        arr = np.empty(batch_size, dtype=entry.get("dtype", "object"))
        arr[:] = _items(entry, batch_size, gen)
        non_tensor[key] = arr
    meta = {}
    for key, entry in schema.get("meta_info", {}).items():
        meta[key] = entry["value"] if "value" in entry else _empty(entry["type"])
    return DataProto(td, non_tensor, meta)


def _empty(type_name: str):
    return {"str": "", "list": [], "dict": {}, "tuple": ()}.get(type_name)


def make(
    path: str,
    batch_size: int,
    seed: int,
    broadcast_non_tensor: bool | None = None,
    max_bytes: int | None = None,
):
    """The payload of ``payload=schema``: the schema checked whole against ``batch_size`` rows
    and ``max_bytes`` before one tensor is built, then replayed."""
    dp = replay(read(path, batch_size, max_bytes), batch_size, seed)
    if broadcast_non_tensor is not None:
        dp.meta_info["_broadcast_non_tensor_batch"] = broadcast_non_tensor
    return dp


def check(path: str, batch_size: int | None, max_bytes: int | None = None) -> dict:
    """What the job's validation runs: the schema checked whole, then one row replayed, so a
    schema that passes here replays on every leader; the checked schema. SchemaError, one
    line, if not."""
    schema = read(path, batch_size, max_bytes)
    try:
        replay(schema, 1, 0)
    except Exception as exc:  # noqa: BLE001 - a value the checks let through, said once
        first = " ".join(str(exc).split())[:160]
        raise SchemaError(
            f"payload.path: {resolve(path)} cannot be replayed ({type(exc).__name__}: {first})"
        ) from None
    return schema


def _overwrites(out: str, source: str) -> bool:
    """Whether writing ``out`` would replace the recording or a file inside its directory."""
    out_real, source_real = os.path.realpath(out), os.path.realpath(source)
    return out_real == source_real or out_real.startswith(source_real.rstrip(os.sep) + os.sep)


def main(argv: list[str] | None = None) -> int:
    """``bcastbench schema FILE -o schema.yaml [--trust] [--max-bytes N]``: reads the file
    through ``recording.load`` (so it runs no code without ``--trust``); errors are one line and
    exit 2."""
    parser = argparse.ArgumentParser(
        prog="bcastbench schema", description="Write a recorded batch's schema (no data)."
    )
    parser.add_argument("file", help="a recorded batch (see payload=file)")
    parser.add_argument("-o", "--out", default="schema.yaml", help="where the YAML goes")
    parser.add_argument("--trust", action="store_true", help="allow arbitrary unpickling")
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="refuse a recording larger than this (default: a quarter of physical memory)",
    )
    args = parser.parse_args(argv)
    try:
        if _overwrites(args.out, args.file):
            raise PayloadFileError(f"-o {args.out} would overwrite the recording {args.file}")
        dp = load(args.file, trust=args.trust, max_bytes=args.max_bytes, flags=SCHEMA_FLAGS)
        schema = extract(dp)
    except PayloadFileError as exc:
        print(f"bcastbench schema: error: {exc}", file=sys.stderr)
        return 2
    try:
        out = write(schema, args.out)
    except OSError as exc:
        print(f"bcastbench schema: error: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {out}: {len(schema['leaves'])} leaves, "
        f"{len(schema['non_tensor_batch'])} non-tensor keys, {len(schema['meta_info'])} "
        f"meta_info keys (batch of {schema['batch_size']} rows; no data)"
    )
    return 0
