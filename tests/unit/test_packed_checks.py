"""The leader's structure-cached validation (``PackedStrategy.checked_parts``): a structure
that passed skips the per-leaf checks, and nothing that breaks the contract slips through."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from strategies import ContractError, DataProto
from strategies.core.recent import RECENT_SHAPES
from strategies.flat import Flat


def leader() -> Flat:
    s = object.__new__(Flat)  # only the checks: no groups, no wire
    s.groups = SimpleNamespace(rank=3, device=torch.device("cpu"))
    s._valid = {}
    s._last_valid = None
    return s


def batch(b: int = 4, n_text: int | None = None, dtype=torch.float32) -> DataProto:
    td = TensorDict({"x": torch.zeros(b, 5, dtype=dtype), "y": torch.ones(b)}, batch_size=[b])
    texts = np.array([f"p{i}" for i in range(b if n_text is None else n_text)], dtype=object)
    return DataProto(td, {"prompt": texts}, {})


def test_a_valid_structure_is_remembered_and_its_parts_returned():
    s = leader()
    parts, shape = s.checked_parts(batch())
    assert [p[0] for p in parts] == [("x",), ("y",)]
    assert list(s._valid) == [shape]
    assert s.checked_parts(batch())[1] == shape


def test_non_tensor_arrays_are_checked_on_every_call():
    s = leader()
    s.checked_parts(batch())
    with pytest.raises(ContractError, match=r"rank 3: non_tensor_batch\['prompt'\] has length 3"):
        s.checked_parts(batch(n_text=3))


def test_a_changed_structure_is_validated_again():
    s = leader()
    s.checked_parts(batch())
    bad = batch()
    bad.batch = TensorDict({"x": torch.zeros(4, 5)}, batch_size=[])  # no leading batch dim
    with pytest.raises(ContractError, match="rank 3: batch.batch_size is"):
        s.checked_parts(bad)
    s.checked_parts(batch(dtype=torch.float64))  # a new dtype: validated, then remembered
    assert list(s._valid)[-1][2][0][3] == torch.float64


def test_recent_structures_are_remembered_and_the_oldest_forgotten():
    """A step that cycles through a few shapes validates each once; a run of ever-new shapes
    keeps only the most recent ``RECENT_SHAPES``."""
    s = leader()
    first = s.checked_parts(batch())[1]
    s.checked_parts(batch(dtype=torch.float64))
    assert first in s._valid  # the first shape again would not be validated again
    for b in range(5, 5 + RECENT_SHAPES):
        s.checked_parts(batch(b))
    assert first not in s._valid and len(s._valid) == RECENT_SHAPES


def test_what_is_no_dataproto_gets_the_contract_error():
    s = leader()
    s.checked_parts(batch())
    with pytest.raises(ContractError, match="DataProto-shaped object"):
        s.checked_parts(SimpleNamespace(batch=batch().batch))
