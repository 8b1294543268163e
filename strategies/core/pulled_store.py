"""The pulled store: the base of every strategy whose replica leader puts the batch into a store
outside the process group and sends the replica only a small signal (a reference, a key list),
from which every other rank fetches the batch itself: ``ray_object_store`` (Ray's object store)
and ``transferqueue`` (verl's TransferQueue) today, each transfer engine after them.

What they share lives here, once: the call's shape on every rank (the leader's put, the signal
over the replica's host group, a barrier so nothing is dropped while a reader still fetches,
the leader's clean-up; a reader's fetch, a barrier on every path, the batch delivered), how a
failure reaches the readers (in the signal's place, ``ShippedFailure``) and is named, the
strategy's Ray actor check, and the cost model's plan. A subclass says how it puts (``put``),
what it cleans up once every reader is through (``settle``) and how it fetches (``fetch``).
"""

from __future__ import annotations

import torch.distributed as dist

from strategies.core.contract import (
    ShippedFailure,
    Unsupported,
    broadcast_objects,
    deliver,
    failure_text,
    raise_failure,
    wants_non_tensor,
)
from strategies.core.lazy_fields import fields_bytes
from strategies.core.plan import Comm, PayloadSpec, Plan, StoreFetch
from strategies.core.strategy_base import Strategy

REF_BYTES = 256
"""About what a signal pickles to (an ObjectRef out of band: 231 bytes measured on a local
cluster)."""


def ray_actor_module(strategy: str, rank: int, hint: str):
    """The ``ray`` module where this process is a connected Ray actor; else Unsupported naming
    the rank, the strategy and ``hint`` (raised on every rank alike: a world's ranks are all
    actors or none is)."""
    try:
        import ray  # optional: only a Ray world's ranks have it connected
    except ImportError:
        raise Unsupported(
            f"rank {rank}: {strategy} needs Ray (pip install 'bcastbench[ray]'); {hint}"
        ) from None
    connected = hasattr(ray, "is_initialized") and ray.is_initialized()
    if not connected or ray.get_runtime_context().get_actor_id() is None:
        raise Unsupported(
            f"rank {rank}: {strategy} needs its ranks to be connected Ray actors, and this "
            f"rank is not one; {hint}"
        )
    return ray


class PulledStore(Strategy):
    """A store the readers pull from (see the module docstring)."""

    store = "ray_object"
    """The cluster's store the plan prices the put and the fetches with (``StoreFetch``)."""
    store_scope = "node"
    """Where a store's copy lives: ``node`` (one per node, read there) or ``replica`` (one
    storage unit every reader of the replica fetches from)."""
    reads_header = False
    """Whether a reader of some fields reads the message's header first (an engine's packed
    message) rather than asking the store for the fields by name."""

    def transfer(self, batch):
        return self._lead(batch) if self.groups.is_leader else self._take(batch)

    # -- the hooks ---------------------------------------------------------------------------
    def put(self, batch):
        """Leader: ``batch`` into the store; returns the signal the readers fetch it by. What
        fails here fails before any collective (the failure takes the batch's place)."""
        raise NotImplementedError

    def readers_through(self) -> None:
        """Leader, after the signal: wait at the call's barrier until every reader is through.
        An engine whose reads need the leader's own progress (``nixl``) makes it meanwhile."""
        dist.barrier(group=self.groups.cpu_replica_group)

    def settle(self) -> None:
        """Leader, once every rank passed the call's barrier: let go of what the call put (no
        reader still fetches it)."""

    def fetch(self, signal):
        """A reader: (the TensorDict, the non-tensor batch) ``signal`` names in the store."""
        raise NotImplementedError

    def fetched(self, signal) -> str:
        """What a failed fetch names: ``object``, ``batch <prefix>``."""
        return "object"

    # -- the call ----------------------------------------------------------------------------
    def _lead(self, batch):
        g = self.groups
        try:
            box = [self.put(batch)]
        except Exception as exc:  # noqa: BLE001 -- any type: it travels in the signal's place
            # Shipping a failure batch would go through ``put`` again, which may fail the same
            # way (an engine that cannot expose any buffer): the error itself is the signal.
            box = [ShippedFailure(failure_text(exc))]
            broadcast_objects(box, g.leader, g.cpu_replica_group)
            dist.barrier(group=g.cpu_replica_group)
            raise_failure(g, box[0].text, exc)
        failed = broadcast_objects(box, g.leader, g.cpu_replica_group)
        self.readers_through()
        self.settle()
        if failed is not None:
            raise_failure(g, box[0].text, failed)
        return batch

    def _take(self, entry):
        g = self.groups
        box = [None]
        broadcast_objects(box, g.leader, g.cpu_replica_group)
        signal = box[0]
        if isinstance(signal, ShippedFailure):
            dist.barrier(group=g.cpu_replica_group)
            raise_failure(g, signal.text)
        try:
            td, non_tensor = self.fetch(signal)
        except Exception as exc:  # noqa: BLE001 -- the barrier first, so the leader goes on
            dist.barrier(group=g.cpu_replica_group)
            raise RuntimeError(
                f"rank {g.rank}: {self.name}: fetching the leader's (rank {g.leader}) "
                f"{self.fetched(signal)} failed: {type(exc).__name__}: {exc}"
            ) from exc
        dist.barrier(group=g.cpu_replica_group)
        return deliver(entry, td, non_tensor if wants_non_tensor(entry) else None)

    # -- the cost model ----------------------------------------------------------------------
    @classmethod
    def plan(cls, layout, spec: PayloadSpec, fields: tuple[str, ...] | str = ()) -> Plan:
        """Per replica: the signal's size and bytes (its pickled size, ~``REF_BYTES``, is not
        predicted: inexact) and the barrier, priced as an empty broadcast (inexact); the
        leader's put and every other rank's fetch of the batch from ``store``
        (``StoreFetch``: the cluster's put/get α, β and fetch contention, the store's
        serialization included; a node-scoped store's object is copied once to each other
        node and read there by that node's ranks). ``fields`` (lazy fetch): each reader gets
        only those fields' bytes (``StoreFetch.read_bytes``), the leader still puts all."""
        comms: list[Comm] = []
        replicas = layout.replica_groups() if layout.replica_size > 1 else []
        steps = [(8, "sizes", True), (REF_BYTES, "reference", False), (0, "barrier", False)]
        for step, (nbytes, what, exact) in enumerate(steps):
            for ranks in replicas:
                comms.append(Comm("broadcast", tuple(ranks), ranks[0], nbytes, step, what, exact))
        got = fields_bytes(spec, fields, header=cls.reads_header)
        stores = [
            StoreFetch(cls.store, tuple(r), spec.sent_bytes, cls.store_scope, read_bytes=got)
            for r in replicas
        ]
        return Plan(cls.name, comms, stores=stores)
