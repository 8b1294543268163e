"""``per_key``: the leader describes the batch in one pickled header, then broadcasts every
tensor on its own (or, with ``coalesce=True``, all of them as one byte buffer), over the whole
replica in one hop.

It is written as a user would write it: ``from torch.distributed import broadcast`` (a name
bound at import, which bcastbench's recorder still counts) and no ``plan()`` (``bcastbench
predict`` lists it among the strategies without one). Dense tensor leaves only; the non-tensor
batch rides in the header when ``meta_info['_broadcast_non_tensor_batch']`` is set.

Per call: 2 (header size, header) + one per tensor, or + 1 with ``coalesce``.
"""

from __future__ import annotations

import pickle

import torch
from tensordict import TensorDict
from torch.distributed import broadcast

from strategies import NON_TENSOR_FLAG, DataProto, Strategy


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
        broadcast(size.to(g.device), g.leader, group=g.replica_group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=g.device)
        if payload is not None:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        broadcast(buf, g.leader, group=g.replica_group)
        return buf.cpu().numpy().tobytes()

    def get_data_input(self, batch) -> DataProto:
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
            for t in tensors:
                broadcast(t, g.leader, group=g.replica_group)
        if g.is_leader:
            return batch
        td = TensorDict(
            {k: t for (k, _, _), t in zip(desc["leaves"], tensors)},
            batch_size=desc["batch_size"],
            device=g.device,
        )
        non_tensor = desc["non_tensor"] if flag else batch.non_tensor_batch
        return type(batch)(batch=td, non_tensor_batch=non_tensor, meta_info=batch.meta_info)

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
                v.copy_(t.reshape(-1).view(torch.uint8))
        broadcast(flat, g.leader, group=g.replica_group)
        if not g.is_leader:
            for t, v in zip(tensors, views):
                t.reshape(-1).view(torch.uint8).copy_(v)
