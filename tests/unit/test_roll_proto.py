"""Tier 1 (no process group): the ROLL-shaped DataProto pickles as ROLL's does (torch.save into
a buffer, never consolidating), round-trips bit for bit, and refuses what ROLL's
check_consistency refuses; ROLL's .batch proxy pickles its attributes, not a torch.save buffer.
"""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import tensordict
import torch
from batchgen import BatchSpec, LeafSpec, batch_problems, build_batch
from tensordict import TensorDict

from strategies import NON_TENSOR_FLAG, DataProto
from strategies.core.roll_proto import (
    ConsistencyError,
    RollBatchProxy,
    RollDataProto,
    roll_consolidates,
)
from strategies.core.trace import WORK

SPEC = BatchSpec(
    leaves=(
        LeafSpec(("input_ids",), "int64", (5,)),
        LeafSpec(("bf16",), "bfloat16", (3, 2), "strided"),
        LeafSpec(("c64",), "complex64", (2,), "view"),
        LeafSpec(("mask", "bool"), "bool", (4,), "transposed"),
        LeafSpec(("mask", "empty"), "float32", (0,)),
        LeafSpec(("wide",), "float64", (3,), "expanded"),
    ),
    non_tensor=(("text", "str"), ("extra", "mixed")),
)


def roll_of(flag: bool = True, b: int = 3) -> tuple[DataProto, RollDataProto]:
    dp = build_batch(SPEC, b, seed=11)
    dp.meta_info[NON_TENSOR_FLAG] = flag
    return dp, RollDataProto(dp.batch, dp.non_tensor_batch, dp.meta_info)


def test_round_trip_is_exact_and_meta_info_travels():
    dp, roll = roll_of()
    back = pickle.loads(pickle.dumps(roll))
    assert type(back) is RollDataProto
    got = DataProto(back.batch, back.non_tensor_batch, back.meta_info)
    assert batch_problems(dp, got, is_leader=False, where="round trip") == []
    assert back.meta_info == dp.meta_info and back.meta_info is not dp.meta_info


def test_getstate_writes_the_tensordict_with_torch_save_into_a_buffer(monkeypatch):
    _, roll = roll_of()
    saved, loaded = [], []
    real_save, real_load = torch.save, torch.load

    def save(obj, f, *args, **kwargs):
        saved.append((type(obj), type(f)))
        return real_save(obj, f, *args, **kwargs)

    def load(f, *args, **kwargs):
        loaded.append((type(f), kwargs.get("map_location"), kwargs.get("weights_only")))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(torch, "load", load)
    state = roll.__getstate__()
    assert saved == [(TensorDict, io.BytesIO)]
    assert isinstance(state[0], io.BytesIO) and state[1:] == (
        roll.non_tensor_batch,
        None,
        roll.meta_info,
    )
    pickle.loads(pickle.dumps(roll))
    assert len(saved) == 2  # pickling calls __getstate__ once more
    map_location = None if torch.accelerator.is_available() else "cpu"
    assert loaded == [(io.BytesIO, map_location, False)]


def test_torch_save_and_load_bytes_are_counted_as_copies():
    _, roll = roll_of()
    before = WORK["copied_bytes"]
    blob = pickle.dumps(roll)
    saved = WORK["copied_bytes"] - before
    assert saved > sum(t.nbytes for t in roll.batch.values(include_nested=True, leaves_only=True))
    pickle.loads(blob)
    assert WORK["copied_bytes"] - before == 2 * saved


def test_the_consolidate_guard_is_a_string_comparison_false_for_every_version_roll_allows():
    for version in ("0.10.0", "0.11.1", "0.15.3", "0.19.0", tensordict.__version__):
        assert not roll_consolidates(version), version
    assert roll_consolidates("0.5.0") and roll_consolidates("0.9.2")  # below ROLL's floor


def test_pickling_never_consolidates(monkeypatch):
    _, roll = roll_of()
    calls = []
    monkeypatch.setattr(TensorDict, "consolidate", lambda self, *a, **k: calls.append(1))
    pickle.loads(pickle.dumps(roll))
    assert calls == []


