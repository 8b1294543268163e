"""The shape of a batch without its data, and seeded batches of that shape (``payload=schema``).

``bcastbench schema FILE -o schema.yaml`` reads a recorded batch (``harness.run.recorded``) and
writes its keys, dtypes and shapes; for a jagged leaf the distribution of its row lengths; for
non-tensor data the kind of its items (and the distribution of string lengths); meta_info's
keys with their types (numbers, booleans and None keep their values: they are settings, not
data). ``replay`` regenerates a batch of any row count from it, drawing jagged and string
lengths from the recorded distributions, so a team can share the shape of its batch, not its
data.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import yaml
from tensordict import NonTensorData, NonTensorStack, TensorDict

from harness.files import write_atomic
from harness.paths import CONF_DIR
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


def write(schema: dict, path: str | Path) -> Path:
    text = "# bcastbench batch schema: shapes and kinds only, no data (harness/run/schema.py)\n"
    return write_atomic(
        path, text + yaml.safe_dump(schema, sort_keys=False, width=100, default_flow_style=None)
    )


def resolve(path: str | Path) -> Path:
    """A schema path as given, or a bare name of one shipped in ``conf/schemas/``."""
    given = Path(path).expanduser()
    shipped = CONF_DIR / "schemas" / f"{path}.yaml"
    return (
        shipped if not given.exists() and given.name == str(path) and shipped.is_file() else given
    )


def read(path: str | Path) -> dict:
    """A schema file, checked; SchemaError names what is missing."""
    path = resolve(path)
    if not path.is_file():
        shipped = sorted(p.stem for p in (CONF_DIR / "schemas").glob("*.yaml"))
        raise SchemaError(
            f"payload.path: no such schema file: {path} (shipped schemas, by name: {shipped})"
        )
    try:
        schema = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SchemaError(f"payload.path: {path} is not YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(schema, dict) or schema.get("format") != FORMAT:
        raise SchemaError(
            f"payload.path: {path} is not a bcastbench schema (format: {FORMAT} expected; "
            "write one with `bcastbench schema FILE -o schema.yaml`)"
        )
    for entry in schema.get("leaves", []):
        if entry.get("kind") in ("tensor", "jagged"):
            try:
                getattr(torch, entry["dtype"])
            except (AttributeError, KeyError):
                raise SchemaError(
                    f"payload.path: {path}: leaf {entry.get('key')} has an unknown dtype "
                    f"{entry.get('dtype')!r}"
                ) from None
    return schema


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


def _text(n: int, lengths: dict, gen: np.random.Generator) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
    return ["".join(gen.choice(letters, size=int(k))) for k in _draw_lengths(lengths, n, gen)]


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
    dtype = getattr(torch, entry["dtype"])
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


def make(path: str, batch_size: int, seed: int, broadcast_non_tensor: bool | None = None):
    """The payload of ``payload=schema``."""
    dp = replay(read(path), batch_size, seed)
    if broadcast_non_tensor is not None:
        dp.meta_info["_broadcast_non_tensor_batch"] = broadcast_non_tensor
    return dp


def main(argv: list[str] | None = None) -> int:
    """``bcastbench schema FILE -o schema.yaml [--trust]``."""
    from harness.run.recorded import PayloadFileError, load

    parser = argparse.ArgumentParser(
        prog="bcastbench schema", description="Write a recorded batch's schema (no data)."
    )
    parser.add_argument("file", help="a recorded batch (see payload=file)")
    parser.add_argument("-o", "--out", default="schema.yaml", help="where the YAML goes")
    parser.add_argument("--trust", action="store_true", help="allow arbitrary unpickling")
    args = parser.parse_args(argv)
    try:
        schema = extract(load(args.file, trust=args.trust))
    except PayloadFileError as exc:
        print(f"bcastbench schema: error: {exc}", file=sys.stderr)
        return 2
    out = write(schema, args.out)
    print(
        f"wrote {out}: {len(schema['leaves'])} leaves, "
        f"{len(schema['non_tensor_batch'])} non-tensor keys, {len(schema['meta_info'])} "
        f"meta_info keys (batch of {schema['batch_size']} rows; no data)"
    )
    return 0
