"""A schema replayed: a seeded batch of any row count with exactly its keys, dtypes and shapes,
jagged and string lengths drawn from its recorded percentiles (``payload=schema``)."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from harness.payload.payload_schema import QUANTILES, SchemaError, read, resolve
from harness.payload.user_files import DTYPES, one_line
from strategies import NON_TENSOR_FLAG, DataProto


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
        dp.meta_info[NON_TENSOR_FLAG] = broadcast_non_tensor
    return dp


def check(path: str, batch_size: int | None, max_bytes: int | None = None) -> dict:
    """What the job's validation runs: the schema checked whole, then one row replayed, so a
    schema that passes here replays on every leader; the checked schema. SchemaError, one
    line, if not."""
    schema = read(path, batch_size, max_bytes)
    try:
        replay(schema, 1, 0)
    except Exception as exc:  # noqa: BLE001 - a value the checks let through, said once
        first = one_line(exc)[:160]
        raise SchemaError(
            f"payload.path: {resolve(path)} cannot be replayed ({type(exc).__name__}: {first})"
        ) from None
    return schema
