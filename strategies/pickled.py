"""``pickled``: the seed's algorithm (ROLL ``MegatronInferStrategy.get_data_input``), paying what
ROLL pays: the baseline every figure is compared with.

Kept exactly: hop 1, only on PP stage 0 and only if tp·cp > 1: ``broadcast_object_list`` over
the TP×CP group; hop 2, only if pp > 1: the same over the PP group; the source is always the
group's rank 0. Every hop is two collectives (sizes, then pickled bytes) and a host sync.

What travels depends on ``meta_info["_broadcast_non_tensor_batch"]`` and on the option
``serialization``:

- ``roll`` (default): ROLL's own DataProto serialization (``strategies.core.roll_proto``).
  Flag true: the whole ROLL-shaped DataProto, meta_info included, is pickled at each hop; its
  ``__getstate__`` writes the TensorDict with ``torch.save`` into an in-memory buffer, which is
  pickled in turn, and receivers ``torch.load`` it back; only batch and non_tensor_batch are
  copied back (meta_info stays local). Flag false: ROLL's ``.batch`` proxy over the TensorDict
  travels, pickled as ROLL pickles it. A forwarding rank pickles its own object again, as ROLL's
  does. ``torch.save``/``torch.load`` bytes are counted as ``copied_bytes``.
- ``dataclass``: the earlier, cheaper baseline: flag true pickles the caller's DataProto as it
  is (a dataclass pickle for ours), flag false pickles the bare TensorDict.

Either way the caller's object (ours, verl's, a ROLL-shaped one: anything with batch,
non_tensor_batch and meta_info) gets the batch set on it and is returned.

Added to the seed, so no rank waits forever: whatever the leader raises while preparing or
pickling its batch (a broken contract, an object that is not a DataProto, an unpicklable value),
it broadcasts a description of the error in the batch's place; every rank of the replica raises
it (``LeaderFailed`` off the leader, naming the leader's rank and error), and the leader
re-raises its own.

Options: ``serialization`` = ``roll`` | ``dataclass`` (conf/strategy/pickled.yaml).
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from strategies.core.contract import NON_TENSOR_FLAG, ContractError, DataProto, Strategy
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan
from strategies.core.roll_proto import RollDataProto

SERIALIZATIONS = ("roll", "dataclass")


class LeaderFailed(ContractError):
    """Raised off the leader when the replica leader could not send its batch."""


@dataclass(frozen=True)
class Failure:
    """What travels in a batch's place when the leader fails: picklable whatever it raised."""

    rank: int
    error: str

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> Failure:
        return cls(rank, f"{type(exc).__name__}: {exc}")

    def raise_on(self, rank: int) -> None:
        raise LeaderFailed(
            f"rank {rank}: the replica leader (rank {self.rank}) failed: {self.error}"
        )


def broadcast_obj(obj, group):
    """The seed's helper: group rank 0 holds the object, everyone returns it."""
    obj_list = [obj if dist.get_rank(group) == 0 else None]
    src_rank = dist.get_process_group_ranks(group)[0]
    dist.broadcast_object_list(obj_list, src=src_rank, group=group)
    return obj_list[0]


def _failed_while_pickling(exc: BaseException) -> bool:
    # broadcast_object_list pickles every object before its first collective; a failure there
    # leaves every receiver waiting in the sizes broadcast, where a second call still lands.
    return any(
        f.f_code.co_name == "_object_to_tensor" for f, _ in traceback.walk_tb(exc.__traceback__)
    )


def send_or_failure(obj, group, rank: int) -> tuple[Exception, Failure] | None:
    """``broadcast_obj`` from this hop's source. None once sent; if pickling ``obj`` fails, a
    Failure goes in its place (receivers raise it) and (the error, that Failure) is returned,
    so a rank that sends on later hops sends the Failure there too."""
    try:
        broadcast_obj(obj, group)
        return None
    except Exception as exc:
        if not _failed_while_pickling(exc):
            raise
        failure = Failure.of(rank, exc)
        broadcast_obj(failure, group)
        return exc, failure


