"""``torch_shared``: the leader's tensors reach the ranks of its node through torch's own shared
tensors (``torch.multiprocessing.reductions``), as ROLL's ``MultiprocessingSerializer`` sends them.

Source followed: ROLL ``roll/utils/cuda_ipc_utils.py`` (commit
8eb27cc2dc34c4d1310b169d9b86d339004d811a): ``MultiprocessingSerializer.serialize`` pickles an
object with ``multiprocessing.reduction.ForkingPickler`` to bytes, ``deserialize`` loads them on
the other side. Once ``torch.multiprocessing`` is imported, ForkingPickler reduces a CPU tensor
to its storage moved into shared memory plus the storage's file descriptor (the
``file_descriptor`` sharing strategy), which crosses through multiprocessing's resource sharer:
a thread in the sending process that hands each registered descriptor (``DupFd``) to the one
process that asks for it, over a Unix socket (``SCM_RIGHTS``). Written here from that
description, for torch 2.13 and CPython 3.11.

Per call, on the leader (everything before its one broadcast, so whatever fails fails first):

- every tensor leaf gets a fresh shared storage the leaf is copied into (``copied_bytes``: the
  payload's tensor bytes; a jagged leaf as its values, offsets and lengths). The harness hands
  the leader the same batch every call, and ``share_memory_()`` moves a storage in place, so a
  reused batch would be shared once and then cost nothing, which no RL step (a new batch each
  step) gets; the caller's batch is never touched;
- the TensorDict of those shared leaves (non-tensor leaves as they are) is pickled with
  ForkingPickler once per receiver: a ``DupFd`` can be taken by one process only, so each
  receiver needs its own (metadata only: the storages are shared once);
- one ``broadcast_object_list`` over the replica's host group carries the per-receiver pickles
  and, when flagged, ``non_tensor_batch`` (pickled once by the broadcast itself): two
  collectives (sizes, bytes), the fewest a collective hand-off of variable bytes takes; a
  point-to-point send per receiver would be two per receiver. A receiver loads its own pickle:
  each storage's descriptor is fetched from the leader's resource sharer and mapped, so its
  tensors are views of the leader's shared memory, not copies (``is_shared()``).

Lifetime: the leader drops its own mapping when the call returns; each storage lives on in the
descriptor the resource sharer holds for each receiver (closed by the sharer as soon as that
receiver takes it), then in the receivers' mappings, and is freed when the last one goes, so no
barrier is needed. The storages are files made and unlinked at once by torch (``/dev/shm``
never lists them), so a kill -9 leaves none. A descriptor no receiver took (it failed or died
between the broadcast and its load) cannot be told from one a slow receiver is about to take
without one more collective: the leader can return, start its next call and even drop the
strategy before a receiver loads. So it stays with the leader's sharer until the process ends;
those the leader registered for a send that never went out are closed at once.

The resource sharer's socket: multiprocessing would bind it at a file under a temporary
directory that only a normal exit removes; the leader starts it at construction on an
abstract-namespace Unix address (Linux: no file, gone with the process), so a kill -9 leaves
no socket file either. Nothing listens on the network. Its thread is multiprocessing's own, one
per process, and lives as long as the leader's process (as when torch starts it).

Authkey: the sharer accepts only connections that prove ``multiprocessing.current_process()
.authkey``. Ranks forked from one parent share it; ranks started by torchrun each draw their
own. At construction the leader starts its sharer and broadcasts the authkey that sharer checks
(its own, unless a sharer already ran), once, over the replica's host group; every receiver of
its replica takes it as its process's authkey.

Refused on every rank at construction, before any collective (``Unsupported``): a replica that
spans nodes (a descriptor cannot cross hosts; ``shm`` crosses them), groups on a GPU (CUDA IPC
handles are the same code but not this item's; ``shm`` stages through the host), and a process
whose torch sharing strategy is not ``file_descriptor`` (``file_system`` leaves named files and
a ``torch_shm_manager`` process behind).
"""

from __future__ import annotations

import io
import os
import secrets
import threading
from multiprocessing import connection, current_process, resource_sharer
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing  # registers torch's reductions with ForkingPickler
from tensordict import TensorDict

from strategies.core.contract import (
    Unsupported,
    broadcast_or_raise,
    deliver,
    is_non_tensor_leaf,
    is_settled,
    leaves,
    wants_non_tensor,
)
from strategies.core.footprint import Footprint
from strategies.core.parts import nbytes_of
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan, StoreFetch
from strategies.core.strategy_base import Strategy
from strategies.core.trace import WORK

NAME = "torch_shared"
ENTRY_BYTES_ESTIMATE = 400
"""Roughly what one tensor adds to a ForkingPickler pickle (the rebuild function's name, the
sharer's address and key, the storage's size, dtype, shape and strides): the plan's estimate."""


