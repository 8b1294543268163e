"""The process groups a strategy receives: this rank's TP×CP, PP and replica groups, their
gloo twins and global ranks, built by hand or from megatron-core's initialized parallel state.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from strategies.core.groups import (
    MegatronView,
    check_order,
    derive_replicas,
    node_indices,
    node_key,
    node_split,
)
from strategies.core.layout import Layout


class Hop(NamedTuple):
    """One hop of a relay: the group, its gloo twin for host-side metadata, and its global
    ranks in group-rank order (``ranks[0]`` is the source)."""

    group: Any
    cpu_group: Any
    ranks: tuple[int, ...]


@dataclass
class ProcessGroups:
    """The groups a strategy may use, built once per layout and handed to every strategy."""

    tp_cp_group: Any
    """TP×CP group of this rank's stage (Megatron's tensor-and-context-parallel group)."""
    pp_group: Any
    """This rank's pipeline group: one rank per stage, same tp/cp coordinate."""
    replica_group: Any
    """All tp·cp·pp ranks of this rank's DP replica (who must end with the same batch)."""
    tp_cp_ranks: tuple[int, ...]
    """Global ranks of ``tp_cp_group`` in group-rank order."""
    pp_ranks: tuple[int, ...]
    """Global ranks of ``pp_group`` in group-rank order (stage order)."""
    replica_ranks: tuple[int, ...]
    """Global ranks of ``replica_group``; ``replica_ranks[0]`` is the leader."""
    pp_rank: int
    """This rank's pipeline stage."""
    tp_cp_rank: int
    """This rank's index in ``tp_cp_group``."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where received tensors live: CPU on gloo, this rank's GPU on NCCL."""
    cpu_tp_cp_group: Any = None
    """Gloo twin of ``tp_cp_group`` for host-side metadata (the same group on gloo)."""
    cpu_pp_group: Any = None
    """Gloo twin of ``pp_group``."""
    cpu_replica_group: Any = None
    """Gloo twin of ``replica_group``."""
    rank: int = 0
    """This rank's global rank."""
    replicas: int = 1
    """Number of DP replicas in the world (each has its own groups of the same shape)."""
    node_of: tuple[int, ...] = ()
    """Every global rank's node (ranks with the same number share a host and its memory),
    ``strategies.core.groups.node_indices``; empty: unknown, taken as one node."""

    def __post_init__(self) -> None:
        self.cpu_tp_cp_group = self.cpu_tp_cp_group or self.tp_cp_group
        self.cpu_pp_group = self.cpu_pp_group or self.pp_group
        self.cpu_replica_group = self.cpu_replica_group or self.replica_group

    @property
    def leader(self) -> int:
        return self.replica_ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def tp_cp_size(self) -> int:
        return len(self.tp_cp_ranks)

    @cached_property
    def replica_nodes(self) -> tuple[tuple[int, ...], ...]:
        """This rank's replica split by node (``groups.node_split``): one tuple per node, the
        leader's node first; each tuple's first rank is that node's leader."""
        return node_split(self.replica_ranks, self.node_of)

    @cached_property
    def node_local_ranks(self) -> tuple[int, ...]:
        """The ranks of this rank's replica on this rank's node (in replica order)."""
        return next(n for n in self.replica_nodes if self.rank in n)

    @cached_property
    def node_leaders(self) -> tuple[int, ...]:
        """One rank per node of this rank's replica, the replica leader first."""
        return tuple(n[0] for n in self.replica_nodes)

    def seed_hops(self) -> list[Hop]:
        """The hops this rank takes part in, in the seed's order: TP×CP if it is on pipeline
        stage 0 and tp·cp > 1, then PP if pp > 1 (``Layout.seed_hop_groups`` for a plan)."""
        hops = []
        if self.pp_rank == 0 and self.tp_cp_size > 1:
            hops.append(Hop(self.tp_cp_group, self.cpu_tp_cp_group, self.tp_cp_ranks))
        if self.pp_size > 1:
            hops.append(Hop(self.pp_group, self.cpu_pp_group, self.pp_ranks))
        return hops

    @property
    def pp_size(self) -> int:
        return len(self.pp_ranks)

    @classmethod
    def from_megatron(
        cls, order: str | None = None, device: torch.device | None = None, node: str | None = None
    ):
        """Build from an initialized ``megatron.core.parallel_state``; every rank must call it
        (it gathers each rank's groups over the world and creates the replica groups).
        ``node`` names this rank's host (None: ``groups.node_key`` from the launcher's
        environment); it travels in the same gather, so which ranks share a node costs no
        collective of its own.

        The replica group (all tp·cp·pp ranks of a DP replica; megatron-core builds none) is
        derived from megatron-core's own TP×CP and PP groups and checked against its DP,
        DP×CP, CP, TP and model-parallel groups (``strategies.core.groups``); any mismatch
        raises ``GroupMismatch`` on every rank, naming the ranks, before a strategy exists.
        ``order`` is optional: when given, the groups it implies are compared as well.
        """
        # Imported here, not with the module: megatron-core's package __init__ loads its model
        # and optimizer stacks, which only a caller of this method needs.
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron.core.parallel_state is not initialized; call "
                "initialize_model_parallel(...) first"
            )
        rank = dist.get_rank()
        views = _gather_views(parallel_state, rank, node)
        replicas = derive_replicas(views)
        if order is not None:
            _check_against_order(order, views, replicas)
        backend = dist.get_backend()
        replica_group, cpu_replica = _new_groups(replicas.values(), rank, backend, twin=True)
        cpu_tp_cp, cpu_pp = _gloo_twins(views, rank, backend)
        mine = views[rank]
        return cls(
            tp_cp_group=parallel_state.get_tensor_and_context_parallel_group(),
            pp_group=parallel_state.get_pipeline_model_parallel_group(),
            replica_group=replica_group,
            tp_cp_ranks=mine.tp_cp,
            pp_ranks=mine.pp,
            replica_ranks=replicas[rank],
            pp_rank=mine.pp.index(rank),
            tp_cp_rank=mine.tp_cp.index(rank),
            device=_device_of(backend) if device is None else device,
            cpu_tp_cp_group=cpu_tp_cp,
            cpu_pp_group=cpu_pp,
            cpu_replica_group=cpu_replica,
            rank=rank,
            replicas=len(set(replicas.values())),
            node_of=node_indices([v.node for v in views]),
        )


