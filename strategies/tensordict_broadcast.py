"""``tensordict_broadcast``: the tensordict library's own ``TensorDictBase.broadcast`` (called,
not copied), over the whole replica in one hop, on the layouts where that call is correct.

What the library does (kept as it is): the source ``consolidate()``s every leaf into one uint8
storage (each leaf padded to 8 bytes; views and non-contiguous leaves contribute only their
own elements), pickles the metadata with ``broadcast_object_list`` on the group it is given
(on NCCL: pickle → H2D → NCCL → D2H), then broadcasts the storage once. Receivers get views of
that storage. The source pays a full copy per call (the consolidation) unless its TensorDict
is consolidated already.

KNOWN BUG (tensordict 0.15.3, verified here; also reported in the 2026-10 nightly): it
compares the caller's GROUP-LOCAL rank (``dist.get_rank(group)``) with ``src``, then hands the
same ``src`` to ``broadcast_object_list`` / ``broadcast``, which read it as a GLOBAL rank. The
call is correct only when the source's global rank equals its index in the group. With the
source at group index 0 (every hop here), that means only a group whose first rank is global
rank 0. Observed on a 4-rank gloo world (``tests/test_peers.py`` pins each case):

- [0, 1] src 0, [0, 2] src 0, [0, 1, 2, 3] src 0: correct;
- [2, 3] src 2 (global): every rank takes the receiving branch, the metadata arrives as
  ``None`` → ``AttributeError: 'NoneType' object has no attribute 'pop'`` on both ranks;
- [1, 3] src 1 (global): rank 3 (group index 1 == src) takes the SENDING branch with its empty
  TensorDict; rank 1 fails as above and rank 3 then blocks forever in the storage broadcast —
  a HANG, not just an error (pinned in the tests as [1, 2] src 1 in a 3-rank world);
- src 0 (group-local) on a group without global rank 0: ``ValueError: Global rank 0 is not part
  of group`` on every rank.

No form of ``src`` makes both readings agree on a group without global rank 0 (the sender would
need group index == global rank), so there is no workaround that still calls the library.
Consequences, chosen here:

- the seed's hop order (TP×CP, then PP) is NOT used: its PP groups [1, 3], … hang even with
  DP = 1. One hop over the replica group is used instead (like ``flat``): for the replica that
  holds global rank 0, leader 0 is group index 0 and the call is correct;
- with DP > 1 every other replica would fail or hang, so the strategy refuses the layout on
  EVERY rank, before any collective (``TensorDictBroadcastBug``, a NotImplementedError, naming
  the replicas it would break), and ``plan`` raises the same. No copy of the library's code
  stands in for it.

Adapted around the call: ``non_tensor_batch`` (when ``meta_info['_broadcast_non_tensor_batch']``
is set) travels in a second ``broadcast_object_list`` over the replica's gloo twin;
``device=groups.device`` is passed on every rank, since by default each receiver would allocate
the storage on the SENDER's device index; the leader keeps its own batch (the library's
consolidated copy is dropped).

Adapted so that no rank waits for a leader that failed: the leader consolidates (what the
library would do first) before the call, so what fails there fails before anything is sent and
travels as a failure batch through the same library call (``strategies.Strategy``); a failure
batch ends the call after it on every rank, whatever the receivers' flag says. A
``non_tensor_batch`` the leader cannot pickle travels as a ``ShippedFailure`` in its place.

Adapted for the 8-byte padding: a complex128 leaf can land at an offset that is not a multiple
of 16, where the library's own ``view(complex128)`` fails on receivers. Such leaves travel as
``view_as_real`` float64 under a reserved ``__complex128__`` prefix and receivers restore them
(one copy of those leaves only); every other leaf arrives as the library delivers it.

Per call (DP = 1): 2 (pickled metadata) + 1 storage broadcast, + 2 when non-tensor data travels.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from strategies.core.contract import (
    DataProto,
    Unsupported,
    broadcast_or_raise,
    deliver,
    failure_in,
    wants_non_tensor,
)
from strategies.core.contract import leaves as all_leaves
from strategies.core.footprint import Footprint
from strategies.core.header_format import KIND_OBJECT
from strategies.core.parts import message_parts, nbytes_of
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan
from strategies.core.strategy_base import Strategy
from strategies.core.trace import WORK

CONSOLIDATE_ALIGN = 8  # tensordict pads every leaf of a mixed-dtype storage to 8 bytes
COMPLEX_PREFIX = "__complex128__"


def _hide_complex128(td: TensorDict) -> TensorDict:
    """complex128 leaves as float64 pairs under COMPLEX_PREFIX (see the module docstring)."""
    leaves = all_leaves(td)
    if not any(getattr(t, "dtype", None) == torch.complex128 for _, t in leaves):
        return td
    out = TensorDict({}, batch_size=td.batch_size, device=td.device)
    for key, t in leaves:
        if getattr(t, "dtype", None) == torch.complex128:
            out.set((COMPLEX_PREFIX, *key), torch.view_as_real(t))
        else:
            out.set(key, t)
    return out


def _restore_complex128(td: TensorDict) -> TensorDict:
    if COMPLEX_PREFIX not in td.keys():
        return td
    hidden = td.get(COMPLEX_PREFIX)
    td = td.exclude(COMPLEX_PREFIX)
    for key, t in hidden.items(include_nested=True, leaves_only=True):
        key = key if isinstance(key, tuple) else (key,)
        WORK["copied_bytes"] += t.numel() * t.element_size()
        td.set(key, torch.view_as_complex(t.clone()))  # the copy realigns it to 16 bytes
    return td


class TensorDictBroadcastBug(Unsupported):
    """The layout needs a group on which tensordict's ``broadcast`` is wrong (see module doc)."""


