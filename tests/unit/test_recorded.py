"""Bring your own batch and strategy, tier 1: recorded batches (every format, safe loading,
resampling, one-line refusals), schema extract/replay, and the registry's targets, options and
optional plans. No process group.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from verl_support import verl_dataproto, verl_worker_payload

import strategies
from harness.job.verification import digest
from harness.paths import CONF_DIR
from harness.payload import (
    generated,
    payload_schema,
    recording,
    schema_extract,
    schema_replay,
    user_files,
)
from strategies import DataProto
from strategies.core.contract import leaves


def same_batch(a: DataProto, b) -> None:
    assert digest(DataProto(b.batch, dict(b.non_tensor_batch), dict(b.meta_info)), True) == digest(
        a, True
    )


# -- recorded batches ------------------------------------------------------------------------------
def test_verl_save_to_disk_loads_without_verl_classes(tmp_path):
    dp = verl_dataproto(3, 0, True)
    dp.save_to_disk(tmp_path / "batch.pkl")
    got = recording.load(tmp_path / "batch.pkl")
    assert type(got) is DataProto
    same_batch(got, dp)
    assert got.meta_info == dp.meta_info


def test_verl_worker_payload_keeps_jagged_and_non_tensor_leaves(tmp_path):
    dp = verl_worker_payload(3, 1)
    dp.save_to_disk(tmp_path / "worker.pkl")
    got = recording.load(tmp_path / "worker.pkl")
    same_batch(got, dp)
    assert got.batch["input_ids"].is_nested


@pytest.mark.parametrize("how", ["torch_save", "memmap", "ours"])
def test_tensordict_and_our_dataproto_formats(tmp_path, how):
    dp = generated.make("rl_rollout", 4, 32, seed=2)
    path = tmp_path / "rec"
    if how == "torch_save":
        torch.save(dp.batch, path)
        expected = DataProto(dp.batch, {}, {})
    elif how == "memmap":
        dp.batch.memmap(path)
        expected = DataProto(dp.batch, {}, {})
    else:
        recording.save(dp, path)
        expected = dp
    got = recording.load(path)
    same_batch(got, expected)
    assert got.meta_info == expected.meta_info


@pytest.mark.parametrize("rows", [1, 3, 4, 10])
def test_resample_repeats_or_trims_rows_in_order(rows):
    dp = verl_dataproto(4, 0, True)
    dp = DataProto(dp.batch, dp.non_tensor_batch, dp.meta_info)
    out = recording.resample(dp, rows)
    index = torch.arange(rows) % 4
    assert out.batch.batch_size[0] == rows
    assert torch.equal(out.batch["input_ids"], dp.batch["input_ids"][index])
    assert list(out.non_tensor_batch["uid"]) == list(dp.non_tensor_batch["uid"][index.numpy()])


def test_make_sets_the_non_tensor_flag_when_asked(tmp_path):
    recording.save(generated.make("pretrain", 2, 16, seed=0), tmp_path / "b.pt")
    dp = recording.make(str(tmp_path / "b.pt"), 5, broadcast_non_tensor=True)
    assert dp.batch.batch_size[0] == 5 and dp.broadcast_non_tensor


class _RunsCode:
    """Pickles as a call to ``open(marker, "w")``: loading it would create the marker."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("writer", [pickle.dump, torch.save])
def test_unsafe_file_is_refused_without_running_it(tmp_path, writer):
    marker = tmp_path / "ran"
    with open(tmp_path / "evil", "wb") as f:
        writer({"batch": _RunsCode(marker)}, f)
    with pytest.raises(user_files.PayloadFileError) as err:
        recording.load(tmp_path / "evil")
    message = str(err.value)
    assert "\n" not in message
    assert "open" in message and "payload.trust=true" in message
    assert not marker.exists()


def test_trust_lifts_the_allow_list(tmp_path):
    td = TensorDict({"x": torch.arange(6).reshape(3, 2)}, batch_size=[3])
    with open(tmp_path / "plain.pkl", "wb") as f:
        pickle.dump({"batch": td, "meta_info": {"k": 1}}, f)  # TensorDict's own pickle
    with pytest.raises(user_files.PayloadFileError, match="tensordict"):
        recording.load(tmp_path / "plain.pkl")
    got = recording.load(tmp_path / "plain.pkl", trust=True)
    assert torch.equal(got.batch["x"], td["x"]) and got.meta_info == {"k": 1}


def test_bad_files_say_what_is_wrong_in_one_line(tmp_path):
    (tmp_path / "junk").write_bytes(b"not a batch")
    torch.save(TensorDict({"x": torch.ones(3)}, batch_size=[]), tmp_path / "nodim.pt")
    torch.save(torch.ones(3), tmp_path / "tensor.pt")
    cases = {
        tmp_path / "missing.pt": "no such file",
        tmp_path / "junk": "is not a batch bcastbench can read",
        tmp_path / "nodim.pt": "no leading batch dimension",
        tmp_path / "tensor.pt": "holds a Tensor, not a batch",
        tmp_path: "not a TensorDict.memmap directory",
    }
    for path, expected in cases.items():
        with pytest.raises(user_files.PayloadFileError) as err:
            recording.load(path)
        assert expected in str(err.value) and "\n" not in str(err.value)