class Pickled(Strategy):
    name = "pickled"
    claims = "2 collectives per hop (sizes, pickled bytes): 2 on stage 0 with tp·cp>1, +2 for pp>1"

    def __init__(self, groups, serialization: str = "roll") -> None:
        super().__init__(groups)
        if serialization not in SERIALIZATIONS:
            raise ValueError(
                f"pickled: serialization={serialization!r}; expected one of {SERIALIZATIONS}"
            )
        self.serialization = serialization

    # -- what a rank sends and how it takes what it receives ----------------------------------
    def _state(self, batch) -> Any:
        """The object ROLL's code holds on this rank: a ROLL-shaped view of the caller's."""
        return RollDataProto.of(batch) if self.serialization == "roll" else batch

    def _outgoing(self, state, whole: bool):
        if self.serialization == "roll":
            return state if whole else state.batch_proxy()
        return state if whole else state.batch

    @staticmethod
    def _incoming(state, received, whole: bool) -> None:
        if isinstance(state, RollDataProto):
            # ROLL's setters (shallow copies); their consistency check is skipped because the
            # contract carries batches ROLL's check refuses (non-object arrays, B×T batches).
            state.set_batch(received.batch if whole else received, check=False)
            if whole:
                state.set_non_tensor_batch(received.non_tensor_batch, check=False)
            return
        state.batch = received.batch if whole else received
        if whole:
            state.non_tensor_batch = received.non_tensor_batch

    def _prepare_leader(self, batch):
        """(whole, state, failure) on the leader; a failure instead of raising."""
        g = self.groups
        try:
            whole = bool(batch.meta_info.get(NON_TENSOR_FLAG, False))
            DataProto.validate(batch, g.rank)
            return whole, self._state(batch), None
        except Exception as exc:  # shipped in the batch's place, so no receiver waits
            return False, None, (exc, Failure.of(g.rank, exc))

    def get_data_input(self, batch):
        g = self.groups
        failure = error = None
        if g.is_leader:
            whole, state, failed = self._prepare_leader(batch)
            if failed is not None:
                error, failure = failed
        else:
            whole = bool(batch.meta_info.get(NON_TENSOR_FLAG, False))
            state = self._state(batch)
        for hop in g.seed_hops():
            if g.rank == hop.ranks[0]:
                failed = send_or_failure(failure or self._outgoing(state, whole), hop.group, g.rank)
                if failed is not None:
                    error, failure = failed
                continue
            received = broadcast_obj(None, hop.group)
            if isinstance(received, Failure):
                failure = received
            else:
                self._incoming(state, received, whole)
        if error is not None:
            raise error
        if failure is not None:
            failure.raise_on(g.rank)
        if state is not batch and not g.is_leader:  # the caller's object gets what arrived
            batch.batch = state.batch
            if whole:
                batch.non_tensor_batch = state.non_tensor_batch
        return batch

    @classmethod
    def plan(
        cls,
        layout,
        spec: PayloadSpec,
        serialization: str = "roll",
        pickle_bytes: int | None = None,
    ) -> Plan:
        """``pickle_bytes``: the measured size of one hop's pickle (``hop_pickle_bytes``); without
        it the size is estimated from ``spec`` and marked inexact."""
        nbytes = spec.pickle_bytes + (spec.non_tensor_bytes if spec.broadcast_non_tensor else 0)
        exact = spec.pickle_exact and not spec.broadcast_non_tensor and serialization != "roll"
        if pickle_bytes is not None:
            nbytes, exact = pickle_bytes, True
        # ROLL's flag-true hop runs torch.save on the sender and torch.load on the receiver,
        # each copying the TensorDict's bytes once (estimated by its pickle size).
        saved = spec.pickle_bytes if serialization == "roll" and spec.broadcast_non_tensor else 0
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
        n = len(hops)
        return Plan(
            cls.name,
            comms,
            leader=LocalWork(pickled_bytes=nbytes * n, copied_bytes=saved * n),
            receiver=LocalWork(pickled_bytes=nbytes, copied_bytes=saved),
            forwarder=LocalWork(pickled_bytes=2 * nbytes, copied_bytes=2 * saved),
        )


def hop_pickle_bytes(batch, serialization: str = "roll") -> int:
    """Bytes one hop pickles for this leader's batch (what ``plan`` takes as ``pickle_bytes``)."""
    whole = bool(batch.meta_info.get(NON_TENSOR_FLAG, False))
    if serialization == "roll":
        state = RollDataProto.of(batch)
        return len(pickle.dumps(state if whole else state.batch_proxy()))
    return len(pickle.dumps(batch if whole else batch.batch))


def measure_pickle_bytes(obj) -> int:
    return len(pickle.dumps(obj))


STRATEGY = Pickled
