"""Recording what a call really does: every collective (kind, group, root, bytes) and the
local work strategies report (bytes packed, pickled, copied).

``with Recorder() as rec: strategy.get_data_input(batch)`` patches torch.distributed's
collectives (including the ones ``broadcast_object_list`` calls inside itself) for the
duration of the block. Tests compare ``rec.comms`` with a strategy's ``plan``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Local work counters the codec and peers bump; cheap enough to leave on (an int add).
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
    _saved: dict = field(default_factory=dict)

    def __enter__(self) -> Recorder:
        self._start = Counter(WORK)
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
        self.work = WORK - self._start

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
            return original(*args, **kwargs)

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

    def count(self) -> int:
        return len(self.comms)
