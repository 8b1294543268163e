"""Batches for the tests: leaf and batch specs every rank can rebuild from a seed, hypothesis
strategies that draw them, and byte-for-byte comparison. (Kept out of conftest.py: a module
named ``conftest`` is ambiguous once tests/benchmarks has its own.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from tensordict import TensorDict

from strategies import NON_TENSOR_FLAG, DataProto
from strategies.core.contract import is_non_tensor_leaf, leaves, wants_non_tensor

DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
KINDS = ("contiguous", "strided", "view", "expanded", "transposed")
"""How a leaf is laid out in memory: its own storage, every other element of a wider one, a
window into a larger parent, a stride-0 broadcast, or a transpose."""


@dataclass(frozen=True)
class LeafSpec:
    key: tuple[str, ...]
    dtype: str
    tail: tuple[int, ...]
    """Shape after the leading batch dimension."""
    kind: str = "contiguous"


@dataclass(frozen=True)
class BatchSpec:
    leaves: tuple[LeafSpec, ...]
    non_tensor: tuple[tuple[str, str], ...] = ()
    """(key, kind of values): 'str', 'none', 'dict', 'mixed'."""
    meta: tuple[tuple[str, Any], ...] = ()
    broadcast_non_tensor: bool = False


def _values(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if not (dtype.is_floating_point or dtype.is_complex):
        info = torch.iinfo(dtype)
        low, high = max(info.min, -(2**62)), min(info.max, 2**62)
        return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype) * 100
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * 1000).to(dtype)
    flat = t.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0], dtype=dtype)
    n = min(flat.numel(), specials.numel())
    flat[:n] = specials[:n]  # NaN, ±inf and -0.0 must survive bit for bit
    return t


def make_leaf(spec: LeafSpec, b: int, g: torch.Generator) -> torch.Tensor:
    dtype = getattr(torch, spec.dtype)
    shape = (b, *spec.tail)
    if spec.kind == "strided":
        wide = _values((*shape[:-1], shape[-1] * 2), dtype, g)
        return wide[..., ::2]
    if spec.kind == "view":
        parent = _values((b + 3, *[d + 2 for d in spec.tail]), dtype, g)
        index = (slice(1, b + 1), *[slice(1, d + 1) for d in spec.tail])
        return parent[index]
    if spec.kind == "expanded":
        return _values((1, *spec.tail), dtype, g).expand(shape)
    if spec.kind == "transposed" and len(shape) >= 2:
        return _values((shape[0], *shape[1:][::-1]), dtype, g).transpose(1, -1)
    return _values(shape, dtype, g)


def _object_values(kind: str, b: int, seed: int) -> np.ndarray:
    arr = np.empty(b, dtype=object)
    for i in range(b):
        choice = kind if kind != "mixed" else ("str", "none", "dict", "int")[(i + seed) % 4]
        if choice == "str":
            arr[i] = f"prompt {seed}-{i} 为什么 π∑"
        elif choice == "none":
            arr[i] = None
        elif choice == "dict":
            arr[i] = {"uid": f"{seed}:{i}", "score": i / 7, "tags": ["a", None], "nested": {"k": i}}
        else:
            arr[i] = i * seed
    return arr


def build_batch(spec: BatchSpec, b: int, seed: int) -> DataProto:
    """The leader's DataProto for ``spec`` with batch size ``b``, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    nested: dict = {}
    for leaf in spec.leaves:
        node = nested
        for part in leaf.key[:-1]:
            node = node.setdefault(part, {})
        node[leaf.key[-1]] = make_leaf(leaf, b, g)
    td = TensorDict(nested, batch_size=[b])
    non_tensor = {k: _object_values(kind, b, seed) for k, kind in spec.non_tensor}
    meta = {
        "global_step": seed,
        "micro_batch_size": max(1, b // 2),
        "sampling": {"stop": ["</s>", None], "top_p": 0.9, "extra": {"depth": [1, {"x": 2}]}},
        **dict(spec.meta),
        NON_TENSOR_FLAG: spec.broadcast_non_tensor,
    }
    return DataProto(td, non_tensor, meta)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    # contiguous() keeps the stride of a size-1 dim, which the dtype view refuses: clone.
    flat = t.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def same_data(a, b) -> bool:
    """Equality of non-tensor data that may hold tensors (verl's ``indices``), bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(raw_bytes(a), raw_bytes(b))
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_data, a, b))
    return type(a) is type(b) and a == b


def leaf_problems(a, b) -> list[str]:
    """How leaf ``b`` differs from ``a`` when either is jagged or non-tensor: a jagged leaf
    component by component (values, offsets, lengths, ragged dim), a non-tensor leaf by type,
    batch size and data."""
    if type(a) is not type(b):
        return [f"is {type(b).__name__}, not {type(a).__name__}"]
    if is_non_tensor_leaf(a):
        same = a.batch_size == b.batch_size and same_data(a.tolist(), b.tolist())
        return [] if same else [f"non-tensor data {b.tolist()!r} != {a.tolist()!r}"]
    if not b.is_nested or b.layout != a.layout or b._ragged_idx != a._ragged_idx:
        return [f"is not a jagged leaf like the leader's ({b.layout})"]
    out = []
    for name in ("values", "offsets", "lengths"):
        x, y = getattr(a, name)(), getattr(b, name)()
        if (x is None) != (y is None):
            out.append(f"{name} present on one side only")
        elif x is not None and (
            x.dtype != y.dtype or x.shape != y.shape or not torch.equal(raw_bytes(x), raw_bytes(y))
        ):
            out.append(f"{name} differ")
    return out


def batch_problems(expected: DataProto, got: DataProto, is_leader: bool, where: str) -> list[str]:
    """Every way ``got`` (a rank's exit state) differs from the leader's batch ``expected``."""
    out = []
    if got.batch is None:
        return [f"{where}: batch is None"]
    if list(got.batch.batch_size) != list(expected.batch.batch_size):
        out.append(f"{where}: batch_size {list(got.batch.batch_size)}")
    want = dict(leaves(expected.batch))
    have = dict(leaves(got.batch))
    if set(want) != set(have):
        out.append(f"{where}: keys {sorted(map(str, have))} != {sorted(map(str, want))}")
    for key in set(want) & set(have):
        a, b = want[key], have[key]
        if is_non_tensor_leaf(a) or is_non_tensor_leaf(b) or a.is_nested or b.is_nested:
            out += [f"{where}: {key!r} {p}" for p in leaf_problems(a, b)]
        elif a.dtype != b.dtype or a.shape != b.shape:
            out.append(
                f"{where}: {key!r} is {b.dtype}{list(b.shape)}, not {a.dtype}{list(a.shape)}"
            )
        elif not torch.equal(raw_bytes(a), raw_bytes(b)):
            out.append(f"{where}: {key!r} bytes differ")
    if got.meta_info != expected.meta_info:
        out.append(f"{where}: meta_info {got.meta_info} != {expected.meta_info}")
    if wants_non_tensor(expected) or is_leader:
        want_nt = expected.non_tensor_batch
    else:
        want_nt = {}  # not flagged: receivers keep what they had, i.e. nothing
    if set(got.non_tensor_batch) != set(want_nt):
        out.append(f"{where}: non_tensor keys {sorted(got.non_tensor_batch)} != {sorted(want_nt)}")
    for key in set(got.non_tensor_batch) & set(want_nt):
        a, b = want_nt[key], got.non_tensor_batch[key]
        if not isinstance(b, np.ndarray) or b.dtype != a.dtype or b.shape != a.shape:
            out.append(
                f"{where}: non_tensor[{key!r}] is {type(b).__name__} {getattr(b, 'shape', '')}"
            )
        elif b.tolist() != a.tolist():
            out.append(f"{where}: non_tensor[{key!r}] values differ")
    return out


# -- hypothesis strategies for specs ------------------------------------------------------------
KEYS = st.text(alphabet="abkxyz_πé", min_size=1, max_size=5)
BIG_KEY = ("payload_big",)  # longer than any drawn key, so it never collides
BIG_ROW_BYTES = 32 << 10


def leaf_specs(key: tuple[str, ...]):
    return st.builds(
        LeafSpec,
        key=st.just(key),
        dtype=st.sampled_from(DTYPE_NAMES),
        tail=st.lists(st.integers(0, 4), max_size=3).map(tuple),
        kind=st.sampled_from(KINDS),
    )


META_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def batch_specs(draw, max_top: int = 5, big: bool | None = None) -> BatchSpec:
    """Random leaves (every dtype, zero-size dims, views, strides, nesting), object arrays,
    nested meta_info and the non-tensor flag both ways. ``big`` adds a 32 KiB-per-row leaf
    so a few rows cross the wire's 64 KiB first message."""
    leaves = []
    for name in draw(st.lists(KEYS, max_size=max_top, unique=True)):
        if draw(st.integers(0, 3)) == 0:
            for sub in draw(st.lists(KEYS, min_size=1, max_size=3, unique=True)):
                leaves.append(draw(leaf_specs((name, sub))))
        else:
            leaves.append(draw(leaf_specs((name,))))
    if big if big is not None else draw(st.booleans()):
        leaves.append(LeafSpec(BIG_KEY, "float32", (BIG_ROW_BYTES // 4,)))
    non_tensor = draw(
        st.lists(
            st.tuples(KEYS, st.sampled_from(["str", "none", "dict", "mixed"])),
            max_size=3,
            unique_by=lambda kv: kv[0],
        )
    )
    meta = draw(st.dictionaries(KEYS, META_VALUES, max_size=3))
    return BatchSpec(
        tuple(leaves),
        tuple(non_tensor),
        tuple(sorted(meta.items())),
        draw(st.booleans()),
    )
