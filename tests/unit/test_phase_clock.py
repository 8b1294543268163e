"""Tier 1: the leader's phase clock (``strategies.core.phase_clock``) keeps its own reads out of
the phases it splits a call into."""

from __future__ import annotations

import itertools

import strategies.core.phase_clock as pc


def fake_clocks(monkeypatch, step: int) -> list[int]:
    """Both clocks advance ``step`` ns per read, plus what the returned list's first value (the
    work done since) adds; its second counts the reads."""
    work = [0, 0]
    counters = {name: itertools.count(0, step) for name in ("wall", "cpu")}

    def reader(name):
        def read():
            work[1] += 1
            return next(counters[name]) + work[0]

        return read

    monkeypatch.setattr(pc.time, "perf_counter_ns", reader("wall"))
    monkeypatch.setattr(pc.time, "thread_time_ns", reader("cpu"))
    return work


def test_the_clocks_own_reads_go_to_clock_and_each_phase_keeps_its_work(monkeypatch):
    """A call of plan (1000 ns of work), copy (300), signal (2000), copy (50) and plan again
    (40): each phase holds exactly the work done in it, ``clock`` the calibrated cost of the
    five switches, and together they are the call's whole time."""
    work = fake_clocks(monkeypatch, step=700)
    clock = pc.PhaseClock()
    assert clock.calibrate() == (700, 700)
    clock.begin()
    for ns, then in ((1000, "copy"), (300, "signal"), (2000, "copy"), (50, "plan")):
        work[0] += ns
        clock.switch(then)
    work[0] += 40
    got = clock.end()
    cpu = {p: round(v[1] * 1e9) for p, v in got.items()}
    assert cpu == {"plan": 1040, "encode": 0, "copy": 350, "signal": 2000, "clock": 5 * 700}, cpu
    assert got["plan"][0] == got["plan"][1]


def test_a_span_shorter_than_the_calibrated_cost_is_never_negative(monkeypatch):
    """The calibration is the cheapest round's: a span faster than it leaves its phase at 0
    and gives ``clock`` only what the span took."""
    fake_clocks(monkeypatch, step=700)
    clock = pc.PhaseClock()
    clock.own_ns = (900, 900)
    clock.begin()
    clock.switch("copy")
    got = clock.end()
    assert got["plan"] == (0.0, 0.0) and got["copy"] == (0.0, 0.0)
    assert round(got["clock"][1] * 1e9) == 1400


def test_an_untimed_switch_reads_no_clock(monkeypatch):
    work = fake_clocks(monkeypatch, step=1)
    clock = pc.PhaseClock()
    assert clock.switch("copy") is None and clock.end() is None and work[1] == 0
