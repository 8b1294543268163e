"""``pickled``: the seed's algorithm (ROLL ``MegatronInferStrategy.get_data_input``), exactly.

Kept exactly: hop 1, only on PP stage 0 and only if tp·cp > 1: ``broadcast_object_list`` over the TP×CP
group; hop 2, only if pp > 1: the same over the PP group; the source is always the group's
rank 0. By default only ``batch.batch`` (the TensorDict) travels; with
``meta_info["_broadcast_non_tensor_batch"]`` the whole DataProto travels and its batch and
non_tensor_batch are copied back. Every hop is two collectives (sizes, then pickled bytes) and
a host sync. This is the baseline every figure is compared with. One addition: the leader validates its
batch and, if it breaks the contract, broadcasts the ContractError in its place, so every rank
raises instead of receivers waiting forever.
"""

from __future__ import annotations

import pickle

import torch.distributed as dist

from strategies.core.contract import ContractError, DataProto, Strategy
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan


def broadcast_obj(obj, group):
    """The seed's helper: group rank 0 holds the object, everyone returns it."""
    obj_list = [obj if dist.get_rank(group) == 0 else None]
    src_rank = dist.get_process_group_ranks(group)[0]
    dist.broadcast_object_list(obj_list, src=src_rank, group=group)
    return obj_list[0]


class Pickled(Strategy):
    name = "pickled"
    claims = "2 collectives per hop (sizes, pickled bytes): 2 on stage 0 with tp·cp>1, +2 for pp>1"

    def get_data_input(self, batch: DataProto) -> DataProto:
        g = self.groups
        whole = batch.broadcast_non_tensor
        refusal = None
        if g.is_leader:
            try:
                batch.validate(g.rank)
            except ContractError as exc:  # ship the refusal instead, so no receiver waits
                refusal = exc
        carried = refusal if refusal is not None else (batch if whole else batch.batch)
        for hop in g.seed_hops():
            carried = broadcast_obj(carried, hop.group)
        if isinstance(carried, ContractError):
            if g.is_leader:
                raise carried
            raise ContractError(
                f"rank {g.rank}: the replica leader (rank {g.leader}) refused its batch: {carried}"
            )
        if whole:
            batch.batch = carried.batch
            batch.non_tensor_batch = carried.non_tensor_batch
        else:
            batch.batch = carried
        return batch

    @classmethod
    def plan(cls, layout, spec: PayloadSpec) -> Plan:
        nbytes = spec.pickle_bytes + (spec.non_tensor_bytes if spec.broadcast_non_tensor else 0)
        exact = spec.pickle_exact and not spec.broadcast_non_tensor
        comms = []
        step = 0
        hops = layout.seed_hop_groups()
        for groups in hops:  # broadcast_object_list: the sizes, then the pickled bytes
            for ranks in groups:
                comms.append(Comm("broadcast", tuple(ranks), ranks[0], 8, step, "sizes"))
            for ranks in groups:
                comms.append(
                    Comm("broadcast", tuple(ranks), ranks[0], nbytes, step + 1, "pickle", exact)
                )
            step += 2
        return Plan(
            cls.name,
            comms,
            leader=LocalWork(pickled_bytes=nbytes * len(hops)),
            receiver=LocalWork(pickled_bytes=nbytes),
            forwarder=LocalWork(pickled_bytes=2 * nbytes),
        )


def measure_pickle_bytes(obj) -> int:
    return len(pickle.dumps(obj))


STRATEGY = Pickled
