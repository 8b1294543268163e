"""The plan of a message relayed with a ``Wire`` (``header``, ``flat``, ``pp_first``,
``direct``): each hop's broadcasts as the wire posts them, and the local work of the relay.
"""

from __future__ import annotations

from strategies.core.plan import Comm, LocalWork, PayloadSpec
from strategies.core.wire import Wire, segments


def steady_expect(total: int) -> int:
    """The first-message size a stream of ``total``-byte messages settles on (default options)."""
    return Wire(None, 0).next_expect(total)


def _wire_comms(comms: list[Comm], groups, total: int, first: int, step: int) -> int:
    for a, b in segments(first):  # one broadcast, or SEGMENTS pipelined ones when large
        for ranks in groups:
            what = "header+payload" if a == 0 else "payload"
            comms.append(Comm("broadcast", tuple(ranks), ranks[0], b - a, step, what))
        step += 1
    if total > first:
        for ranks in groups:
            comms.append(Comm("broadcast", tuple(ranks), ranks[0], total - first, step, "payload"))
        step += 1
    return step


def hop_comms(hops, total: int, first: int, step: int = 0) -> tuple[list[Comm], int]:
    """Every hop's wire broadcasts in order (``hops``: one list of groups per hop); returns
    them and the next free step."""
    comms: list[Comm] = []
    for groups in hops:
        step = _wire_comms(comms, groups, total, first, step)
    return comms, step


def relay_work(
    spec: PayloadSpec, total: int, first: int, *, receiver_copies: bool, forwarder: bool
) -> dict[str, LocalWork]:
    """The local work of a relayed message: the leader packs it; a receiver (and a forwarder,
    when the plan has one) unpickles the flagged non-tensor blob and, when ``receiver_copies``,
    copies the message into a larger buffer when it outgrew the announced size."""
    nt = spec.sent_non_tensor_bytes
    copied = first if total > first else 0
    work = {
        "leader": LocalWork(packed_bytes=total),
        "receiver": LocalWork(pickled_bytes=nt, copied_bytes=copied if receiver_copies else 0),
    }
    if forwarder:
        work["forwarder"] = LocalWork(pickled_bytes=nt, copied_bytes=copied)
    return work
