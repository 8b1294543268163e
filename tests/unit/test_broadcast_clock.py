"""Tier 1: where a timed call's clock stops. A call ends when the rank holds its batch; the
batch the call returned, and the floor's received bytes, are let go after the clock reads
its second time, so no strategy pays for tearing down its own output.
"""

from __future__ import annotations

import types
import weakref

import pytest
import torch

import strategies
from harness.job import broadcast
from strategies.floor import Floor


class _Returns:
    """A strategy whose returned batch logs its death."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def get_data_input(self, entry):
        out = strategies.DataProto(None, {}, {})
        weakref.finalize(out, self.log.append, "batch dropped")
        return out


def _prepared(built: dict) -> broadcast.BroadcastJob:
    groups = types.SimpleNamespace(is_leader=False, device=torch.device("cpu"))
    full = strategies.DataProto(None, {}, {})
    return broadcast.BroadcastJob(groups=groups, full=full, order=list(built), built=built)


def _clock(monkeypatch, log: list[str]) -> None:
    ticks = iter(range(100))
    monkeypatch.setattr(broadcast, "start_line", lambda groups: None)

    def perf_counter() -> float:
        log.append("clock")
        return float(next(ticks))

    monkeypatch.setattr(broadcast.time, "perf_counter", perf_counter)


def test_the_returned_batch_is_dropped_after_the_clock_stops(monkeypatch):
    log: list[str] = []
    prepared = _prepared({"s": _Returns(log)})
    _clock(monkeypatch, log)
    assert prepared.timed("s").wall_s == 1.0
    assert log == ["clock", "clock", "batch dropped"]


def test_the_floors_received_bytes_are_let_go_after_the_clock_stops(monkeypatch):
    log: list[str] = []
    floor = Floor.__new__(Floor)  # no world: its transfer is replaced here
    floor.groups, floor.received = None, None

    def transfer(batch):
        floor.received = received = torch.zeros(4)
        weakref.finalize(received, log.append, "bytes dropped")
        return batch

    floor.transfer = transfer
    prepared = _prepared({"floor": floor})
    _clock(monkeypatch, log)
    prepared.timed("floor")
    assert log == ["clock", "clock", "bytes dropped"]
    assert floor.received is None


@pytest.mark.parametrize(
    "world, replica, barriers",
    [
        (2, (0, 1), ["replica"]),  # DP = 1: the replica's barrier alone
        (8, (0, 2, 4, 6), ["world", "replica"]),  # DP = 2: replicas start together first
        (1, (0,), []),  # one rank: nothing to wait for
        (4, (2,), ["world"]),  # replicas of one rank still start together
    ],
)
def test_a_timed_call_starts_from_the_barriers_its_layout_needs(
    monkeypatch, world, replica, barriers
):
    """``start_line``: a barrier over the world only where there are several replicas to start
    together, then one over the replica's own group where it has several ranks."""
    from harness.job import phases

    seen: list[str] = []
    monkeypatch.setattr(phases.dist, "get_world_size", lambda: world)
    monkeypatch.setattr(
        phases.dist, "barrier", lambda group=None: seen.append("world" if group is None else group)
    )
    phases.start_line(types.SimpleNamespace(replica_ranks=replica, cpu_replica_group="replica"))
    assert seen == barriers
