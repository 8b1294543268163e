"""What a reproduced strategy refuses beyond the contract: the leaves its source describes by
one dense shape and so cannot carry (a jagged NestedTensor; where the source sends tensors only,
a NonTensorData/NonTensorStack leaf too).

The leader raises these before any collective, and ``Strategy.get_data_input`` ships them to
every rank. One wording for all such strategies: the rank, the key, what the leaf is, why the
source cannot carry it (in the strategy's own words, ``why``), and the strategies that can.
"""

from __future__ import annotations

import torch

from strategies.core.contract import ContractError, _key_name, is_non_tensor_leaf, leaves

CARRIERS = "use header, flat, direct, pp_first or scatter_allgather"
"""The strategies every refusal points to: they carry every leaf kind the contract allows."""


def refuse_jagged(batch, rank: int, why: str) -> None:
    """Leader: ContractError naming the first jagged NestedTensor leaf of ``batch``, for a
    source that carries any other leaf (a non-tensor leaf as a pickled value)."""
    for key, value in leaves(batch.batch):
        if isinstance(value, torch.Tensor) and value.is_nested:
            raise ContractError(
                f"rank {rank}: batch[{_key_name(key)!r}] is a jagged NestedTensor; {why}; "
                f"{CARRIERS}"
            )


def refuse_not_dense(key: tuple[str, ...], value, rank: int, why: str) -> None:
    """Leader, one leaf (``key`` as ``contract.leaves`` gives it): ContractError when it is a
    NonTensorData/NonTensorStack leaf or a jagged NestedTensor, for a source that carries dense
    tensors only. Per leaf, so a strategy with checks of its own per leaf keeps their order."""
    if is_non_tensor_leaf(value) or value.is_nested:
        what = type(value).__name__ if is_non_tensor_leaf(value) else "a jagged NestedTensor"
        raise ContractError(
            f"rank {rank}: batch[{_key_name(key)!r}] is {what}; {why}; {CARRIERS} for such leaves"
        )
