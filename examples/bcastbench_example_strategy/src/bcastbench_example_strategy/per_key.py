"""``per_key``: the leader describes the batch in one pickled header, then broadcasts every
tensor on its own (or, with ``coalesce=True``, all of them as one byte buffer), over the whole
replica in one hop.

It is written as a user would write it: ``from torch.distributed import broadcast`` (a name
bound at import, which bcastbench's recorder still counts) and no ``plan()`` (``bcastbench
predict`` lists it among the strategies without one). Dense tensor leaves only (``check``
refuses the others); the non-tensor batch rides in the header when
``meta_info['_broadcast_non_tensor_batch']`` is set.

It writes no failure handling: ``strategies.Strategy.get_data_input`` runs ``transfer`` and
holds the contract. A leader whose batch is refused, or whose header will not pickle, sends a
failure batch through this same ``transfer`` instead, and every rank raises its error.

Per call: 2 (header size, header) + one per tensor, or + 1 with ``coalesce``.
"""

from __future__ import annotations

import pickle

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, is_tensor_collection
from torch.distributed import broadcast

from strategies import NON_TENSOR_FLAG, ContractError, DataProto, Strategy
from strategies.core.parts import as_bytes  # a tensor's elements as bytes, any dtype or view


class PerKeyBroadcast(Strategy):
    name = "per_key"
    claims = "2 + one broadcast per tensor (coalesce: 2 + 1)"

    def __init__(self, groups, coalesce: bool = False) -> None:
        super().__init__(groups)
        self.coalesce = coalesce

    def _bcast_bytes(self, payload: bytes | None) -> bytes:
        """Size, then bytes, from the leader to the replica (as uint8 tensors)."""
        g = self.groups
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        size = size.to(g.device)  # the tensor received into is the one read below
        broadcast(size, g.leader, group=g.replica_group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=g.device)
        if payload is not None:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        broadcast(buf, g.leader, group=g.replica_group)
        return buf.cpu().numpy().tobytes()

    def check(self, batch) -> None:
        """Only dense tensors travel here; anything else is refused on every rank."""
        leaves = batch.batch.items(include_nested=True, leaves_only=True, is_leaf=_any_leaf)
        for key, value in leaves:
            if not isinstance(value, torch.Tensor) or value.is_nested:
                raise ContractError(
                    f"rank {self.groups.rank}: batch[{key!r}] is {type(value).__name__}; "
                    "per_key sends dense tensors only"
                )

    def transfer(self, batch) -> DataProto:
        g = self.groups
        flag = bool(batch.meta_info.get(NON_TENSOR_FLAG, False))
        header = None
        if g.is_leader:
            leaves = list(batch.batch.items(include_nested=True, leaves_only=True))
            header = pickle.dumps(
                {
                    "batch_size": list(batch.batch.batch_size),
                    "leaves": [(k, t.dtype, tuple(t.shape)) for k, t in leaves],
                    "non_tensor": batch.non_tensor_batch if flag else None,
                }
            )
        desc = pickle.loads(self._bcast_bytes(header))
        if g.is_leader:
            tensors = [t.contiguous() for _, t in leaves]
        else:
            tensors = [torch.empty(s, dtype=d, device=g.device) for _, d, s in desc["leaves"]]
        if self.coalesce:
            self._coalesced(tensors)
        else:
            for t in tensors:  # as bytes: a process group refuses some dtypes (float8, uint16)
                broadcast(as_bytes(t), g.leader, group=g.replica_group)
        if g.is_leader:
            return batch
        td = TensorDict(
            {k: t for (k, _, _), t in zip(desc["leaves"], tensors)},
            batch_size=desc["batch_size"],
            device=g.device,
        )
        batch.batch = td  # the object it was handed, whatever its class
        if flag:
            batch.non_tensor_batch = desc["non_tensor"]
        return batch

    def _coalesced(self, tensors: list[torch.Tensor]) -> None:
        """One byte buffer holding every tensor; receivers copy their slices back out."""
        g = self.groups
        sizes = [t.numel() * t.element_size() for t in tensors]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=g.device)
        views, at = [], 0
        for n in sizes:
            views.append(flat[at : at + n])
            at += n
        if g.is_leader:
            for t, v in zip(tensors, views):
                v.copy_(as_bytes(t))
        broadcast(flat, g.leader, group=g.replica_group)
        if not g.is_leader:
            for t, v in zip(tensors, views):
                as_bytes(t).copy_(v)


def _any_leaf(cls) -> bool:
    """Tensors and non-tensor leaves (NonTensorData, NonTensorStack) are leaves; any other
    TensorDict is a node."""
    return not is_tensor_collection(cls) or issubclass(cls, (NonTensorData, NonTensorStack))


STRATEGY = PerKeyBroadcast
