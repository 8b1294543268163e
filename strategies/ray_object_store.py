"""``ray_object_store``: slime's data path, the batch as a Ray ObjectRef: the replica leader
``ray.put``s its batch once, the reference goes over the replica group, every rank ``ray.get``s
it. Runs only where Ray is connected and the ranks are Ray actors (``world=ray``); elsewhere it
refuses at construction, on every rank, before any collective (``strategies.Unsupported``).

Reproduced (slime's rollout-to-train hand-over, ``ray.put`` then ``ray.get`` in each consumer):

- one object per call holding the leader's TensorDict (and ``non_tensor_batch`` when
  ``meta_info['_broadcast_non_tensor_batch']`` is set), serialized by Ray as it is: Ray's
  pickle 5 with out-of-band buffers, so numpy arrays of a plain dtype are read in place from
  the node's shared-memory store (no copy on a node; one copy to each other node). Torch
  tensors are NOT zero-copy here: Ray pickles them through torch's own reducer (their storage
  as bytes, unless ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS`` is set in every process), so every
  ``ray.get`` deserializes its own copy of each leaf. Receivers therefore own their tensors:
  writing into one reaches no other rank.

Adapted to the ``get_data_input`` contract:

- the reference travels over the replica group as a small pickled message
  (``broadcast_object_list``: sizes, bytes), not through a driver's task arguments as in
  slime: the ranks here are peers with no handles on each other;
- the object's lifetime is bounded by the call. Ray's out-of-band serialization of an
  ObjectRef pins the object on its owner (the leader) for the owner's lifetime; after a
  barrier over the replica (every rank holds its value), the leader removes that pin and drops
  its reference, so the object store holds nothing once the call returns. A call that failed
  after its reference went out keeps its pin until the next call's barrier (a receiver may
  still be fetching it);
- a leader's failure before the reference goes out (``ray.put`` included) travels as a failure
  batch through this same path (``strategies.Strategy``); a receiver whose ``ray.get`` fails
  still joins the barrier, then raises naming its rank, so the leader never waits for it;
- CPU leaves only: a leaf on another device is refused on every rank (Ray would pickle it for
  the leader's device index), and so is a dtype torch pickles but cannot unpickle (``uint16``,
  ``uint32``, ``uint64``, float8 on torch 2.13: ``pickled.loads_back``), which the receivers
  could not read.

Left out: slime's Mooncake transfer across nodes, and Ray's direct tensor transport
(``tensor_transport=``); the driver's own puts (the ``all_ranks`` dispatch mode measures those).

Per call: 3 collectives over the replica (reference sizes, reference bytes, barrier) and one
``ray.put`` + one ``ray.get`` per receiver.
"""

from __future__ import annotations

import torch.distributed as dist

from strategies.core.contract import (
    ContractError,
    ShippedFailure,
    Unsupported,
    broadcast_objects,
    deliver,
    is_non_tensor_leaf,
    leaves,
    raise_failure,
    wants_non_tensor,
)
from strategies.core.footprint import Footprint
from strategies.core.plan import Comm, PayloadSpec, Plan, StoreFetch
from strategies.core.strategy_base import Strategy
from strategies.pickled import loads_back

WORLD_HINT = "run it on a Ray world: bcastbench run world=ray strategy=ray_object_store"


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