# -- schema ------------------------------------------------------------------------------------------
def shape_of(dp: DataProto) -> list:
    out = []
    for key, value in leaves(dp.batch):
        if isinstance(value, torch.Tensor):
            trailing = tuple(value.unbind(0)[0].shape[1:]) if value.is_nested else value.shape[1:]
            out.append((key, value.dtype, value.is_nested, tuple(trailing)))
        else:
            out.append((key, type(value).__name__))
    return out


@pytest.mark.parametrize(
    "make",
    [
        lambda: generated.make("multimodal", 4, 64, seed=1),
        lambda: verl_dataproto(4, 0, True),
        lambda: verl_worker_payload(4, 0),
    ],
    ids=["multimodal", "verl_dataproto", "verl_worker"],
)
def test_schema_round_trip_keeps_keys_dtypes_shapes(tmp_path, make):
    original = make()
    dp = DataProto(original.batch, dict(original.non_tensor_batch), dict(original.meta_info))
    payload_schema.write(schema_extract.extract(dp), tmp_path / "s.yaml")
    text = (tmp_path / "s.yaml").read_text()
    replayed = schema_replay.make(str(tmp_path / "s.yaml"), 7, seed=3)
    assert replayed.batch.batch_size[0] == 7
    assert shape_of(replayed) == shape_of(dp)
    assert {k: v.dtype for k, v in replayed.non_tensor_batch.items()} == {
        k: v.dtype for k, v in dp.non_tensor_batch.items()
    }
    assert set(replayed.meta_info) == set(dp.meta_info)
    for key, values in dp.non_tensor_batch.items():  # no data in the schema
        assert all(str(v) not in text for v in values if len(str(v)) > 6), key
    again = schema_replay.make(str(tmp_path / "s.yaml"), 7, seed=3)
    assert digest(again, True) == digest(replayed, True)


def test_jagged_lengths_come_from_the_recorded_distribution():
    dp = verl_worker_payload(8, 0)
    entry = next(e for e in schema_extract.extract(dp)["leaves"] if e["key"] == ["input_ids"])
    low, high = entry["lengths"]["percentiles"][0], entry["lengths"]["percentiles"][-1]
    lengths = np.diff(
        schema_replay.replay(schema_extract.extract(dp), 64, 1).batch["input_ids"].offsets()
    )
    assert low <= lengths.min() and lengths.max() <= high


@pytest.mark.parametrize("name", ["rl_rollout", "multimodal"])
def test_committed_schemas_replay(name):
    dp = schema_replay.make(str(CONF_DIR / "schemas" / f"{name}.yaml"), 3, seed=0)
    assert dp.batch.batch_size[0] == 3 and dp.non_tensor_batch


def test_a_file_that_is_no_schema_is_refused(tmp_path):
    (tmp_path / "x.yaml").write_text("strategy: header\n")
    with pytest.raises(payload_schema.SchemaError, match="not a bcastbench schema"):
        payload_schema.read(tmp_path / "x.yaml")


# -- the registry: targets, options, plans -------------------------------------------------------------
def test_dotted_target_resolves_like_a_name():
    assert strategies.get_class("strategies.header.HeaderStrategy") is strategies.get_class(
        "header"
    )
    assert strategies.get_class("strategies.header:STRATEGY") is strategies.get_class("header")


@pytest.mark.parametrize(
    ("target", "expected"),
    [("no_such_pkg.mod.Cls", "cannot be imported"), ("strategies.core.layout.Layout", "not a")],
)
def test_bad_target_is_one_line(target, expected):
    with pytest.raises(KeyError, match=expected):
        strategies.get_class(target)


def test_options_are_checked_against_the_signature_chain():
    strategies.check_options("direct", {"direct_min_bytes": 1, "max_bytes": 2})
    with pytest.raises(TypeError) as err:
        strategies.check_options("direct", {"direct_min_byte": 1})
    assert str(err.value) == (
        "strategy 'direct' has no option 'direct_min_byte'; accepted options: "
        "['direct_min_bytes', 'eager_max_bytes', 'initial_bytes', 'max_bytes']"
    )
    with pytest.raises(TypeError, match="accepted options: none"):
        strategies.check_options("megatron_broadcast_data", {"x": 1})


class NoPlan(strategies.Strategy):
    """A strategy that states no plan (a user's may not)."""

    name = "no_plan"


def test_plan_is_optional_and_predict_names_who_has_none():
    from harness.commands.predict import scaled_spec
    from harness.model.prices import predict_all
    from strategies.core.cluster import load_cluster
    from strategies.core.layout import Layout

    target = f"{__name__}.NoPlan"
    assert not strategies.has_plan(target)
    built_in = [
        n
        for n in strategies.names(include_floor=True)
        if strategies.get_class(n).__module__.startswith("strategies.")
    ]  # an installed user strategy (the example's per_key) may have none
    assert all(strategies.has_plan(n) for n in built_in)
    preds = predict_all(
        Layout(tp=2, pp=2), scaled_spec("rl_rollout", 8, 64), load_cluster("local"), [target]
    )
    assert preds[target].startswith("n/a: no plan()")
    assert not isinstance(preds["floor"], str)
