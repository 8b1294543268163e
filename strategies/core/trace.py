"""Recording what a call really does: every collective (kind, group, root, bytes) and the
local work strategies report (bytes packed, pickled, copied).

``with Recorder() as rec: strategy.get_data_input(batch)`` patches torch.distributed's
collectives (including the ones ``broadcast_object_list`` calls inside itself) for the
duration of the block. Tests compare ``rec.comms`` with a strategy's ``plan``.

Two layers, so a collective is counted however a strategy reaches it: the module attributes of
``torch.distributed`` (named as plans name them, with the caller's group and root), and under
them the ``ProcessGroup`` methods every eager collective ends in, which catch what the first
layer cannot see (``from torch.distributed import broadcast`` bound before the block,
``all_reduce``, ``isend``/``irecv``, ``batch_isend_irecv``). A call that went through the first
layer is not counted again by the second. If the second layer cannot be installed the recorder
says so in ``unavailable`` instead of reporting a count that may be short.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

try:  # the class every eager collective's Python front end calls into
    from torch._C._distributed_c10d import ProcessGroup
except ImportError:  # a torch built without distributed support
    ProcessGroup = None

# Local work counters the packer and peers bump; cheap enough to leave on (an int add).
WORK: Counter = Counter()

PATCHED = tuple(
    name
    for name in (
        "broadcast",
        "scatter",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "send",
        "recv",
    )
    if hasattr(c10d, name)
)

PG_KINDS = {
    "broadcast": "broadcast",
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "reduce": "reduce",
    "allgather": "all_gather",
    "_allgather_base": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_single_coalesced": "all_gather",
    "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "gather": "gather",
    "scatter": "scatter",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
}
"""ProcessGroup methods (the second layer) and the kind each is recorded as."""


@dataclass(frozen=True)
class Recorded:
    kind: str
    ranks: tuple[int, ...]
    root: int | None
    nbytes: int
    async_op: bool = False


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _ranks(group) -> tuple[int, ...]:
    if group is None or group is c10d.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


@dataclass
class Recorder:
    comms: list[Recorded] = field(default_factory=list)
    work: Counter = field(default_factory=Counter)
    unavailable: str | None = None
    """Why ``comms`` may be incomplete (the lower layer could not be installed); None if not."""
    _saved: dict = field(default_factory=dict)
    _saved_pg: dict = field(default_factory=dict)
    _inside: int = 0
    """Depth of first-layer calls in progress: their ProcessGroup calls are already counted."""

    def __enter__(self) -> Recorder:
        self._start = Counter(WORK)
        self._patch_process_group()
        for name in PATCHED:
            original = getattr(c10d, name)
            self._saved[name] = original
            wrapper = self._wrap(name, original)
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)
        for name, key in (
            ("_object_to_tensor", "pickled_bytes"),
            ("_tensor_to_object", "unpickled_bytes"),
        ):
            original = getattr(c10d, name)
            self._saved[name] = original
            setattr(c10d, name, self._wrap_pickle(original, key))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(c10d, name, original)
            if name in PATCHED:
                setattr(dist, name, original)
        self._saved.clear()
        for name, original in self._saved_pg.items():
            setattr(ProcessGroup, name, original)
        self._saved_pg.clear()
        self.work = WORK - self._start

    def _patch_process_group(self) -> None:
        if ProcessGroup is None:
            self.unavailable = "torch has no ProcessGroup class (built without distributed)"
            return
        for name, kind in PG_KINDS.items():
            # The class's own entry is what goes back: pybind11 stores methods as descriptors
            # that bind ``self``, while getattr hands out the bare function inside.
            raw = vars(ProcessGroup).get(name)
            if raw is None:
                continue
            try:
                setattr(ProcessGroup, name, self._wrap_pg(name, kind, getattr(ProcessGroup, name)))
            except (AttributeError, TypeError) as exc:
                self.unavailable = f"cannot intercept ProcessGroup.{name}: {exc}"
                continue
            self._saved_pg[name] = raw

    def _wrap_pg(self, method: str, kind: str, original):
        recorder = self

        def recorded(pg, *args, **kwargs):
            if recorder._inside == 0:
                recorder.comms.append(_pg_call(method, kind, pg, args))
            return original(pg, *args, **kwargs)

        return recorded

    def _wrap(self, kind: str, original):
        def recorded(*args, **kwargs):
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("output_tensor"))
            group = kwargs.get("group")
            root = kwargs.get("src")
            if kind == "broadcast":
                root = kwargs.get("src", args[1] if len(args) > 1 else None)
                group = kwargs.get("group", args[2] if len(args) > 2 else None)
            elif kind == "scatter":
                group = kwargs.get("group", args[3] if len(args) > 3 else None)
                root = kwargs.get("src", args[2] if len(args) > 2 else None)
            elif kind in ("all_gather", "all_gather_into_tensor", "all_gather_single"):
                group = kwargs.get("group", args[2] if len(args) > 2 else None)
            if kind == "all_gather":
                tensor = args[0] if args else kwargs.get("tensor_list")
            if root is None and kwargs.get("group_src") is not None:
                root = dist.get_global_rank(group, kwargs["group_src"])
            self.comms.append(
                Recorded(
                    kind.replace("_into_tensor", "").replace("_single", ""),
                    _ranks(group),
                    root,
                    _nbytes(tensor),
                    bool(kwargs.get("async_op", False)),
                )
            )
            self._inside += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside -= 1

        return recorded

    def _wrap_pickle(self, original, key: str):
        def counted(obj, *args, **kwargs):
            out = original(obj, *args, **kwargs)
            if key == "pickled_bytes":
                WORK[key] += int(out[1].sum()) if isinstance(out, tuple) else 0
            else:
                size = args[0] if args else kwargs.get("tensor_size")
                WORK[key] += int(size)
            return out

        return counted

    def count(self) -> int | None:
        """Collectives recorded; None when the count is unavailable (see ``unavailable``)."""
        return None if self.unavailable else len(self.comms)


def _pg_call(method: str, kind: str, pg, args: tuple) -> Recorded:
    """A ProcessGroup-level call as a record: its group's global ranks, the root in global
    ranks (broadcast/reduce/scatter/gather roots are group-local in their options; a send's
    root is this rank, a recv's the peer), and the bytes of its first tensor argument (the
    output, for gathers, as the first layer counts them)."""
    try:
        ranks = tuple(dist.get_process_group_ranks(pg))
    except (ValueError, RuntimeError, KeyError):
        ranks = ()
    root = None
    local = None
    if method in ("send", "recv") and len(args) > 1 and isinstance(args[1], int):
        local = args[1]
    elif args and hasattr(args[-1], "rootRank"):
        local = args[-1].rootRank
    if local is not None and 0 <= local < len(ranks):
        root = ranks[local]
    if kind == "send" and ranks:
        root = dist.get_rank()
    first = next((a for a in args if isinstance(a, torch.Tensor | list | tuple)), None)
    return Recorded(kind, ranks, root, _nbytes(first), kind in ("send", "recv"))
