"""Where a leader's call spends its time (``CLOCK``): the leader's own Python (``plan``: the
checks, the plan lookup, the header, the bookkeeping), pickling the non-tensor batch
(``encode``: its cost grows with the batch's rows, and a floor, prepared untimed, has none of
it), copying the bytes (``copy``: the leaves
and the non-tensor blob into the message) and handing them over (``signal``: a shared-memory
signal, a send, a collective and its wait), and the clock's own reads (``clock``).

The strategies mark where copying and handing over happen (``switch``); everything else inside
the call is the plan. A harness turns the clock on around a call it times (``begin`` /
``end``); off, a switch costs one attribute test. One clock per process: a rank runs one call
at a time (``strategies.core.trace.WORK`` counts bytes the same way). The CPU is the calling
thread's: a collective library's own threads (gloo moves bytes on threads of its own) are not
in it.

Reading a thread's CPU time is a system call, so every switch costs the call being timed some
CPU of its own, which an untimed call does not pay (a shm call switches about ten times). The
clock measures that cost once per process (``calibrate``: switches back to back, nothing between
them) and charges it to ``clock`` instead of the phase it fell in, so each phase holds the
strategy's own time.
"""

from __future__ import annotations

import time

PHASES = ("plan", "encode", "copy", "signal", "clock")
CALIBRATION_ROUNDS = 8
"""Rounds of ``CALIBRATION_SWITCHES`` back-to-back switches; the cheapest round's mean is a
switch's own cost (a round the scheduler interrupted costs more, never less)."""
CALIBRATION_SWITCHES = 32


class PhaseClock:
    """Wall and thread-CPU nanoseconds per phase of the call being timed."""

    def __init__(self) -> None:
        self.current: str | None = None
        """The phase running now; None outside a timed call (every switch is then a no-op)."""
        self.wall_ns = dict.fromkeys(PHASES, 0)
        self.cpu_ns = dict.fromkeys(PHASES, 0)
        self.switches = dict.fromkeys(PHASES, 0)
        """Switches that ended a span of each phase in the call being timed."""
        self._wall = self._cpu = 0
        self.own_ns: tuple[int, int] | None = None
        """(wall, thread CPU) nanoseconds of one switch's own work, between its reads and the
        next switch's (``calibrate``); None until the first ``begin``."""

    def calibrated(self) -> tuple[int, int]:
        """``own_ns``, measured first if it never was (outside any timed call: a harness calls
        this before it starts its own clock; ``begin`` does otherwise)."""
        return self.own_ns if self.own_ns is not None else self.calibrate()

    def calibrate(self) -> tuple[int, int]:
        """Measure ``own_ns``."""
        best: tuple[int, int] | None = None
        for _ in range(CALIBRATION_ROUNDS):
            self._start()
            for _ in range(CALIBRATION_SWITCHES):
                self.switch("plan")
            self.current = None
            rnd = (  # the spans' whole time: nothing but switches ran in them
                self.wall_ns["plan"] // CALIBRATION_SWITCHES,
                self.cpu_ns["plan"] // CALIBRATION_SWITCHES,
            )
            best = rnd if best is None else (min(best[0], rnd[0]), min(best[1], rnd[1]))
        self.own_ns = best
        return best

    def begin(self) -> None:
        """A timed call starts, in its plan (``calibrated`` first)."""
        self.calibrated()
        self._start()

    def _start(self) -> None:
        for phase in PHASES:
            self.wall_ns[phase] = self.cpu_ns[phase] = self.switches[phase] = 0
        self.current = "plan"
        self._wall, self._cpu = time.perf_counter_ns(), time.thread_time_ns()

    def switch(self, phase: str | None) -> str | None:
        """The time since the last switch to the phase that ran it, ``phase`` from now on;
        returns the phase it replaced, to switch back to. Outside a timed call: nothing."""
        before = self.current
        if before is None:
            return None
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        self.wall_ns[before] += wall - self._wall
        self.cpu_ns[before] += cpu - self._cpu
        self.switches[before] += 1
        self._wall, self._cpu = wall, cpu
        self.current = phase
        return before

    def end(self) -> dict[str, tuple[float, float]] | None:
        """The timed call is over: (wall seconds, CPU seconds) per phase, each phase less the
        clock's own cost of the switches that ended its spans (``own_ns``), which ``clock``
        holds; None when no call was being timed."""
        if self.switch(None) is None:
            return None
        own_wall, own_cpu = self.own_ns
        for phase, n in self.switches.items():
            if n:
                ow, oc = (
                    min(n * own_wall, self.wall_ns[phase]),
                    min(n * own_cpu, self.cpu_ns[phase]),
                )
                self.wall_ns[phase] -= ow
                self.cpu_ns[phase] -= oc
                self.wall_ns["clock"] += ow
                self.cpu_ns["clock"] += oc
        return {p: (self.wall_ns[p] / 1e9, self.cpu_ns[p] / 1e9) for p in PHASES}


CLOCK = PhaseClock()
