"""Where a leader's call spends its time (``CLOCK``): the leader's own Python (``plan``: the
checks, the plan lookup, the header, the bookkeeping), pickling the non-tensor batch
(``encode``: its cost grows with the batch's rows, and a floor, prepared untimed, has none of
it), copying the bytes (``copy``: the leaves
and the non-tensor blob into the message) and handing them over (``signal``: a shared-memory
signal, a send, a collective and its wait).

The strategies mark where copying and handing over happen (``switch``); everything else inside
the call is the plan. A harness turns the clock on around a call it times (``begin`` /
``end``); off, a switch costs one attribute test. One clock per process: a rank runs one call
at a time (``strategies.core.trace.WORK`` counts bytes the same way). The CPU is the calling
thread's: a collective library's own threads (gloo moves bytes on threads of its own) are not
in it.
"""

from __future__ import annotations

import time

PHASES = ("plan", "encode", "copy", "signal")


class PhaseClock:
    """Wall and thread-CPU nanoseconds per phase of the call being timed."""

    def __init__(self) -> None:
        self.current: str | None = None
        """The phase running now; None outside a timed call (every switch is then a no-op)."""
        self.wall_ns = dict.fromkeys(PHASES, 0)
        self.cpu_ns = dict.fromkeys(PHASES, 0)
        self._wall = self._cpu = 0

    def begin(self) -> None:
        """A timed call starts, in its plan."""
        for phase in PHASES:
            self.wall_ns[phase] = self.cpu_ns[phase] = 0
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
        self._wall, self._cpu = wall, cpu
        self.current = phase
        return before

    def end(self) -> dict[str, tuple[float, float]] | None:
        """The timed call is over: (wall seconds, CPU seconds) per phase; None when no call was
        being timed."""
        if self.switch(None) is None:
            return None
        return {p: (self.wall_ns[p] / 1e9, self.cpu_ns[p] / 1e9) for p in PHASES}


CLOCK = PhaseClock()
