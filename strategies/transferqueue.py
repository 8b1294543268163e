"""``transferqueue``: verl's TransferQueue (the pip package ``transferqueue``, called, not
copied) as the data plane: the replica leader ``kv_batch_put``s its batch under a key per row
and call, signals the replica, every rank ``kv_batch_get``s it and converts what comes back
into the leader's batch, the leader ``kv_clear``s the keys. Runs only on a Ray world
(``world=ray``) with the optional extra installed (``pip install 'bcastbench[transferqueue]'``).

Reproduced (TransferQueue 0.1.11's KV interface, as verl's and ROLL's integrations use it):

- ``transfer_queue.init`` once per process: the first replica leader creates the controller
  and the in-memory ``SimpleStorage`` backend (one storage unit: the default two, with the
  controller, reserve 3 Ray CPUs, and ``init`` waits for them forever), every other rank
  attaches to the named controller (a second ``init`` ignores its config). Its ZMQ sockets
  bind Ray's node address: a private cluster's 127.0.0.2 (and, as root, a loopback-only
  network namespace). TransferQueue has no bind-address option and its ports accept pickled
  data from any peer: run it on a loopback or private network only;
- per call: ``kv_batch_put(keys, partition_id, fields)`` on the leader (several controller
  round trips and one PUT to the storage unit), ``kv_batch_get(keys, partition_id)`` on every
  other rank (one RPC and one GET), ``kv_clear`` by the leader once every rank has its copy.
  Data crosses TCP twice (leader to storage, storage to reader), on one node too.

Adapted to the ``get_data_input`` contract:

- the readers learn the call's keys from a small pickled message over the replica group
  (``broadcast_object_list``: sizes, bytes), which also carries the batch's schema (keys,
  dtypes, shapes, batch size): a get before the put raises, and TransferQueue keeps no
  meta_info or key nesting;
- what comes back differs from what went in (rows of 2+ dims as jagged nested tensors,
  anything else as a NonTensorStack), so each dense leaf goes as its bytes, one uint8 row per
  sample, and comes back through ``values().view(dtype).view(shape)``: every dtype, view kind
  and nesting arrives bit for bit, and this conversion is part of what the strategy costs.
  Leaves with no bytes travel in the schema alone. Jagged NestedTensors, NonTensorData and
  NonTensorStack leaves and (when flagged) ``non_tensor_batch`` are pickled together into one
  more uint8 field cut into B rows;
- a batch of zero rows has no keys to put: it travels whole in the signal;
- a barrier over the replica before the leader's ``kv_clear`` (a reader still fetching would
  find its keys gone); a call that failed after its put leaves its keys to the next call's
  clear, and a call the base class finishes after a fault puts under the same keys again; ``torch.get_num_threads()`` is restored after each put and get (both
  reset it);
- only the process that created the controller owns it; no rank calls ``close()`` (a
  reader's close would kill the shared controller): the controller and storage unit end with
  their owner's process, i.e. with the Ray world;
- a leader's failure before the signal (``kv_batch_put`` included) travels as a failure batch
  through this same path (``strategies.Strategy``); a reader whose get fails still joins the
  barrier, then raises naming its rank.

ROLL's lazy fetch (``Options.fields``, ``strategies.core.lazy_fields``): a reader's
``kv_batch_get`` names the fields of the leaves it reads (``select_fields``) and the pickled
field, so the storage unit sends it only those; the leader still puts every field. Jagged,
non-tensor leaves and the non-tensor batch travel pickled together, so a reader of some fields
reads that one field whole and keeps the named leaves of it.

Left out: the controller's samplers, streaming data loader, tags and the Mooncake/Yuanrong
backends (they need services this suite does not start).

Per call: 3 collectives over the replica (signal sizes, signal bytes, barrier), one
``kv_batch_put`` + ``kv_clear`` on the leader and one ``kv_batch_get`` per reader.
"""

from __future__ import annotations

import itertools
import math
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from strategies.core.contract import Unsupported, leaves, wants_non_tensor
from strategies.core.footprint import Footprint
from strategies.core.lazy_fields import FieldsOptions, LazyFields
from strategies.core.pulled_store import PulledStore, ray_actor_module
from strategies.core.trace import WORK