def refusal(groups) -> str | None:
    """Why this strategy cannot serve ``groups``' replica (one line for ``Unsupported``), or
    None. Pure: every rank of a replica reaches the same answer before any collective."""
    nodes = groups.replica_nodes
    if len(nodes) > 1:
        return (
            f"rank {groups.rank}: {NAME}: replica ranks {list(groups.replica_ranks)} span "
            f"{len(nodes)} nodes ({' | '.join(str(list(n)) for n in nodes)}); a file "
            "descriptor cannot cross hosts: use shm, which crosses them"
        )
    if groups.device.type != "cpu":
        return (
            f"rank {groups.rank}: {NAME}: groups on {groups.device}; CUDA IPC handles are not "
            "carried here: use shm (staged through the host)"
        )
    sharing = torch.multiprocessing.get_sharing_strategy()
    if sharing != "file_descriptor":
        return (
            f"rank {groups.rank}: {NAME}: torch's sharing strategy is {sharing!r}; only "
            "'file_descriptor' leaves nothing behind (set it, or use shm)"
        )
    return None


# -- the leader's resource sharer ------------------------------------------------------------
# multiprocessing keeps one sharer per process (``resource_sharer._resource_sharer``) and binds
# it lazily at a file path; these helpers start it on an abstract address and close what a
# receiver never took. They reach into its private state (as CPython 3.11 lays it out), the one
# way to choose its address.
_SHARER = resource_sharer._resource_sharer


def start_sharer() -> bytes:
    """Start the process's resource sharer on an abstract Unix address (no file to leave
    behind), with the process's authkey; a sharer already running is kept as it is. Returns
    the authkey its listener checks (the process's may have changed since it started)."""
    with _SHARER._lock:
        if _SHARER._address is not None:
            return bytes(_SHARER._listener._authkey)
        address = f"\0bcastbench-{NAME}-{os.getpid()}-{secrets.token_hex(8)}"
        listener = connection.Listener(address, "AF_UNIX", authkey=current_process().authkey)
        _SHARER._listener, _SHARER._address = listener, listener.address
        thread = threading.Thread(target=_SHARER._serve, daemon=True)
        thread.start()
        _SHARER._thread = thread
        return bytes(current_process().authkey)


def sharer_key() -> int:
    """The last key the sharer handed out: keys registered later are greater."""
    with _SHARER._lock:
        return _SHARER._key


def close_untaken(keys: list[int]) -> None:
    """Close the descriptors of ``keys`` no receiver took yet."""
    with _SHARER._lock:
        for key in keys:
            entry = _SHARER._cache.pop(key, None)
            if entry is not None:
                entry[1]()


def waiting() -> int:
    """Descriptors the process's sharer holds for a receiver that has not taken them yet."""
    with _SHARER._lock:
        return len(_SHARER._cache)


# -- the leader's copy -----------------------------------------------------------------------
def shared_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a fresh storage made in shared memory (contiguous; counted as copied
    bytes). An empty tensor has no storage to share: torch pickles it as empty."""
    nbytes = nbytes_of(t)
    if nbytes == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    storage = torch.UntypedStorage._new_shared(nbytes)  # made shared, not moved there
    out = torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape)
    out.copy_(t)
    WORK["copied_bytes"] += nbytes
    return out


def shared_leaf(value):
    """A tensor leaf as it is shared: a dense one copied, a jagged one rebuilt from copies of
    its values, offsets and lengths."""
    if not value.is_nested:
        return shared_copy(value)
    lengths = value.lengths()
    return torch.nested.nested_tensor_from_jagged(
        shared_copy(value.values()),
        shared_copy(value.offsets()),
        lengths=None if lengths is None else shared_copy(lengths),
        jagged_dim=value._ragged_idx,
    )


def shared_batch(td: TensorDict) -> TensorDict:
    """A TensorDict of ``td``'s structure whose tensors are fresh shared copies; ``td`` and its
    leaves are left as they were."""
    out = td.clone(recurse=False)  # new nodes, the caller's leaves until replaced below
    for key, value in leaves(td):
        if not is_non_tensor_leaf(value):  # a non-tensor leaf is pickled by value, as it is
            out.set(key, shared_leaf(value))
    return out


def forking_dumps(obj) -> bytes:
    """ForkingPickler's bytes of ``obj`` (ROLL's ``serialize``): shared storages go as
    descriptors registered with the resource sharer."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    blob = buf.getvalue()
    WORK["pickled_bytes"] += len(blob)
    return blob


