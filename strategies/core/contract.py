"""The get_data_input contract: DataProto, the process groups a strategy receives, and the
Strategy base class every module under ``strategies/`` implements.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

NON_TENSOR_FLAG = "_broadcast_non_tensor_batch"


class ContractError(ValueError):
    """A batch that breaks the DataProto contract; the message names the key and the rank."""


class Unsupported(NotImplementedError):
    """A strategy that cannot serve this layout by design or by a known upstream bug.

    Raised on every rank at construction, before any collective, so no rank hangs; the harness
    records the job as unsupported (with this message) instead of failing the sweep.
    """


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass
class DataProto:
    """The batch container ROLL and verl hand to ``get_data_input``."""

    batch: TensorDict | None = None
    """Tensors with a leading batch dimension B (``batch.batch_size[0]``)."""
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    """Object arrays of length B (prompt texts, uids, ...)."""
    meta_info: dict[str, Any] = field(default_factory=dict)
    """Run-level values (global_step, micro_batch_size, flags); already on every rank."""

    @property
    def broadcast_non_tensor(self) -> bool:
        return bool(self.meta_info.get(NON_TENSOR_FLAG, False))

    def entry_state(self, is_leader: bool) -> DataProto:
        """What ROLL's dispatcher leaves on a rank: the leader holds everything, the others hold
        only (a copy of) the same meta_info."""
        if is_leader:
            return DataProto(self.batch, self.non_tensor_batch, self.meta_info)
        return DataProto(None, {}, copy.deepcopy(self.meta_info))

    def validate(self, rank: int | None = None) -> int:
        """Check the leader's batch; return B. Raises ContractError naming key and rank."""
        rank = _rank() if rank is None else rank
        if self.batch is None:
            raise ContractError(f"rank {rank}: the leader's DataProto has batch=None")
        if not isinstance(self.batch, TensorDict):
            raise ContractError(
                f"rank {rank}: batch must be a tensordict.TensorDict, got {type(self.batch).__name__}"
            )
        if len(self.batch.batch_size) < 1:
            raise ContractError(
                f"rank {rank}: batch.batch_size is {list(self.batch.batch_size)}; expected a "
                "leading batch dimension B"
            )
        b = int(self.batch.batch_size[0])
        for key, value in self.batch.items(include_nested=True, leaves_only=True):
            if not isinstance(value, torch.Tensor):
                raise ContractError(
                    f"rank {rank}: batch[{key!r}] is {type(value).__name__}; expected a tensor"
                )
            if value.dim() < 1 or value.shape[0] != b:
                raise ContractError(
                    f"rank {rank}: batch[{key!r}] has shape {list(value.shape)}; expected leading "
                    f"dim B={b}"
                )
        for key, arr in self.non_tensor_batch.items():
            if not isinstance(arr, np.ndarray):
                raise ContractError(
                    f"rank {rank}: non_tensor_batch[{key!r}] is {type(arr).__name__}; expected a "
                    f"numpy array of length B={b}"
                )
            if arr.ndim < 1 or arr.shape[0] != b:
                raise ContractError(
                    f"rank {rank}: non_tensor_batch[{key!r}] has length "
                    f"{arr.shape[0] if arr.ndim else 'scalar'}; expected B={b}"
                )
        return b


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
        cls, order: str = "tp-cp-ep-dp-pp", device: torch.device | None = None
    ) -> ProcessGroups:
        """Build from an initialized ``megatron.core.parallel_state``.

        ``order`` must be the order string given to ``initialize_model_parallel`` (megatron-core
        keeps it only inside a local RankGenerator); a mismatch is detected and raised.

        Megatron builds TP×CP and PP groups but no tp-cp-pp group (its model-parallel group
        leaves CP out), so the replica group is made here from Megatron's own RankGenerator.
        Every rank must call this (group creation is collective).
        """
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron.core.parallel_state is not initialized; call "
                "initialize_model_parallel(...) first"
            )
        rank = dist.get_rank()
        world = dist.get_world_size()
        tp = ps.get_tensor_model_parallel_world_size()
        cp = ps.get_context_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        gen = ps.RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=order)
        backend = dist.get_backend()
        replica_group = cpu_replica = None
        for ranks in gen.get_ranks("tp-cp-pp"):
            g = dist.new_group(ranks)
            g_cpu = dist.new_group(ranks, backend="gloo") if backend != "gloo" else g
            if rank in ranks:
                replica_group, cpu_replica = g, g_cpu
        tp_cp_group = ps.get_tensor_and_context_parallel_group()
        pp_group = ps.get_pipeline_model_parallel_group()
        mine = [g for g in gen.get_ranks("tp-cp") if rank in g][0]
        if list(dist.get_process_group_ranks(tp_cp_group)) != mine:
            raise RuntimeError(
                f"rank {rank}: megatron's TP×CP group is "
                f"{dist.get_process_group_ranks(tp_cp_group)} but order {order!r} gives {mine}; "
                "pass the order given to initialize_model_parallel"
            )
        cpu_tp_cp = cpu_pp = None
        if backend != "gloo":
            for ranks in gen.get_ranks("tp-cp"):
                g = dist.new_group(ranks, backend="gloo")
                if rank in ranks:
                    cpu_tp_cp = g
            for ranks in gen.get_ranks("pp"):
                g = dist.new_group(ranks, backend="gloo")
                if rank in ranks:
                    cpu_pp = g
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
        return cls(
            tp_cp_group=tp_cp_group,
            pp_group=pp_group,
            replica_group=replica_group,
            tp_cp_ranks=tuple(dist.get_process_group_ranks(tp_cp_group)),
            pp_ranks=tuple(dist.get_process_group_ranks(pp_group)),
            replica_ranks=tuple(dist.get_process_group_ranks(replica_group)),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            tp_cp_rank=dist.get_rank(tp_cp_group),
            device=device,
            cpu_tp_cp_group=cpu_tp_cp,
            cpu_pp_group=cpu_pp,
            cpu_replica_group=cpu_replica,
            rank=rank,
            replicas=world // (tp * cp * pp),
        )


class Strategy:
    """One way to run ``get_data_input``. Subclasses set ``name`` and implement the call.

    A strategy is built once per layout with its groups and options, then called on every
    rank of the world with the entry state; it returns the exit state (see README).
    """

    name: ClassVar[str] = ""
    selectable: ClassVar[bool] = True
    """False for the floor, which is a measured limit rather than a way to ship data."""
    claims: ClassVar[str] = ""
    """Collectives per call, in words (checked by the tests that count them)."""

    def __init__(self, groups: ProcessGroups, **options: Any) -> None:
        self.groups = groups
        if options:
            raise TypeError(
                f"strategy {self.name!r} takes no options {sorted(options)}; "
                "see its module docstring for the options it has"
            )

    def prepare(self, batch: DataProto) -> None:
        """Untimed set-up before a run of calls (the floor packs its buffer here)."""

    def get_data_input(self, batch: DataProto) -> DataProto:
        raise NotImplementedError

    @classmethod
    def plan(cls, layout, spec):
        """The collectives and local work of one call, for every replica (strategies.core.plan)."""
        raise NotImplementedError(f"strategy {cls.name!r} states no plan")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.groups.rank})"
