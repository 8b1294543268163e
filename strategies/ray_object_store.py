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
  ``uint32``, ``uint64``, float8 on torch 2.13: ``strategies.core.roll_proto.loads_back``), which the receivers
  could not read.

ROLL's lazy fetch (``Options.fields``, ``strategies.core.lazy_fields``): the leader puts each
leaf as an object of its own (and the non-tensor batch as one more) and sends their
references; a reader gets only the leaves of the fields it names, as ROLL's ``RemoteBatch``
fetches a stage's fields from the object store. Without ``fields``, one object as above.

Left out: slime's Mooncake transfer across nodes; Ray's direct tensor transport and the
driver's own puts (the ``rdt`` and ``all_ranks`` dispatch modes measure those).

Per call: 3 collectives over the replica (reference sizes, reference bytes, barrier) and one
``ray.put`` + one ``ray.get`` per receiver (with ``fields``: one put per leaf, and a get of each
named leaf).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from strategies.core.contract import ContractError, is_non_tensor_leaf, leaves, wants_non_tensor
from strategies.core.footprint import Footprint
from strategies.core.lazy_fields import FieldsOptions, LazyFields
from strategies.core.parts import nbytes_of
from strategies.core.pulled_store import PulledStore, ray_actor_module
from strategies.core.roll_proto import loads_back
from strategies.core.trace import WORK

WORLD_HINT = "run it on a Ray world: bcastbench run world=ray strategy=ray_object_store"


class RayObjectStore(LazyFields, PulledStore):
    """The leader ``ray.put``s, the reference goes over the replica, every rank ``ray.get``s."""

    Options = FieldsOptions
    name = "ray_object_store"
    footprint = Footprint(leader=1, receiver=1, node=1)
    """Not measured yet (the node memory phase runs on forked worlds): the object in the
    node's plasma store, every rank's own copy out."""
    world = "ray"
    claims = "3 over the replica (reference sizes, bytes, barrier) + a ray.put and a ray.get each"

    def __init__(self, groups, **options) -> None:
        super().__init__(groups, **options)
        self._ray = ray_actor_module(self.name, groups.rank, WORLD_HINT)
        self._pinned: list = []
        """References whose out-of-band pin is still held (see the module docstring)."""

    def check(self, batch) -> None:
        self.check_fields(batch)
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

    def put(self, batch):
        """One ``ray.put`` of the TensorDict and the flagged non-tensor batch; the signal is
        its reference, pickled out of band (Ray pins the object on this owner until
        ``settle``)."""
        ray = self._ray
        non_tensor = batch.non_tensor_batch if wants_non_tensor(batch) else None
        if not self.options.fields or batch.batch is None:
            ref = ray.put((batch.batch, non_tensor))
            self._pinned.append(ref)
            return ray.cloudpickle.dumps(ref)
        # Lazy fetch: a reference per leaf, so each reader gets only the ones it names.
        refs = {key: ray.put(value) for key, value in leaves(batch.batch)}
        rest = ray.put(non_tensor) if non_tensor is not None else None
        self._pinned += [*refs.values(), *([rest] if rest is not None else [])]
        return ray.cloudpickle.dumps((tuple(batch.batch.batch_size), refs, rest))

    def settle(self) -> None:
        """Every rank has passed this call's barrier: no reference of this instance is still
        being fetched, so every pin is removed and every reference dropped."""
        core = self._ray._private.worker.global_worker.core_worker
        while self._pinned:
            core.remove_object_ref_reference(self._pinned.pop())

    def fetch(self, signal):
        ray = self._ray
        sent = ray.cloudpickle.loads(signal)
        if not isinstance(sent, tuple):  # the whole batch, one object
            td, non_tensor = ray.get(sent)
            del sent
            WORK["copied_bytes"] += _tensor_bytes(td)
            return td, non_tensor
        batch_size, refs, rest = sent
        keys = [key for key in refs if self.wanted(key)]
        td = TensorDict({}, batch_size=batch_size)
        for key, value in zip(keys, ray.get([refs[key] for key in keys])):
            td.set(key, value)
        WORK["copied_bytes"] += _tensor_bytes(td)
        return td, (ray.get(rest) if rest is not None else None)


def _tensor_bytes(td) -> int:
    """The tensor bytes a reader got out of the object store (what it copied out of it)."""
    if td is None:
        return 0
    return sum(nbytes_of(v) for _, v in leaves(td) if type(v) is torch.Tensor and not v.is_nested)


STRATEGY = RayObjectStore
