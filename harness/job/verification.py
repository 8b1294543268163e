"""Bit-for-bit checks of every rank's result against what its replica leader sent, written once
for every job kind: fingerprints (``digest``, ``tensor_digest``), the one comparison of a rank's
batch with the expected one (``batch_problems``, ``bytes_problems``), and the job's verdict
(``verdict``: ``VerificationError`` naming each rank and key). A broadcast job's ranks compare
with their leader's fingerprint (``harness.job.broadcast``); a dispatch job's driver compares
every rank's with the chunk it cut for that replica (``harness.job.dispatch``)."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

import torch

from harness.errors import VerificationError
from strategies import DataProto
from strategies.core.contract import is_non_tensor_leaf, leaves
from strategies.core.parts import as_bytes


def tensor_digest(t: torch.Tensor) -> str:
    """A fingerprint of the tensor's bytes, hashed where they lie (no copy of a host tensor:
    a copy per leaf was a gigabyte batch's worth of transient memory on every rank). SHA-256,
    not BLAKE2: every rank hashes every batch it checks, and x86 cores since the SHA extensions
    hash SHA-256 in hardware, faster than BLAKE2 in software."""
    raw = as_bytes(t.detach()).cpu()
    return hashlib.sha256(memoryview(raw.numpy())).hexdigest()[:32]


def _data(x) -> str:
    """A fingerprint of non-tensor data that may hold tensors (pickles of equal tensors can
    differ), bit for bit."""
    if isinstance(x, torch.Tensor):
        return f"T{x.dtype}{list(x.shape)}{tensor_digest(x)}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__}[" + ",".join(_data(v) for v in x) + "]"
    if x is None:
        return "None"
    return hashlib.blake2b(pickle.dumps(x), digest_size=16).hexdigest()


def digest(dp: DataProto, with_non_tensor: bool) -> dict:
    """Per-key fingerprints: dtype, shape and a hash of the raw bytes."""
    out: dict = {"batch_size": None, "keys": {}, "non_tensor": None}
    if dp.batch is not None:
        out["batch_size"] = list(dp.batch.batch_size)
        # Every leaf, non-tensor ones included (tensordict's own iteration skips them); a
        # jagged leaf is fingerprinted component by component.
        for key, value in leaves(dp.batch):
            name = key[0] if len(key) == 1 else key
            if is_non_tensor_leaf(value):
                out["keys"][name] = ("non-tensor", list(value.batch_size), _data(value.tolist()))
            elif value.is_nested:
                parts = [value.values(), value.offsets(), value.lengths()]
                shape = [list(p.shape) if p is not None else None for p in parts]
                out["keys"][name] = (str(value.dtype), shape, _data(parts) + str(value._ragged_idx))
            else:
                out["keys"][name] = (str(value.dtype), list(value.shape), tensor_digest(value))
    if with_non_tensor:
        out["non_tensor"] = {
            k: hashlib.blake2b(pickle.dumps(v.tolist()), digest_size=16).hexdigest() + str(v.dtype)
            for k, v in dp.non_tensor_batch.items()
        }
    return out


def delivered(expected: dict, delivers) -> dict:
    """A leader's fingerprint (``digest``) cut to the leaves a receiver's batch holds:
    ``delivers(key path)`` is the strategy's (``Strategy.delivers``: a lazy fetch's fields)."""
    keys = {
        k: v for k, v in expected["keys"].items() if delivers(k if isinstance(k, tuple) else (k,))
    }
    return expected if len(keys) == len(expected["keys"]) else {**expected, "keys": keys}


def compare(expected: dict, got: dict, rank: int, strategy: str) -> list[str]:
    """Every difference, each naming the rank and the key."""
    problems = []
    where = f"{strategy}: rank {rank}"
    if got["batch_size"] != expected["batch_size"]:
        problems.append(
            f"{where}: batch_size {got['batch_size']} != leader's {expected['batch_size']}"
        )
    for key, (dtype, shape, h) in expected["keys"].items():
        if key not in got["keys"]:
            problems.append(f"{where}: key {key!r} missing")
            continue
        gdtype, gshape, gh = got["keys"][key]
        if gdtype != dtype:
            problems.append(f"{where}: key {key!r} dtype {gdtype} != leader's {dtype}")
        elif gshape != shape:
            problems.append(f"{where}: key {key!r} shape {gshape} != leader's {shape}")
        elif gh != h:
            problems.append(f"{where}: key {key!r} values differ from the leader's")
    for key in got["keys"]:
        if key not in expected["keys"]:
            problems.append(f"{where}: unexpected key {key!r}")
    if expected["non_tensor"] != got["non_tensor"]:
        exp, g = expected["non_tensor"] or {}, got["non_tensor"] or {}
        bad = sorted(k for k in set(exp) | set(g) if exp.get(k) != g.get(k))
        problems.append(f"{where}: non_tensor_batch keys {bad} differ from the leader's")
    return problems


def bytes_problems(name: str, rank: int, expected: str, got: str, source: str = "") -> list[str]:
    """A raw method's received bytes (a floor's) against the sent ones, by fingerprint."""
    if got == expected:
        return []
    return [f"{name}: rank {rank}: received bytes differ" + (f" from {source}" if source else "")]


def batch_problems(
    name: str,
    rank: int,
    expected: dict,
    got: dict,
    *,
    meta_changed: bool,
    non_tensor_sent: bool,
    receiver: bool,
) -> list[str]:
    """Every way a rank's batch (fingerprinted with its non-tensor batch: ``digest(dp, True)``)
    differs from the expected one: non-tensor data that arrived although the batch did not ask
    for it (on a receiver), a changed ``meta_info``, then key by key (``compare``). Where the
    non-tensor batch was not sent, it is not compared."""
    if not non_tensor_sent:
        if receiver and got["non_tensor"]:
            return [f"{name}: rank {rank}: non_tensor_batch arrived although not flagged"]
        expected, got = dict(expected, non_tensor=None), dict(got, non_tensor=None)
    if meta_changed:
        return [f"{name}: rank {rank}: meta_info changed"]
    return compare(expected, got, rank, name)


def verdict(problems: Sequence[str], shown: int = 10) -> None:
    """Raise VerificationError naming the first ``shown`` problems (each names its rank and
    key); nothing when there are none."""
    if problems:
        more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
        raise VerificationError("; ".join(problems[:shown]) + more)