EXTRA = "pip install 'bcastbench[transferqueue]'"
WORLD_HINT = "run it on a Ray world: bcastbench run world=ray strategy=transferqueue"
PARTITION = "bcastbench"
PICKLED_FIELD = "pickled"
TQ_CPUS = 2
"""Ray CPUs TransferQueue's actors reserve here: the controller and one storage unit."""
_INSTANCES = itertools.count()
"""Numbers each instance in this process, so two instances' keys never meet."""


def missing_package() -> str | None:
    """Why ``transfer_queue`` cannot be imported here (one line naming the extra), or None."""
    try:
        import transfer_queue  # noqa: F401 -- optional: the transferqueue extra
    except ImportError as exc:
        return f"transferqueue is not installed ({exc}); install the extra: {EXTRA}"
    return None


@dataclass(frozen=True)
class Signal:
    """What the leader tells its readers once the batch is in the store: the keys' prefix
    and the schema to rebuild the batch (or the whole batch, for a batch of zero rows)."""

    prefix: str
    rows: int
    dense: tuple  # (field, key, dtype, shape) per dense leaf
    pickled_bytes: int
    order: tuple = ()  # every leaf's key, in the leader's TensorDict order
    whole: object = None


class TransferQueue(LazyFields, PulledStore):
    """The leader puts, signals the replica, every rank gets; the leader clears."""

    Options = FieldsOptions
    name = "transferqueue"
    footprint = Footprint(leader=1, receiver=1, node=1)
    """Not measured yet (the node memory phase runs on forked worlds): the batch in the
    storage unit, every rank's own copy."""
    world = "ray"
    actor_cpus = TQ_CPUS
    store = "transferqueue"
    store_scope = "replica"
    """The plan (``PulledStore.plan``) prices the cluster's ``transferqueue`` store: one storage
    unit serves every reader of the replica (they contend for it, and a remote reader fetches
    across the network); the conversion back to the leader's batch is in its α and β."""
    claims = "3 over the replica (signal sizes, bytes, barrier) + a put and clear, a get each"

    @classmethod
    def unavailable(cls) -> str | None:
        return missing_package()

    def __init__(self, groups, **options) -> None:
        super().__init__(groups, **options)
        missing = missing_package()
        if missing is not None:
            raise Unsupported(f"rank {groups.rank}: {missing}")
        ray = ray_actor_module(self.name, groups.rank, WORLD_HINT)
        import transfer_queue as tq  # optional: the transferqueue extra

        self._tq = tq
        if not _controller_exists(ray) and ray.available_resources().get("CPU", 0) < TQ_CPUS:
            raise Unsupported(
                f"rank {groups.rank}: {self.name} needs {TQ_CPUS} free Ray CPUs for "
                f"TransferQueue's controller and storage unit; the cluster has "
                f"{ray.available_resources().get('CPU', 0):g} free (a cluster the job did not start "
                "needs them free: raise its CPUs or free some)"
            )
        self._attach(groups)
        self._instance, self._calls = next(_INSTANCES), 0
        self._uncleared: set[str] = set()

    def _attach(self, g) -> None:
        """The leaders first (the first creates the controller), then every other rank."""
        threads = torch.get_num_threads()
        if g.is_leader:
            self._tq.init(_conf())
        dist.barrier(group=g.cpu_replica_group)
        if not g.is_leader:
            self._tq.init()
        torch.set_num_threads(threads)

    # -- leader --------------------------------------------------------------------------------
    def check(self, batch) -> None:
        super().check(batch)
        self.check_fields(batch)

    def put(self, batch):
        """The batch's fields under this call's keys (``kv_batch_put``); the signal rebuilds it."""
        g = self.groups
        # The call's number moves on only once a call is through: a call the base class
        # finishes after a fault replays this one under the same keys, so its signal is the
        # same bytes as the one the readers were announced.
        prefix = f"r{g.rank}i{self._instance}c{self._calls}"
        signal, fields = _encode(batch, prefix)
        keys = _keys(signal)
        if keys:
            self._uncleared.update(keys)
            self._call(self._tq.kv_batch_put, keys=keys, partition_id=PARTITION, fields=fields)
        return signal

    def settle(self) -> None:
        self._clear()
        self._calls += 1

    def _clear(self) -> None:
        """Every rank has passed this call's barrier: every key this instance put and has not
        cleared (a faulted call's too) is cleared."""
        if self._uncleared:
            keys = sorted(self._uncleared)
            self._call(self._tq.kv_clear, keys=keys, partition_id=PARTITION)
            self._uncleared.clear()

    def _call(self, fn, **kwargs):
        """A TransferQueue call with this rank's torch thread count restored after it."""
        threads = torch.get_num_threads()
        try:
            return fn(**kwargs)
        finally:
            torch.set_num_threads(threads)

    # -- readers -------------------------------------------------------------------------------
    def fetched(self, signal) -> str:
        return f"batch {signal.prefix}"

    def fetch(self, signal: Signal):
        if signal.whole is not None:
            td, non_tensor = signal.whole
            return self.keep_wanted(td), non_tensor
        # Only the fields this rank reads (every field that was put, without ``fields``):
        # a field of a leaf with no bytes was never put, and asking for it would fail.
        select = [
            field
            for field, key, _, shape in signal.dense
            if math.prod(shape) and self.delivers(key)
        ]
        got = self._call(
            self._tq.kv_batch_get,
            keys=_keys(signal),
            partition_id=PARTITION,
            select_fields=[*select, PICKLED_FIELD],
        )
        WORK["copied_bytes"] += sum(_rows(got[f]).numel() for f in [*select, PICKLED_FIELD])
        return _decode(signal, got, self.delivers)


