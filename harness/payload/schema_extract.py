"""A schema from a batch: its keys, dtypes and shapes, the percentiles of its jagged and string
lengths, the kinds of its non-tensor items and meta_info's types (``bcastbench schema``)."""

from __future__ import annotations

import numpy as np
from tensordict import NonTensorData, NonTensorStack

from harness.payload.payload_schema import FORMAT, QUANTILES, SCALARS
from strategies import DataProto
from strategies.core.contract import leaves


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