def refusal(world_size: int, replica_size: int, leader: int | None = None) -> str | None:
    """Why the library cannot serve this world, or None when it can (DP = 1, or replicas of one
    rank, which issue no collective)."""
    if world_size == replica_size or replica_size == 1:
        return None
    dp = world_size // replica_size
    mine = "" if leader is None else f" (this rank's replica leader is global rank {leader})"
    return (
        f"tensordict_broadcast: a world of {world_size} ranks holds dp={dp} replicas of "
        f"{replica_size} ranks. tensordict's TensorDict.broadcast (0.15.3) compares the "
        "group-local rank with src but passes src to broadcast_object_list as a global rank, so "
        "it is correct only on a group whose source is global rank 0: the other "
        f"{dp - 1} replica(s){mine} would fail with AttributeError or hang. Refused on every "
        "rank before any collective; use DP = 1 or another strategy (flat, header)."
    )


class TensorDictBroadcast(Strategy):
    name = "tensordict_broadcast"
    footprint = Footprint(leader=2, receiver=2, leader_kept=2)
    """Measured by the node memory phase (tensordict keeps its own buffers on every rank)."""
    claims = (
        "1 hop over the replica: 2 (pickled metadata) + 1 storage broadcast, +2 when "
        "non_tensor_batch travels; refuses DP > 1 (library bug)"
    )

    def __init__(self, groups, **options) -> None:
        super().__init__(groups, **options)
        replica_size = len(groups.replica_ranks)
        self._refusal = refusal(replica_size * groups.replicas, replica_size, groups.leader)
        if self._refusal is not None:
            raise TensorDictBroadcastBug(f"rank {groups.rank}: {self._refusal}")

    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        td = self._consolidated(batch) if g.is_leader else TensorDict()
        # Correct here: the replica holds global rank 0, which is the leader and group index 0.
        out = td.broadcast(src=g.leader, group=g.replica_group, device=g.device)
        if failure_in(DataProto(out)) is not None:  # a failure batch: it ends the call here
            return batch if g.is_leader else deliver(batch, out, None)
        non_tensor = None
        if wants_non_tensor(batch):
            sent = batch.non_tensor_batch if g.is_leader else None
            non_tensor = broadcast_or_raise(sent, g, g.cpu_replica_group)
        if not g.is_leader:
            deliver(batch, _restore_complex128(out), non_tensor)
        return batch

    def _consolidated(self, batch: DataProto) -> TensorDict:
        """Leader, before the library's first collective: consolidate as the library would
        (the same single copy), so whatever it would fail on fails before anything is sent."""
        td = _hide_complex128(batch.batch)
        if td.is_consolidated():
            return td
        WORK["packed_bytes"] += sum(
            _padded(nbytes_of(t)) for key, kind, _, t in message_parts(td) if kind != KIND_OBJECT
        )
        return td.consolidate(metadata=True, device=self.groups.device)

    @classmethod
    def plan(cls, layout, spec: PayloadSpec, leaf_bytes: tuple[int, ...] | None = None) -> Plan:
        """``leaf_bytes``: bytes of each tensor leaf (``PayloadSpec.leaf_nbytes``);
        without them the storage size is ``tensor_bytes``, inexact by the 8-byte padding."""
        why = refusal(layout.world_size, layout.replica_size)
        if why is not None:
            raise TensorDictBroadcastBug(why)
        sizes, exact = spec.leaf_nbytes(leaf_bytes)
        storage = sum(_padded(n) for n in sizes) if exact else spec.tensor_bytes
        nt = spec.sent_non_tensor_bytes
        comms: list[Comm] = []
        if layout.replica_size > 1:
            what = [(8, "sizes", True), (0, "pickle", False), (storage, "payload", exact)]
            if spec.broadcast_non_tensor:
                what += [(8, "sizes", True), (nt, "pickle", False)]
            for step, (nbytes, kind, ok) in enumerate(what):
                for ranks in layout.replica_groups():
                    comms.append(Comm("broadcast", tuple(ranks), ranks[0], nbytes, step, kind, ok))
        return Plan(
            cls.name,
            comms,
            leader=LocalWork(packed_bytes=storage, pickled_bytes=nt),
            receiver=LocalWork(pickled_bytes=nt),
        )


def _padded(n: int) -> int:
    return -(-n // CONSOLIDATE_ALIGN) * CONSOLIDATE_ALIGN


STRATEGY = TensorDictBroadcast
