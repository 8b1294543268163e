"""Finishing a call whose leader failed after some of its collectives went out: how many it
posted on each group, and a replay of its own send path that posts only the rest.

Receivers derive every collective they post from what arrived before it, so once the leader
has posted one, they wait for the whole sequence it announced. A leader that fails part way
(a collective that raises, an error in its own code between two of them) reruns its send path
on the message it had prepared, with the collectives it already posted answered locally: the
rest go out with the real bytes, and no receiver is left in a collective.

Counting uses each process group's own sequence number (every collective on a group advances
it), read once per call on the leader: no wrapper sits in the path of a good call.

Why the rest carries the batch and not the failure: once the first collective is out, some
receivers may already hold everything they will get (in a relay such as ``header``'s, TP×CP
on stage 0 then PP, the ranks of the other branch are done before the leader's second
broadcast), and a per-tensor collective has no room for a marker. Telling every rank would
take one more collective in every call; finishing with the real bytes leaves every receiver
exact and none waiting, and the leader raises its own error.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

try:  # the class every eager collective's Python front end calls into
    from torch._C._distributed_c10d import ProcessGroup, _create_work_from_future
except ImportError:  # a torch built without distributed support
    ProcessGroup = _create_work_from_future = None

from strategies.core.trace import PG_KINDS


def distinct_groups(groups: Iterable) -> tuple:
    """The process groups among ``groups``, each once (gloo twins are the same object)."""
    out: list = []
    for group in groups:
        if group is not None and not any(group is seen for seen in out):
            out.append(group)
    return tuple(out)


def marks(groups: tuple) -> tuple[int, ...] | None:
    """Every group's collective sequence number; None when a group cannot tell (a backend
    without one), so the caller knows it cannot count."""
    try:
        return tuple(g._get_sequence_number_for_group() for g in groups)
    except (AttributeError, RuntimeError, TypeError):
        return None


def posted_since(groups: tuple, before: tuple[int, ...] | None) -> dict[int, int] | None:
    """Collectives posted on each group since ``before`` (``marks``), keyed by ``id(group)``;
    None when that cannot be established."""
    after = marks(groups)
    if before is None or after is None:
        return None
    return {id(g): b - a for g, a, b in zip(groups, before, after) if b != a}


def _done() -> object:
    """A completed Work, for a collective that is answered locally instead of posted."""
    future = torch.futures.Future()
    future.set_result(None)
    return _create_work_from_future(future)


def _answer_locally(method: str, pg, args: tuple) -> None:
    """What a skipped collective would have written on this rank, where this rank holds it:
    its own chunk of a scatter it roots, its own slot of an all-gather. A broadcast from this
    rank writes nothing here."""
    me = pg.rank()
    if method == "scatter" and args[-1].rootRank == me:
        args[0][0].copy_(args[1][0][me])
    elif method in ("_allgather_base", "all_gather_single"):
        out, mine = args[0].view(-1), args[1].reshape(-1)
        out[me * mine.numel() : (me + 1) * mine.numel()].copy_(mine)
    elif method == "allgather":
        args[0][0][me].copy_(args[1][0])


class Replay:
    """``with Replay(posted): send()``: the first ``posted[id(group)]`` collectives ``send``
    makes on each group are answered locally (``_answer_locally``) and return a completed
    Work; every later one is posted as usual. Installed on the ``ProcessGroup`` methods, under
    anything bound at import, for the duration of the block only."""

    def __init__(self, posted: dict[int, int]) -> None:
        self.left = dict(posted)
        self._saved: dict = {}

    def __enter__(self) -> Replay:
        if ProcessGroup is None:
            raise RuntimeError("torch has no ProcessGroup class (built without distributed)")
        for method in PG_KINDS:
            raw = vars(ProcessGroup).get(method)
            if raw is None:
                continue
            self._saved[method] = raw
            setattr(ProcessGroup, method, self._wrap(method, getattr(ProcessGroup, method)))
        return self

    def __exit__(self, *exc) -> None:
        for method, raw in self._saved.items():
            setattr(ProcessGroup, method, raw)
        self._saved.clear()

    def _wrap(self, method: str, original):
        left = self.left

        def replayed(pg, *args, **kwargs):
            if left.get(id(pg), 0) > 0:
                left[id(pg)] -= 1
                _answer_locally(method, pg, args)
                return _done()
            return original(pg, *args, **kwargs)

        return replayed