def test_the_batch_proxy_pickles_its_attributes_not_a_torch_save_buffer(monkeypatch):
    dp, roll = roll_of(flag=False)
    proxy = roll.batch_proxy()
    assert isinstance(proxy, RollBatchProxy) and proxy.batch_size == dp.batch.batch_size
    saved = []
    real_save = torch.save

    def save(obj, *args, **kwargs):
        saved.append(type(obj))
        return real_save(obj, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    back = pickle.loads(pickle.dumps(proxy))
    assert TensorDict not in saved  # the TensorDict goes by its own pickling
    assert back._remote_batch is None and back._batch_size == 3
    with pytest.raises(AttributeError, match="'RollBatchProxy' object has no attribute 'items'"):
        back.items  # noqa: B018 (ROLL's proxy answers only what it defines)
    receiver = RollDataProto(None, {}, dict(dp.meta_info))
    receiver.batch = back  # ROLL's setter: a shallow copy of the proxy's TensorDict
    assert receiver.batch is not back._batch
    got = DataProto(receiver.batch, {}, dp.meta_info)  # flag false: arrays stay behind
    assert batch_problems(dp, got, is_leader=False, where="proxy") == []


def test_setters_copy_what_they_are_given():
    dp, roll = roll_of()
    roll.batch = dp.batch
    roll.non_tensor_batch = dp.non_tensor_batch
    assert roll.batch is not dp.batch and roll.non_tensor_batch is not dp.non_tensor_batch
    assert roll.batch["input_ids"] is dp.batch["input_ids"]  # shallow: the tensors are shared


def test_of_wraps_any_dataproto_shaped_object_without_copying():
    dp, roll = roll_of()
    wrapped = RollDataProto.of(dp)
    assert wrapped.batch is dp.batch and wrapped.non_tensor_batch is dp.non_tensor_batch
    assert wrapped.meta_info is dp.meta_info and RollDataProto.of(roll) is roll


def td(b: int = 2) -> TensorDict:
    return TensorDict({"x": torch.zeros(b, 3)}, [b])


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda: RollDataProto(TensorDict({"x": torch.zeros(2, 3)}, [2, 3])),
            r"batch_size \[2, 3\]; ROLL supports exactly one batch dimension",
        ),
        (
            lambda: RollDataProto(td(), {"t": np.array(["a", "b"])}),
            r"non_tensor_batch\['t'\] is dtype <U1; ROLL requires a numpy array with dtype=object",
        ),
        (
            lambda: RollDataProto(td(), {"t": ["a", "b"]}),
            r"non_tensor_batch\['t'\] is list",
        ),
        (
            lambda: RollDataProto(td(), {"t": np.array(["a", "b", "c"], dtype=object)}),
            r"non_tensor_batch\['t'\] has length 3; expected batch size B=2",
        ),
        (
            lambda: RollDataProto(td(), {"x": np.array(["a", "b"], dtype=object)}),
            r"keys \['x'\] are in both batch and non_tensor_batch",
        ),
        (
            lambda: RollDataProto(None, {"t": np.array(["a"], dtype=object)}),
            r"non_tensor_batch has keys \['t'\] but batch is None",
        ),
    ],
    ids=["two_batch_dims", "not_object", "not_array", "wrong_length", "overlap", "no_batch"],
)
def test_check_consistency_refuses_what_roll_refuses(make, message):
    with pytest.raises(ConsistencyError, match=message):
        make()


def test_setters_recheck_consistency():
    roll = RollDataProto(td(), {"t": np.array(["a", "b"], dtype=object)})
    with pytest.raises(ConsistencyError, match="expected batch size B=2"):
        roll.non_tensor_batch = {"t": np.array(["a"], dtype=object)}
    with pytest.raises(ConsistencyError, match="got dict"):
        roll.batch = {"x": torch.zeros(2)}