def _controller_exists(ray) -> bool:
    try:
        ray.get_actor("TransferQueueController", namespace="transfer_queue")
    except ValueError:
        return False
    return True


def _conf():
    from omegaconf import OmegaConf  # TransferQueue merges an OmegaConf config

    return OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})


def _keys(signal: Signal) -> list[str]:
    return [f"{signal.prefix}-{i}" for i in range(signal.rows)] if signal.whole is None else []


def _encode(batch, prefix: str) -> tuple[Signal, TensorDict | None]:
    """The leader's batch as TransferQueue fields (one uint8 row per sample and dense leaf,
    the rest pickled into one more field) and the signal that rebuilds it."""
    td = batch.batch
    b = int(td.batch_size[0])
    non_tensor = batch.non_tensor_batch if wants_non_tensor(batch) else None
    if b == 0:
        return Signal(prefix, 0, (), 0, whole=(td, non_tensor)), None
    fields, dense, other = {}, [], {}
    for i, (key, leaf) in enumerate(leaves(td)):
        if type(leaf) is not torch.Tensor:  # jagged, NonTensorData, NonTensorStack
            other[key] = leaf
            continue
        field = f"t{i}"
        dense.append((field, key, leaf.dtype, tuple(leaf.shape)))
        if leaf.numel():
            fields[field] = leaf.contiguous().view(torch.uint8).reshape(b, -1)
    blob = pickle.dumps((other, non_tensor, td.batch_size), protocol=5)
    width = -(-len(blob) // b)
    rows = torch.zeros(b * width, dtype=torch.uint8)
    rows[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    fields[PICKLED_FIELD] = rows.view(b, width)
    order = tuple(key for key, _ in leaves(td))
    signal = Signal(prefix, b, tuple(dense), len(blob), order)
    return signal, TensorDict(fields, batch_size=[b])


def _rows(value) -> torch.Tensor:
    """A field as it came back (a jagged nested tensor of rows, or dense) as one flat uint8
    tensor of the rows' bytes in order."""
    if value.is_nested:
        return value.values().reshape(-1)
    return value.reshape(-1)


def _decode(signal: Signal, got, delivers) -> tuple[TensorDict, dict | None]:
    """What ``kv_batch_get`` returned, rebuilt into the leader's TensorDict (the leaves
    ``delivers`` names) and ``non_tensor_batch`` (None when not flagged)."""
    raw = _rows(got[PICKLED_FIELD])[: signal.pickled_bytes]
    other, non_tensor, batch_size = pickle.loads(raw.numpy().tobytes())
    by_key = dict(other)
    for field, key, dtype, shape in signal.dense:
        if not delivers(key):
            continue
        if field in got.keys():
            by_key[key] = _rows(got[field]).view(dtype).view(shape)
        else:
            by_key[key] = torch.empty(shape, dtype=dtype)
    td = TensorDict({}, batch_size=batch_size)
    for key in signal.order:
        if delivers(key):
            td.set(key, by_key[key])
    return td, non_tensor


STRATEGY = TransferQueue