class TorchShared(Strategy):
    """The leader's shared tensors by ForkingPickler, one pickle per receiver (module docstring)."""

    name = NAME
    store = "torch_shared"
    """The cluster's store its plan prices the shared storages with (``StoreFetch``)."""
    footprint = Footprint(leader=0, receiver=0, node=1)
    """An estimate, not yet measured by the node memory phase: beyond the leader's batch, one
    shared copy on the node; the receivers view it and the leader drops its mapping."""
    claims = (
        "2 collectives a call (one broadcast_object_list of the per-receiver pickles over the "
        "replica's host group); tensors cross as shared-memory descriptors over a Unix socket"
    )

    def __init__(self, groups, **options) -> None:
        why = refusal(groups)
        if why is not None:
            raise Unsupported(why)
        super().__init__(groups, **options)
        self._receivers = tuple(r for r in groups.replica_ranks if r != groups.leader)
        self._prepared: tuple | None = None
        """Leader: (the batch sent, the broadcast's object, its sharer keys) of this call,
        kept so a replayed send (``Strategy._finish``) sends the same bytes."""
        if len(groups.replica_ranks) > 1:
            self._share_authkey()

    def _share_authkey(self) -> None:
        """The authkey the leader's sharer checks, on every rank of its replica as its own (a
        torchrun world draws one per process)."""
        g = self.groups
        box = [start_sharer() if g.is_leader else None]
        dist.broadcast_object_list(box, src=g.leader, group=g.cpu_replica_group)
        if not g.is_leader:
            current_process().authkey = box[0]

    def leader_view(self, batch):
        self._prepared = None  # a new call: a replay reuses what this call prepares
        return super().leader_view(batch)

    def transfer(self, batch):
        g = self.groups
        if not g.is_leader:  # a leader's failure, shipped in the object's place, raises here
            payloads, non_tensor = broadcast_or_raise(None, g, g.cpu_replica_group)
            blob = payloads[self._receivers.index(g.rank)]
            WORK["unpickled_bytes"] += len(blob)
            return deliver(batch, ForkingPickler.loads(blob), non_tensor)
        if self._prepared is None or self._prepared[0] is not batch:
            self._prepare(batch)
        try:
            broadcast_or_raise(self._prepared[1], g, g.cpu_replica_group)
        except Exception as exc:
            # Settled: non_tensor_batch would not pickle and a failure went in the object's
            # place, so no receiver takes these. A collective's own failure keeps them: the
            # replay (``Strategy._finish``) sends them, or a shipped failure's ``_prepare``
            # closes them when nothing went out.
            if is_settled(exc):
                close_untaken(self._prepared[2])
            raise
        return batch

    def _prepare(self, batch) -> None:
        """Leader: the broadcast's object for ``batch``; a failure closes every descriptor it
        registered, before anything went out."""
        if self._prepared is not None:  # a send that failed before it went out (shipped)
            close_untaken(self._prepared[2])
        first = sharer_key()
        try:
            td = shared_batch(batch.batch)
            payloads = tuple(forking_dumps(td) for _ in self._receivers)
        except BaseException:
            close_untaken(list(range(first + 1, sharer_key() + 1)))
            raise
        keys = list(range(first + 1, sharer_key() + 1))
        non_tensor = batch.non_tensor_batch if wants_non_tensor(batch) else None
        self._prepared = (batch, (payloads, non_tensor), keys)

    @classmethod
    def plan(cls, layout, spec: PayloadSpec) -> Plan:
        """One ``broadcast_object_list`` per replica: the sizes, then the pickled object (its
        size estimated: ``ENTRY_BYTES_ESTIMATE`` per tensor per receiver, and the non-tensor
        arrays). The storages are priced as the cluster's ``torch_shared`` store
        (``StoreFetch``, one per replica, its α paid per leaf): the leader's copy of every
        tensor byte into fresh shared memory, each receiver's fetch of a descriptor per
        storage from the leader's resource sharer and its mapping (no copy of the bytes);
        fitted by ``calibrate target=store`` on its pull records. Unfitted, the copy is priced
        at the host's memcpy rate."""
        if layout.replica_size == 1:
            return Plan(cls.name, [])
        nt = spec.sent_non_tensor_bytes
        pickled = (layout.replica_size - 1) * spec.n_tensors * ENTRY_BYTES_ESTIMATE + nt
        comms: list[Comm] = []
        for ranks in layout.replica_groups():
            ranks = tuple(ranks)
            comms.append(Comm("broadcast", ranks, ranks[0], 8, 0, "sizes"))
            comms.append(Comm("broadcast", ranks, ranks[0], pickled, 1, "pickle", False))
        stores = [
            StoreFetch(cls.store, tuple(r), spec.tensor_bytes, crosses=False, calls=spec.n_tensors)
            for r in layout.replica_groups()
        ]
        leader = LocalWork(pickled_bytes=nt)
        return Plan(
            cls.name, comms, leader=leader, receiver=LocalWork(pickled_bytes=nt), stores=stores
        )


STRATEGY = TorchShared
