"""What a call costs in CPU, and where the leader's call spends its time: the replica's CPU per
call and the leader's alone (every strategy), and the leader's wall and thread-CPU time per
phase of a call, plan, encode, copy and signal, and the clock's own reads (the strategies
that mark their phases on ``strategies.core.phase_clock.CLOCK``: the header family and shm).
Medians over the timed calls; None where nothing was measured (a dispatch job's driver clock, an unmarked strategy).
"""

from __future__ import annotations

import numpy as np

from strategies.core.phase_clock import PHASES

PHASE_FIELDS = tuple(f"leader_{p}_us" for p in PHASES) + tuple(f"leader_{p}_cpu_us" for p in PHASES)
"""The record's per-phase fields: wall microseconds per phase, then thread-CPU microseconds."""


def cpu_figures(name: str, results: list) -> dict[str, float | None]:
    """CPU per call: the replica's (every rank's CPU seconds in the call, summed, median over
    calls) and the leader's alone; None where no rank measured it (a driver's clock)."""
    cpu = [r.cpu_s.get(name) if r.cpu_s else None for r in results]
    if any(c is None or None in c for c in cpu):
        return {"cpu_us_per_call": None, "cpu_us_leader": None}
    leader = next(i for i, r in enumerate(results) if r.is_leader)
    per_call = np.array(cpu, dtype=float)  # ranks × rounds
    return {
        "cpu_us_per_call": float(np.median(per_call.sum(axis=0))) * 1e6,
        "cpu_us_leader": float(np.median(per_call[leader])) * 1e6,
    }


def phase_figures(name: str, results: list) -> dict[str, float | None]:
    """The leader's median wall and thread-CPU microseconds per phase of ``name``'s calls."""
    leader = next((r for r in results if r.is_leader), None)
    calls = (leader.phases_s or {}).get(name) if leader is not None else None
    if not calls or any(c is None for c in calls):
        return dict.fromkeys(PHASE_FIELDS)
    out: dict[str, float | None] = {}
    for which, label in ((0, "us"), (1, "cpu_us")):
        for phase in PHASES:
            out[f"leader_{phase}_{label}"] = (
                float(np.median([c[phase][which] for c in calls])) * 1e6
            )
    return out
