"""``header``: the seed's two hops (TP×CP on stage 0, then PP), tensors only, no pickle of
tensor data.

The leader packs a compact binary header (keys, dtypes, shapes, offsets) and every tensor of
every dtype into one flat buffer (``strategies.core.codec``). Each hop moves it with a ``Wire``:
receivers post a first broadcast of the size the previous call announced, so in steady state a
hop is ONE broadcast (two when the batch outgrows the announced size, e.g. the first call).
Stage-0 ranks forward the received buffer unchanged on the PP hop; receivers get zero-copy
views. Non-tensor data travels (pickled, inside the same buffer) only when flagged.
Options: see ``strategies.core.packed.PackedStrategy``.
"""

from __future__ import annotations

from strategies.core.contract import DataProto
from strategies.core.packed import PackedStrategy
from strategies.core.plan import Comm, LocalWork, PayloadSpec, Plan


class HeaderStrategy(PackedStrategy):
    name = "header"
    claims = "1 broadcast per hop in steady state (2 when the batch outgrows the announced size)"

    def transfer(self, batch: DataProto) -> DataProto:
        g = self.groups
        return self.relay(batch, [(hop.group, hop.ranks) for hop in g.seed_hops()])

    @classmethod
    def plan(cls, layout, spec: PayloadSpec, expect: int | None = None) -> Plan:
        """Steady state by default (first message = this batch's size); pass ``expect`` to
        plan a call that follows a different announced size."""
        total = spec.message_bytes
        first = expect if expect is not None else _steady_expect(total)
        comms, _ = hop_comms(layout.seed_hop_groups(), total, first)
        work = relay_work(spec, total, first, receiver_copies=False, forwarder=True)
        return Plan(cls.name, comms, **work)


def _steady_expect(total: int) -> int:
    from strategies.core.wire import Wire

    return Wire(None, 0).next_expect(total)


def _wire_comms(comms: list[Comm], groups, total: int, first: int, step: int) -> int:
    from strategies.core.wire import segments

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
    nt = spec.non_tensor_bytes if spec.broadcast_non_tensor else 0
    copied = first if total > first else 0
    work = {
        "leader": LocalWork(packed_bytes=total),
        "receiver": LocalWork(pickled_bytes=nt, copied_bytes=copied if receiver_copies else 0),
    }
    if forwarder:
        work["forwarder"] = LocalWork(pickled_bytes=nt, copied_bytes=copied)
    return work


STRATEGY = HeaderStrategy