def _gather_views(parallel_state, rank: int, node: str | None) -> list[MegatronView]:
    """Every rank's groups as megatron-core built them, with its node (``node``, else
    ``groups.node_key``), in one all-gather over the world."""
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        views, replace(_megatron_view(parallel_state, rank), node=node or node_key())
    )
    return views


def _gloo_twins(views, rank: int, backend: str) -> tuple[Any, Any]:
    """Gloo twins of this rank's TP×CP and PP groups for host-side metadata; None on gloo,
    where the groups are their own twins."""
    if backend == "gloo":
        return None, None
    cpu_tp_cp = _new_groups((v.tp_cp for v in views), rank, "gloo")[0]
    cpu_pp = _new_groups((v.pp for v in views), rank, "gloo")[0]
    return cpu_tp_cp, cpu_pp


def _device_of(backend: str) -> torch.device:
    """Where a backend's received tensors live by default: this rank's GPU on NCCL."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )


def _megatron_view(parallel_state, rank: int) -> MegatronView:
    """This rank's groups as megatron-core built them (global ranks, group-rank order)."""

    def ranks(group) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group))

    return MegatronView(
        rank=rank,
        tp=ranks(parallel_state.get_tensor_model_parallel_group()),
        cp=ranks(parallel_state.get_context_parallel_group()),
        tp_cp=ranks(parallel_state.get_tensor_and_context_parallel_group()),
        pp=ranks(parallel_state.get_pipeline_model_parallel_group()),
        dp=ranks(parallel_state.get_data_parallel_group(with_context_parallel=False)),
        dp_cp=ranks(parallel_state.get_data_parallel_group(with_context_parallel=True)),
        mp=ranks(parallel_state.get_model_parallel_group()),
    )


def _check_against_order(order: str, views, replicas) -> None:

    v = views[0]
    cp = len(v.cp)
    layout = Layout(dp=len(v.dp), pp=len(v.pp), tp=len(v.tp), cp=cp, order=order)
    groups = {axes: layout.groups(axes) for axes in ("tp-cp", "pp", "dp", "tp-cp-pp")}
    check_order(groups, views, replicas, order)


def _new_groups(rank_lists, rank: int, backend: str, twin: bool = False):
    """One group per distinct rank list, created in the same order on every rank (group
    creation is collective); returns this rank's group and, with ``twin``, its gloo twin
    (the same group on gloo)."""
    mine = mine_cpu = None
    for ranks in sorted(set(tuple(sorted(r)) for r in rank_lists)):
        group = dist.new_group(list(ranks), backend="gloo" if backend == "gloo" else None)
        cpu = group
        if twin and backend != "gloo":
            cpu = dist.new_group(list(ranks), backend="gloo")
        if rank in ranks:
            mine, mine_cpu = group, cpu
    return mine, mine_cpu