class RayObjectStore(Strategy):
    """The leader ``ray.put``s, the reference goes over the replica, every rank ``ray.get``s."""

    name = "ray_object_store"
    footprint = Footprint(leader=1, receiver=1, node=1)
    """Not measured yet (the node memory phase runs on forked worlds): the object in the
    node's plasma store, every rank's own copy out."""
    world = "ray"
    claims = "3 over the replica (reference sizes, bytes, barrier) + a ray.put and a ray.get each"

    def __init__(self, groups) -> None:
        super().__init__(groups)
        self._ray = ray_actor_module(self.name, groups.rank, WORLD_HINT)
        self._pinned: list = []
        """References whose out-of-band pin is still held (see the module docstring)."""

    def check(self, batch) -> None:
        rank = self.groups.rank
        for key, value in leaves(batch.batch):
            if is_non_tensor_leaf(value):
                continue
            if value.device.type != "cpu":
                raise ContractError(
                    f"rank {rank}: batch[{key!r}] is on {value.device}; {self.name} carries "
                    "CPU leaves only (expected device cpu)"
                )
            if not loads_back(value.dtype, torch_save=False):
                raise ContractError(
                    f"rank {rank}: batch[{key!r}] has dtype {value.dtype}, which torch pickles "
                    f"but cannot unpickle, so {self.name}'s receivers could not read it; send "
                    "it as a wider dtype"
                )

    def transfer(self, batch):
        g = self.groups
        if g.is_leader:
            return self._send(batch)
        return self._receive(batch)

    def _send(self, batch):
        g, ray = self.groups, self._ray
        non_tensor = batch.non_tensor_batch if wants_non_tensor(batch) else None
        ref = ray.put((batch.batch, non_tensor))  # a failure here fails before any collective
        blob = ray.cloudpickle.dumps(ref)  # out of band: Ray pins the object on this owner
        self._pinned.append(ref)
        box = [blob]
        failed = broadcast_objects(box, g.leader, g.cpu_replica_group)
        dist.barrier(group=g.cpu_replica_group)
        self._release()
        if failed is not None:
            raise_failure(g, box[0].text, failed)
        return batch

    def _release(self) -> None:
        """Every rank has passed this call's barrier: no reference of this instance is still
        being fetched, so every pin is removed and every reference dropped."""
        core = self._ray._private.worker.global_worker.core_worker
        while self._pinned:
            core.remove_object_ref_reference(self._pinned.pop())

    def _receive(self, entry):
        g, ray = self.groups, self._ray
        box = [None]
        broadcast_objects(box, g.leader, g.cpu_replica_group)
        if isinstance(box[0], ShippedFailure):
            dist.barrier(group=g.cpu_replica_group)
            raise_failure(g, box[0].text)
        try:
            ref = ray.cloudpickle.loads(box[0])
            td, non_tensor = ray.get(ref)
            del ref
        except Exception as exc:  # noqa: BLE001 -- the barrier first, so the leader goes on
            dist.barrier(group=g.cpu_replica_group)
            raise RuntimeError(
                f"rank {g.rank}: {self.name}: fetching the leader's (rank {g.leader}) object "
                f"failed: {type(exc).__name__}: {exc}"
            ) from exc
        dist.barrier(group=g.cpu_replica_group)
        return deliver(entry, td, non_tensor if wants_non_tensor(entry) else None)

    @classmethod
    def plan(cls, layout, spec: PayloadSpec, store: str = "ray_object") -> Plan:
        """Per replica: the reference's size and bytes (its pickled size, ~``REF_BYTES``, is
        not predicted: inexact) and the barrier, priced as an empty broadcast (inexact); the
        leader's ``ray.put`` and every other rank's ``ray.get`` of the batch as a fetch from
        ``store`` (``StoreFetch``: the cluster's put/get α, β and fetch contention, Ray's
        serialization of the TensorDict included; the object is copied once to each other
        node and read there by that node's ranks)."""
        comms: list[Comm] = []
        replicas = layout.replica_groups() if layout.replica_size > 1 else []
        steps = [(8, "sizes", True), (REF_BYTES, "reference", False), (0, "barrier", False)]
        for step, (nbytes, what, exact) in enumerate(steps):
            for ranks in replicas:
                comms.append(Comm("broadcast", tuple(ranks), ranks[0], nbytes, step, what, exact))
        nt = spec.sent_non_tensor_bytes
        scope = "replica" if store == "transferqueue" else "node"
        stores = [StoreFetch(store, tuple(r), spec.tensor_bytes + nt, scope) for r in replicas]
        return Plan(cls.name, comms, stores=stores)


REF_BYTES = 256
"""About what an ObjectRef pickles to out of band (231 bytes measured on a local cluster)."""

STRATEGY = RayObjectStore
