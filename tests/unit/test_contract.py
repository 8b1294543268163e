"""Tier 1 (no process group): the get_data_input contract itself: DataProto validation, the
entry state ROLL's dispatcher leaves, and the strategy registry and its errors.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import strategies
from harness.job.verification import compare, digest, tensor_digest
from strategies import NON_TENSOR_FLAG, ContractError, DataProto, ProcessGroups
from strategies.core import contract


def good_batch(b: int = 4, flag: bool = False) -> DataProto:
    td = TensorDict(
        {"input_ids": torch.arange(b * 3).view(b, 3), "n": {"mask": torch.ones(b, 2)}},
        batch_size=[b],
    )
    texts = np.array([f"t{i}" for i in range(b)], dtype=object)
    return DataProto(
        td, {"text": texts}, {"global_step": 1, "cfg": {"a": [1]}, NON_TENSOR_FLAG: flag}
    )


def fake_groups(
    rank: int = 0, replica: tuple[int, ...] = (0, 1), pp_rank: int = 0
) -> ProcessGroups:
    """Groups for constructing strategies without a process group (never used to send)."""
    return ProcessGroups(
        tp_cp_group=None,
        pp_group=None,
        replica_group=None,
        tp_cp_ranks=replica,
        pp_ranks=(replica[0],),
        replica_ranks=replica,
        pp_rank=pp_rank,
        tp_cp_rank=replica.index(rank),
        rank=rank,
    )


# -- DataProto.validate ----------------------------------------------------------------------
def test_validate_returns_b():
    assert good_batch(5).validate(rank=0) == 5
    assert good_batch(0).validate() == 0  # no process group: rank 0


def test_leading_dim_mismatch_names_key_and_rank():
    dp = good_batch(4)
    dp.batch._tensordict["bad"] = torch.zeros(3, 2)  # bypass TensorDict's own check
    with pytest.raises(ContractError) as err:
        dp.validate(rank=6)
    assert str(err.value) == "rank 6: batch['bad'] has shape [3, 2]; expected leading dim B=4"


def test_nested_leading_dim_mismatch_names_the_nested_key():
    dp = good_batch(4)
    dp.batch["n"]._tensordict["deep"] = torch.zeros(5)
    with pytest.raises(ContractError, match=r"rank 2: batch\[\('n', 'deep'\)\] has shape \[5\]"):
        dp.validate(rank=2)


def test_scalar_leaf_is_refused():
    dp = good_batch(4)
    dp.batch._tensordict["scalar"] = torch.tensor(1.0)
    with pytest.raises(ContractError, match=r"batch\['scalar'\] has shape \[\]; expected leading"):
        dp.validate(rank=0)


def test_non_tensor_wrong_length():
    dp = good_batch(4)
    dp.non_tensor_batch["uid"] = np.array(["a", "b", "c"], dtype=object)
    with pytest.raises(ContractError) as err:
        dp.validate(rank=3)
    assert str(err.value) == "rank 3: non_tensor_batch['uid'] has length 3; expected B=4"


def test_non_tensor_not_an_array_or_scalar():
    dp = good_batch(4)
    dp.non_tensor_batch["uid"] = ["a", "b", "c", "d"]
    with pytest.raises(ContractError, match=r"rank 1: non_tensor_batch\['uid'\] is list"):
        dp.validate(rank=1)
    dp.non_tensor_batch["uid"] = np.array("x", dtype=object)
    with pytest.raises(ContractError, match="has length scalar; expected B=4"):
        dp.validate(rank=1)


def test_batch_none_or_not_a_tensordict_or_no_batch_dim():
    with pytest.raises(ContractError, match="rank 0: the leader's DataProto has batch=None"):
        DataProto().validate(rank=0)
    with pytest.raises(ContractError, match="batch must be a tensordict.TensorDict, got dict"):
        DataProto({"x": torch.zeros(2)}).validate(rank=0)
    with pytest.raises(ContractError, match=r"batch.batch_size is \[\]"):
        DataProto(TensorDict({"x": torch.zeros(2)}, batch_size=[])).validate(rank=0)


# -- entry state -------------------------------------------------------------------------------
def test_entry_state_leader_holds_everything():
    dp = good_batch(4, flag=True)
    leader = dp.entry_state(is_leader=True)
    assert leader is not dp
    assert leader.batch is dp.batch and leader.non_tensor_batch is dp.non_tensor_batch
    assert leader.meta_info is dp.meta_info
    assert leader.broadcast_non_tensor


def test_entry_state_receivers_hold_only_a_copy_of_meta_info():
    dp = good_batch(4, flag=True)
    receiver = dp.entry_state(is_leader=False)
    assert receiver.batch is None and receiver.non_tensor_batch == {}
    assert receiver.meta_info == dp.meta_info and receiver.meta_info is not dp.meta_info
    receiver.meta_info["cfg"]["a"].append(2)  # a deep copy: the leader's stays as it was
    assert dp.meta_info["cfg"]["a"] == [1]
    assert receiver.broadcast_non_tensor


def test_broadcast_non_tensor_flag_defaults_off():
    assert not DataProto().broadcast_non_tensor
    assert not good_batch(flag=False).broadcast_non_tensor
    assert DataProto(meta_info={NON_TENSOR_FLAG: 1}).broadcast_non_tensor


# -- registry ----------------------------------------------------------------------------------
def test_names_lists_choices_without_the_floor():
    choices = strategies.names()
    everything = strategies.names(include_floor=True)
    assert {"pickled", "header", "flat", "scatter_allgather"} <= set(choices)
    assert "floor" not in choices and "floor" in everything
    assert choices == sorted(choices) and set(choices) < set(everything)
    assert not strategies.get_class("floor").selectable


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(KeyError) as err:
        strategies.get("nope", fake_groups())
    msg = str(err.value)
    assert "unknown strategy 'nope'" in msg
    for name in strategies.names(include_floor=True):
        assert repr(name) in msg
    with pytest.raises(KeyError, match="valid names"):
        strategies.get_class("Pickled")


@pytest.mark.parametrize("name", strategies.names(include_floor=True))
def test_every_strategy_is_documented_and_self_consistent(name):
    cls = strategies.get_class(name)
    assert issubclass(cls, strategies.Strategy)
    assert cls.name == name
    assert cls.claims, f"{name} states no collective count in .claims"
    module = importlib.import_module(cls.__module__)
    assert module.__doc__ and module.__doc__.strip(), f"{cls.__module__} has no docstring"
    assert module.STRATEGY is cls


@pytest.mark.parametrize("name", ["pickled", "header", "flat", "scatter_allgather", "floor"])
def test_our_strategies_build_without_a_process_group(name):
    built = strategies.get(name, fake_groups())
    assert repr(built) == f"{strategies.get_class(name).__name__}(rank=0)"


@pytest.mark.parametrize("name", strategies.names(include_floor=True))
def test_unknown_option_is_refused_naming_it(name):
    with pytest.raises(TypeError, match="no_such_option"):
        strategies.get(name, fake_groups(), no_such_option=1)


@pytest.mark.parametrize(
    "name", [n for n in strategies.names() if strategies.get_class(n).world == "ray"]
)
def test_a_ray_only_strategy_refuses_a_rank_that_is_no_ray_actor_naming_world_ray(name):
    """Built in a process that is not a connected Ray actor (a forked or launched world's
    rank): Unsupported at construction, before any collective, one line naming world=ray."""
    missing = strategies.get_class(name).unavailable()
    if missing is not None:
        pytest.skip(missing)
    with pytest.raises(strategies.Unsupported) as err:
        strategies.get(name, fake_groups(rank=1, replica=(0, 1)))
    message = str(err.value)
    assert message.startswith(f"rank 1: {name} needs") and "world=ray" in message, message
    assert len(message.splitlines()) == 1
    assert name not in strategies.names_for_world() and name in strategies.names_for_world("ray")


def test_documented_options_are_accepted():
    for name in ("header", "flat"):
        s = strategies.get(name, fake_groups(), initial_bytes=8192, max_bytes=1 << 20)
        assert s.wire.expect == 8192 and s.wire.max_bytes == 1 << 20
    s = strategies.get("scatter_allgather", fake_groups(), header_bytes=128)
    assert s.header_bytes == 128
    with pytest.raises(ValueError, match="header_bytes must be a multiple of 64"):
        strategies.get("scatter_allgather", fake_groups(), header_bytes=100)


def test_max_bytes_option_is_where_the_docs_say():
    """The world tests pass max_bytes to every strategy that takes it; keep the option name."""
    takes = [
        n
        for n in strategies.names()
        if "max_bytes" in strategies.accepted_options(strategies.get_class(n))
    ]
    assert {"header", "flat", "scatter_allgather"} <= set(takes)


def test_process_groups_defaults():
    g = fake_groups(rank=1, replica=(0, 1, 2))
    assert g.leader == 0 and not g.is_leader
    assert g.tp_cp_size == 3 and g.pp_size == 1
    assert g.device == torch.device("cpu")
    assert g.cpu_replica_group is g.replica_group  # gloo twins default to the groups


def test_from_megatron_needs_initialized_state():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ProcessGroups.from_megatron()


# -- verification helpers on awkward tensors -------------------------------------------------
def one_element_strided() -> torch.Tensor:
    """``big[:, 3]`` with B = 1: one element whose stride is the row length."""
    t = torch.arange(12.0).view(1, 12)[:, 3]
    assert t.shape == (1,) and t.stride() == (12,)
    return t


def test_tensor_digest_of_a_one_element_strided_view():
    t = one_element_strided()
    assert tensor_digest(t) == tensor_digest(t.clone(memory_format=torch.contiguous_format))


def test_floor_prepare_packs_a_one_element_strided_view(monkeypatch):
    monkeypatch.setattr("strategies.floor.dist.broadcast", lambda *a, **k: None)
    floor = strategies.get("floor", fake_groups(rank=0))
    td = TensorDict({"col": one_element_strided(), "x": torch.ones(1, 2)}, batch_size=[1])
    floor.prepare(DataProto(td))
    assert floor.sent.numel() == 4 + 8


def test_compare_names_rank_and_key():
    dp = good_batch(4, flag=True)
    expected = digest(dp, True)
    other = good_batch(4, flag=True)
    other.batch["n", "mask"][1, 1] = 0.5
    other.non_tensor_batch["text"][0] = "changed"
    problems = compare(expected, digest(other, True), rank=5, strategy="x")
    assert any("x: rank 5: key ('n', 'mask') values differ" in p for p in problems), problems
    assert any("non_tensor_batch keys ['text']" in p for p in problems), problems
    assert compare(expected, digest(good_batch(4, flag=True), True), 5, "x") == []


# -- any DataProto-shaped object; a leader's failure as its receivers see it -------------------
def test_validate_takes_any_dataproto_shaped_object_and_names_what_is_not():
    class Shaped:  # the three attributes verl's and ROLL's DataProto have, no methods of ours
        def __init__(self, dp):
            self.batch, self.non_tensor_batch, self.meta_info = (
                dp.batch,
                dp.non_tensor_batch,
                dp.meta_info,
            )

    assert contract.validate(Shaped(good_batch(3)), rank=0) == 3
    with pytest.raises(ContractError, match=r"rank 2: get_data_input takes a DataProto-shaped"):
        contract.validate({"batch": None}, rank=2)
    with pytest.raises(ContractError, match=r"got NoneType, which lacks \['batch'"):
        contract.validate(None, rank=0)


def test_validate_refuses_a_leaf_on_a_foreign_device():
    dp = good_batch(2)
    dp.batch["m"] = torch.empty(2, 3, device="meta")
    with pytest.raises(ContractError, match=r"rank 0: batch\['m'\] is on device meta"):
        dp.validate(rank=0)


def test_raise_failure_ships_any_exception():
    exc = RuntimeError("no batch today")
    text = contract.failure_text(exc)
    assert text == "RuntimeError: no batch today"
    with pytest.raises(strategies.LeaderFailed) as err:
        contract.raise_failure(fake_groups(rank=1), text)
    assert str(err.value) == (
        "rank 1: the replica leader (rank 0) failed to send its batch: RuntimeError: no batch today"
    )
    assert isinstance(err.value, ContractError)
    with pytest.raises(RuntimeError, match="no batch today"):  # the leader: its own exception
        contract.raise_failure(fake_groups(rank=0), text, exc)


# -- leaf kinds: carried exactly or refused, named -------------------------------------------
def with_x(make) -> DataProto:
    dp = good_batch(4)
    dp.batch._tensordict["x"] = make(torch.arange(8.0).view(4, 2))  # bypass TensorDict's checks
    return dp


REFUSED = {
    "sparse COO": lambda x: x.to_sparse(),
    "sparse CSR": lambda x: x.to_sparse_csr(),
    "sparse BSC": lambda x: x.to_sparse_bsc((1, 1)),
    "quantized tensor (torch.quint8)": lambda x: torch.quantize_per_tensor(x, 1.0, 0, torch.quint8),
    "torch.nn.parameter.Parameter, a tensor subclass": torch.nn.Parameter,
    "nested tensor with layout torch.strided": lambda x: torch.nested.nested_tensor(list(x)),
}


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_a_leaf_no_strategy_can_carry_is_refused_naming_key_and_kind(what):
    with pytest.raises(ContractError, match=r"rank 5: batch\['x'\] is ") as err:
        with_x(REFUSED[what]).validate(rank=5)
    assert what in str(err.value) and "get_data_input carries dense strided" in str(err.value)


def test_lazy_leaves_are_carried_as_their_values_and_the_callers_batch_is_left_alone():
    dp = good_batch(4)
    z = torch.complex(torch.ones(4, 2), torch.arange(8.0).view(4, 2))
    dp.batch["z"] = z.conj()
    dp.batch["zero"] = torch._efficientzerotensor(4, 3)
    dp.batch["n", "neg"] = torch._neg_view(torch.ones(4, 1))
    lazy: list = []
    assert contract.validate(dp, rank=0, lazy=lazy) == 4
    assert sorted(lazy) == [("n", "neg"), ("z",), ("zero",)]
    sent = contract.resolve_lazy_views(dp, lazy)
    assert sent is not dp and sent.meta_info is dp.meta_info
    assert not sent.batch["z"].is_conj() and torch.equal(sent.batch["z"], z.conj())
    assert not sent.batch["zero"]._is_zerotensor() and not sent.batch["zero"].any()
    assert torch.equal(sent.batch["n", "neg"], -torch.ones(4, 1))
    assert dp.batch["z"].is_conj() and dp.batch["n", "neg"].is_neg()  # the caller's, untouched
    assert contract.resolve_lazy_views(dp, []) is dp


# -- the failure protocol, with no process group ---------------------------------------------
def test_a_failure_batch_carries_the_leaders_error_and_a_batch_cannot_forge_one():
    sent = contract.failure_batch("KeyError: 'ü' gone", True, torch.device("cpu"))
    assert list(sent.batch.keys()) == [contract.FAILURE_KEY] and sent.broadcast_non_tensor
    assert contract.failure_in(sent) == "KeyError: 'ü' gone"
    assert contract.failure_in(good_batch()) is None and contract.failure_in(None) is None
    with pytest.raises(ContractError, match="is a reserved key"):
        contract.validate(sent, rank=0)


class Recording(strategies.Strategy):
    """Records what its transfer is handed; ``fail`` makes its leader side raise first."""

    name = "recording"

    def __init__(self, groups, fail: Exception | None = None) -> None:
        super().__init__(groups)
        self.fail, self.sent = fail, []

    def transfer(self, batch):
        self.sent.append(batch)
        if self.groups.is_leader and self.fail is not None and len(self.sent) == 1:
            raise self.fail
        return batch


def test_the_leader_ships_whatever_it_raises_before_a_collective_as_a_failure_batch():
    refused = Recording(fake_groups(rank=0))
    with pytest.raises(ContractError, match="got NoneType") as err:
        refused.get_data_input(None)
    assert contract.is_settled(err.value)
    assert contract.failure_in(refused.sent[0]).startswith("ContractError: rank 0: ")
    broken = Recording(fake_groups(rank=0), fail=OSError("disk gone"))
    with pytest.raises(OSError, match="disk gone"):
        broken.get_data_input(good_batch())
    assert [contract.failure_in(b) for b in broken.sent] == [None, "OSError: disk gone"]


def test_a_receiver_raises_leader_failed_naming_the_leaders_error():
    receiver = Recording(fake_groups(rank=1))
    arrived = contract.failure_batch("ValueError: no", False, torch.device("cpu"))
    receiver.transfer = lambda batch: arrived
    with pytest.raises(strategies.LeaderFailed) as err:
        receiver.get_data_input(DataProto())
    assert str(err.value) == (
        "rank 1: the replica leader (rank 0) failed to send its batch: ValueError: no"
    )
    assert Recording(fake_groups(rank=0, replica=(0,))).get_data_input("anything") == "anything"


def test_a_strategy_written_before_transfer_gets_the_same_protocol():
    class Older(strategies.Strategy):
        name = "older"

        def get_data_input(self, batch):
            return "its own body"

    assert Older.get_data_input is strategies.Strategy.get_data_input
    assert Older(fake_groups(rank=1)).get_data_input(DataProto()) == "its own body"
    with pytest.raises(TypeError, match="defines both get_data_input and transfer"):

        class Both(strategies.Strategy):
            def get_data_input(self, batch):
                return batch

            def transfer(self, batch):
                return batch
