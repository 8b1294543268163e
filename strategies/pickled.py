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
- ``pickle5``: vLLM's pickle protocol 5 with out-of-band buffers; ``verl_numpy``: verl's
  ``numpy`` DataProto serializer (``strategies.core.oob_pickle`` says what each reproduces).
  Flag true: the batch, non_tensor_batch and meta_info travel (as ROLL's DataProto pickles
  them; only batch and non_tensor_batch are copied back); flag false: the bare TensorDict.
  Each hop is still two collectives and a host sync (the size, then one buffer: the in-band
  pickle and the tensors' bytes beside it), so only the serialization differs from ``roll``.

The out-of-band serializations are also strategies of their own, ``pickled_pickle5`` and
``pickled_verl_numpy`` (this class with ``serialization`` fixed): a job times each strategy
name once, so only under their own names can one job time them beside ROLL's ``pickled`` and
give a ``vs_baseline`` with its interval. ROLL's two hops, their groups, sources and failure
handling are this one class for every serialization; ``roll`` stays ``pickled``'s default, so
existing records stay comparable.

Either way the caller's object (ours, verl's, a ROLL-shaped one: anything with batch,
non_tensor_batch and meta_info) gets the batch set on it and is returned.

Added to the seed, so no rank waits forever: whatever the leader raises while preparing or
pickling its batch (a broken contract, an object that is not a DataProto, an unpicklable value),
a failure batch goes out in the batch's place (``strategies.Strategy.get_data_input``, as for
every strategy); every rank of the replica raises it (``LeaderFailed`` off the leader, naming
the leader's rank and error), and the leader re-raises its own. A forwarding rank that cannot
pickle what it received sends a ``ShippedFailure`` on its hop instead. The leader also refuses,
on every rank, a leaf whose dtype its hop's pickling saves but cannot load back
(``loads_back``: float8 and uint16/32/64 under plain pickle), which the seed would have left to
fail on the receivers.

Options: see ``Pickled.Options`` (conf/strategy/pickled.yaml).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import torch
import torch.distributed as dist
from tensordict import TensorDict

from strategies.core import oob_pickle
from strategies.core.contract import (
    ContractError,
    ShippedFailure,
    deliver,
    leaves,
    raise_failure,
    send_or_failure,
    wants_non_tensor,
)
from strategies.core.footprint import Footprint
from strategies.core.header_format import DEFAULT_MAX_BYTES
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan
from strategies.core.roll_proto import RollBatchProxy, RollDataProto, loads_back
from strategies.core.strategy_base import Strategy

Serialization = Literal["roll", "dataclass", "pickle5", "verl_numpy"]
"""What a hop's bytes are (``Pickled.Options.serialization``); the last two are
``oob_pickle.OOB_SERIALIZATIONS``."""
SERIALIZATIONS: tuple[str, ...] = get_args(Serialization)


def broadcast_obj(obj, group):
    """The seed's helper: group rank 0 holds the object, everyone returns it."""
    obj_list = [obj if dist.get_rank(group) == 0 else None]
    src_rank = dist.get_process_group_ranks(group)[0]
    dist.broadcast_object_list(obj_list, src=src_rank, group=group)
    return obj_list[0]


class Pickled(Strategy):
    name = "pickled"
    footprint = Footprint(leader=2.05, receiver=5.15, leader_kept=0.2)
    """Measured by the node memory phase (a pickle per hop on the leader; a receiver holds the
    pickled bytes, their tensor and the unpickled batch)."""
    claims = "2 collectives per hop (sizes, pickled bytes): 2 on stage 0 with tp·cp>1, +2 for pp>1"

    @dataclass(frozen=True, kw_only=True)
    class Options(Strategy.Options):
        serialization: Serialization = "roll"
        """What a hop's bytes are: ``roll`` pays what ROLL pays (with the non-tensor flag
        true it pickles a ROLL-shaped DataProto whose ``__getstate__`` torch.saves the
        TensorDict into a buffer, with it false ROLL's ``.batch`` proxy); ``dataclass`` the
        earlier baseline (the caller's DataProto, or the bare TensorDict); ``pickle5`` vLLM's
        pickle protocol 5, tensors' bytes out of band (receivers view them); ``verl_numpy``
        verl's numpy DataProto serializer (receivers copy each tensor)."""

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.serialization not in SERIALIZATIONS:
                raise ValueError(
                    f"pickled: serialization={self.serialization!r}; expected one of "
                    f"{SERIALIZATIONS}"
                )

    @property
    def serialization(self) -> str:
        """What this instance's hops send (``Options.serialization``)."""
        return self.options.serialization

    # -- what a rank holds, sends and takes in ------------------------------------------------
    def _state(self, batch) -> Any:
        """The object ROLL's code holds on this rank: a ROLL-shaped view of the caller's."""
        return RollDataProto.of(batch) if self.serialization == "roll" else batch

    def check(self, batch) -> None:
        """Refuse, on every rank, a leaf whose dtype this call's pickling saves but cannot load
        back (``loads_back``)."""
        rank = self.groups.rank
        torch_save = self.serialization == "roll" and wants_non_tensor(batch)
        oob = self.serialization in oob_pickle.OOB_SERIALIZATIONS
        for key, t in leaves(batch.batch):
            if oob and oob_pickle.as_bytes(t):  # travels as its bytes, whatever its dtype
                continue
            if isinstance(t, torch.Tensor) and not loads_back(t.dtype, torch_save):
                how = "torch.save / torch.load" if torch_save else "pickle"
                raise ContractError(
                    f"rank {rank}: batch[{key if len(key) > 1 else key[0]!r}] has dtype "
                    f"{t.dtype}, which torch cannot load back through {how}; the receivers "
                    "could not unpickle it"
                )

    def _outgoing(self, state, whole: bool):
        if self.serialization == "roll":
            return state if whole else state.batch_proxy()
        if whole and self.serialization in oob_pickle.OOB_SERIALIZATIONS:
            return oob_pickle.Whole(state.batch, state.non_tensor_batch, state.meta_info)
        return state if whole else state.batch

    def _send(self, obj, group) -> tuple[Exception, ShippedFailure] | None:
        """One hop from this rank (its source): ``send_or_failure``'s contract."""
        if self.serialization in oob_pickle.OOB_SERIALIZATIONS:
            return oob_pickle.send(obj, self.serialization, group)
        return send_or_failure(obj, group)

    def _receive(self, group):
        if self.serialization in oob_pickle.OOB_SERIALIZATIONS:
            return oob_pickle.receive(group, self.groups.rank, DEFAULT_MAX_BYTES)
        return broadcast_obj(None, group)

    @staticmethod
    def _incoming(state, received, whole: bool) -> None:
        # What arrived says what it is: a leader whose own object was broken sends its failure
        # batch as flag-false does, whatever flag this rank holds.
        whole = whole and not isinstance(received, (RollBatchProxy, TensorDict))
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

    def transfer(self, batch):
        g = self.groups
        whole = wants_non_tensor(batch)
        state = self._state(batch)
        failure = error = None
        for hop in g.seed_hops():
            if g.rank == hop.ranks[0]:  # a forwarder's own pickling failure travels on
                failed = self._send(failure or self._outgoing(state, whole), hop.group)
                if failed is not None:
                    error, failure = failed
                continue
            received = self._receive(hop.group)
            if isinstance(received, ShippedFailure):
                failure = received
            else:
                self._incoming(state, received, whole)
        if failure is not None:
            raise_failure(g, failure.text, error)
        if state is not batch and not g.is_leader:  # the caller's object gets what arrived
            deliver(batch, state.batch, state.non_tensor_batch if whole else None)
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
        if serialization not in SERIALIZATIONS:
            raise ValueError(f"serialization={serialization!r}; expected one of {SERIALIZATIONS}")
        nbytes = spec.pickle_bytes + spec.sent_non_tensor_bytes
        exact = spec.pickle_exact and not spec.broadcast_non_tensor and serialization == "dataclass"
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
        if serialization in oob_pickle.OOB_SERIALIZATIONS:
            return oob_plan(cls.name, comms, n, spec, serialization)
        return Plan(
            cls.name,
            comms,
            leader=LocalWork(pickled_bytes=nbytes * n, copied_bytes=saved * n),
            receiver=LocalWork(pickled_bytes=nbytes, copied_bytes=saved),
            forwarder=LocalWork(pickled_bytes=2 * nbytes, copied_bytes=2 * saved),
        )


class FixedSerialization(Pickled):
    """``Pickled`` with one serialization fixed, under a name of its own (not a strategy itself:
    ``pickled_pickle5`` and ``pickled_verl_numpy`` set ``name`` and ``fixed``)."""

    fixed: ClassVar[str] = "roll"

    @dataclass(frozen=True, kw_only=True)
    class Options(Strategy.Options):
        """None: the serialization is the class's ``fixed``."""

    @property
    def serialization(self) -> str:
        return self.fixed

    @classmethod
    def plan(cls, layout, spec: PayloadSpec, pickle_bytes: int | None = None) -> Plan:
        return super().plan(layout, spec, serialization=cls.fixed, pickle_bytes=pickle_bytes)


def oob_plan(name: str, comms: list, hops: int, spec: PayloadSpec, serialization: str) -> Plan:
    """The local work of the out-of-band serializations: only the non-tensor part is pickled in
    band; a hop's source copies the tensors' bytes into its buffer once; verl's receiver copies
    each tensor again (into its bytearray), vLLM's views them."""
    nt = spec.sent_non_tensor_bytes
    tb = spec.tensor_bytes
    kept = tb if serialization == "verl_numpy" else 0
    receiver = LocalWork(pickled_bytes=nt, copied_bytes=kept)
    return Plan(
        name,
        comms,
        leader=LocalWork(pickled_bytes=nt * hops, copied_bytes=tb * hops),
        receiver=receiver,
        forwarder=LocalWork(pickled_bytes=2 * nt, copied_bytes=kept + tb),
    )


def hop_pickle_bytes(batch, serialization: str = "roll") -> int:
    """Bytes one hop pickles for this leader's batch (what ``plan`` takes as ``pickle_bytes``)."""
    whole = wants_non_tensor(batch)
    if serialization in oob_pickle.OOB_SERIALIZATIONS:
        obj = oob_pickle.Whole(batch.batch, batch.non_tensor_batch, batch.meta_info)
        return oob_pickle.frames_bytes(
            oob_pickle.dumps(obj if whole else batch.batch, serialization)
        )
    if serialization == "roll":
        state = RollDataProto.of(batch)
        return len(pickle.dumps(state if whole else state.batch_proxy()))
    return len(pickle.dumps(batch if whole else batch.batch))


STRATEGY = Pickled
