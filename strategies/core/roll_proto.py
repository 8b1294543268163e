"""A DataProto shaped like ROLL's (``roll/distributed/scheduler/protocol.py``), written here from
its described behaviour: what the ROLL-faithful ``pickled`` baseline pickles, and a third
DataProto-shaped type for interop tests.

What it reproduces, because it is what ROLL pays for at each ``broadcast_object_list`` hop:

- a plain class (not a dataclass) holding ``batch`` (a TensorDict), ``non_tensor_batch`` (object
  arrays with one batch dimension, checked as ROLL's ``check_consistency`` checks them) and
  ``meta_info``;
- pickling calls ``__getstate__``, which writes the TensorDict with ``torch.save`` into an
  in-memory buffer; the buffer, non_tensor_batch, ROLL's remote batch (always None here) and
  meta_info are then pickled. ``__setstate__`` reads the TensorDict back with ``torch.load``
  (``map_location="cpu"`` when there is no accelerator, else onto the devices it was saved from);
- ROLL's consolidate step and its guard (see ``roll_consolidates``): never taken on any
  tensordict ROLL allows;
- ROLL's ``.batch`` getter returns a proxy over the TensorDict, and its flag-false path pickles
  that proxy. ``batch_proxy()`` returns one that pickles the same way (see ``RollBatchProxy``);
  ``.batch`` itself returns the TensorDict, so other code reads a ROLL-shaped object as it reads
  ours and verl's;
- the setters copy what they are given (a shallow TensorDict or dict copy) and re-check
  consistency, as ROLL's do.

Not reproduced: ROLL's remote batches, indexing, chunking and the rest of its API; its setters'
silent removal of keys present in both batch and non_tensor_batch (``check_consistency``
refuses those instead).

Local work is counted in ``strategies.core.trace.WORK``: ``torch.save`` and ``torch.load`` each
copy every saved byte once (``copied_bytes``).
"""

from __future__ import annotations

import io
import pickle
from functools import cache
from typing import Any

import numpy as np
import tensordict
import torch
from tensordict import TensorDict

from strategies.core.contract import NON_TENSOR_FLAG, ContractError
from strategies.core.trace import WORK

ROLL_CONSOLIDATE_SINCE = "0.5.0"
"""The version string ROLL compares tensordict's version with before consolidating."""


class ConsistencyError(ContractError):
    """A ROLL-shaped DataProto that ROLL's ``check_consistency`` would refuse."""


def roll_consolidates(version: str) -> bool:
    """ROLL's guard before ``contiguous().consolidate()`` in ``__getstate__``.

    ROLL compares version *strings*, so the comparison is lexicographic: "0.10.0" < "0.5.0"
    because "1" < "5". ROLL requires tensordict >= 0.10, and every such version compares below
    "0.5.0", so ROLL never consolidates. The guard is kept as ROLL wrote it (rather than a plain
    ``False``) so its effect follows the installed version exactly as ROLL's would.
    """
    return version >= ROLL_CONSOLIDATE_SINCE


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


class RollBatchProxy:
    """What ROLL's ``DataProto.batch`` returns: a proxy over the TensorDict and ROLL's remote
    batch (always None here).

    It defines no pickling of its own, so pickling it pickles its attributes: the TensorDict by
    TensorDict's own pickling (not by ``torch.save`` into a buffer), None and the batch size.
    That is what ROLL's flag-false hop sends. Like ROLL's proxy, it answers item access and the
    few TensorDict properties ROLL keeps, and raises AttributeError for anything else.
    """

    def __init__(self, batch: TensorDict | None, remote_batch: Any, batch_size: int) -> None:
        self._batch = batch
        self._remote_batch = remote_batch
        self._batch_size = batch_size

    def copy(self) -> RollBatchProxy:
        """A shallow copy, as ROLL's setter takes before storing what it was given."""
        batch = self._batch.copy() if self._batch is not None else None
        return RollBatchProxy(batch, self._remote_batch, self._batch_size)

    def __getitem__(self, key: str):
        if self._batch is not None and key in self._batch.keys():
            return self._batch[key]
        raise KeyError(f"key {key!r} not in the batch")

    def __contains__(self, key: str) -> bool:
        return self._batch is not None and key in self._batch.keys()

    def keys(self) -> set:
        return set(self._batch.keys()) if self._batch is not None else set()

    @property
    def batch_size(self) -> torch.Size:
        if self._batch is None:
            raise AttributeError("RollBatchProxy has no batch_size: its batch is None")
        return self._batch.batch_size

    def __getattr__(self, name: str):
        # Only reached for names not defined above (pickle's own lookups included, which treat
        # the AttributeError as "not defined"), as in ROLL's proxy.
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


class RollDataProto:
    """ROLL's DataProto as far as ``get_data_input`` and its pickling are concerned."""

    def __init__(
        self,
        batch: TensorDict | None = None,
        non_tensor_batch: dict[str, np.ndarray] | None = None,
        meta_info: dict[str, Any] | None = None,
        *,
        check: bool = True,
    ) -> None:
        self._batch = batch
        self._non_tensor_batch = non_tensor_batch if non_tensor_batch is not None else {}
        self.meta_info = meta_info if meta_info is not None else {}
        if check:  # ROLL checks on construction; wrapping a checked batch may skip it
            self.check_consistency()

    @classmethod
    def of(cls, dp: Any) -> RollDataProto:
        """Any DataProto-shaped object (batch / non_tensor_batch / meta_info) as a ROLL-shaped
        one sharing its parts (no copy); a RollDataProto is returned as it is."""
        if isinstance(dp, cls):
            return dp
        return cls(dp.batch, dp.non_tensor_batch, dp.meta_info, check=False)

    # -- the fields ----------------------------------------------------------------------------
    @property
    def batch(self) -> TensorDict | None:
        return self._batch

    @batch.setter
    def batch(self, value: TensorDict | RollBatchProxy) -> None:
        self.set_batch(value)

    def set_batch(self, value: TensorDict | RollBatchProxy, check: bool = True) -> None:
        """ROLL's batch setter: store a shallow copy of a TensorDict or of a proxy's TensorDict,
        then (with ``check``) run ``check_consistency``."""
        if isinstance(value, RollBatchProxy):
            self._batch = value.copy()._batch
        elif isinstance(value, TensorDict):
            self._batch = value.copy()
        else:
            raise ConsistencyError(
                f"batch must be a TensorDict or a RollBatchProxy, got {type(value).__name__}"
            )
        if check:
            self.check_consistency()

    @property
    def non_tensor_batch(self) -> dict[str, np.ndarray]:
        return self._non_tensor_batch

    @non_tensor_batch.setter
    def non_tensor_batch(self, value: dict[str, np.ndarray]) -> None:
        self.set_non_tensor_batch(value)

    def set_non_tensor_batch(self, value: dict[str, np.ndarray], check: bool = True) -> None:
        """ROLL's non_tensor_batch setter: store a shallow copy, then (with ``check``) check."""
        if not isinstance(value, dict):
            raise ConsistencyError(f"non_tensor_batch must be a dict, got {type(value).__name__}")
        self._non_tensor_batch = value.copy()
        if check:
            self.check_consistency()

    @property
    def broadcast_non_tensor(self) -> bool:
        return bool(self.meta_info.get(NON_TENSOR_FLAG, False))

    def batch_proxy(self) -> RollBatchProxy:
        """What ROLL's ``.batch`` getter returns (and its flag-false hop pickles)."""
        return RollBatchProxy(self._batch, None, len(self))

    def __len__(self) -> int:
        if self._batch is not None:
            return int(self._batch.batch_size[0]) if self._batch.batch_size else 0
        if self._non_tensor_batch:
            return len(next(iter(self._non_tensor_batch.values())))
        return 0

    def __repr__(self) -> str:
        return (
            f"RollDataProto(batch={self._batch}, non_tensor_batch={self._non_tensor_batch}, "
            f"meta_info={self.meta_info})"
        )

    def check_consistency(self) -> None:
        """ROLL's checks: one batch dimension, disjoint keys, and every non-tensor value an
        object-dtype numpy array of length B. Raises ConsistencyError naming what is wrong."""
        keys: set = set()
        if self._batch is not None:
            if len(self._batch.batch_size) != 1:
                raise ConsistencyError(
                    f"batch has batch_size {list(self._batch.batch_size)}; ROLL supports "
                    "exactly one batch dimension"
                )
            keys.update(self._batch.keys())
        if not self._non_tensor_batch:
            return
        if self._batch is None:
            raise ConsistencyError(
                f"non_tensor_batch has keys {sorted(self._non_tensor_batch)} but batch is None; "
                "ROLL takes B from the batch"
            )
        overlap = keys & set(self._non_tensor_batch)
        if overlap:
            raise ConsistencyError(
                f"keys {sorted(overlap)} are in both batch and non_tensor_batch; ROLL requires "
                "them disjoint"
            )
        b = int(self._batch.batch_size[0])
        for key, arr in self._non_tensor_batch.items():
            if not isinstance(arr, np.ndarray) or arr.dtype != object:
                got = f"dtype {arr.dtype}" if isinstance(arr, np.ndarray) else type(arr).__name__
                raise ConsistencyError(
                    f"non_tensor_batch[{key!r}] is {got}; ROLL requires a numpy array with "
                    "dtype=object"
                )
            if arr.ndim < 1 or arr.shape[0] != b:
                length = arr.shape[0] if arr.ndim else "scalar"
                raise ConsistencyError(
                    f"non_tensor_batch[{key!r}] has length {length}; expected batch size B={b}"
                )

    # -- pickling: what each hop pays -----------------------------------------------------------
    def __getstate__(self):
        buffer = io.BytesIO()
        if roll_consolidates(tensordict.__version__) and self._batch is not None:
            self._batch = self._batch.contiguous().consolidate()
        torch.save(self._batch, buffer)
        WORK["copied_bytes"] += buffer.tell()
        # ROLL's state tuple: the buffer, non_tensor_batch, its remote batch, meta_info.
        return buffer, self._non_tensor_batch, None, self.meta_info

    def __setstate__(self, state) -> None:
        buffer, non_tensor_batch, _remote_batch, meta_info = state
        WORK["copied_bytes"] += buffer.seek(0, io.SEEK_END)
        buffer.seek(0)
        self._batch = torch.load(
            buffer, weights_only=False, map_location=None if _has_accelerator() else "cpu"
        )
        self._non_tensor_batch = non_tensor_batch
        self.meta_info = meta_info


@cache
def loads_back(dtype: torch.dtype, torch_save: bool) -> bool:
    """Whether a tensor of ``dtype`` survives the pickling a hop uses: ``torch.save`` into a
    buffer (ROLL's flag-true hop) or plain pickle (the others). Torch pickles a tensor by its
    storage and its loader refuses some dtypes it saves without complaint (float8, uint16/32/64
    under plain pickle), so the receivers would fail after the leader had sent: the leader
    checks first."""
    try:
        t = torch.zeros(1, dtype=dtype)
        if torch_save:
            buffer = io.BytesIO()
            torch.save(t, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=False)
        else:
            pickle.loads(pickle.dumps(t))
    except Exception:  # noqa: BLE001 -- any failure means receivers would fail too
        return False
    return True
