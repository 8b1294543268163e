"""Every rank's ``RankResult`` (a dispatch job: its driver's one) folded into one
``JobSummary``: every phase checks the job first (a wrong byte fails it), then folds its part of
each strategy's figures; a call costs its slowest rank. A varying workload adds its figures per
distinct shape (``per_shape``), and every job its honest floor (``best_floor``)."""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from harness.job.label import Label
from harness.job.phases import PHASES
from harness.job.results import (
    FloorFigures,
    JobSummary,
    RankResult,
    Refusal,
    ShapeFigures,
    ShapeStrategyFigures,
    StrategyFigures,
)
from harness.job.rounds import p50_us
from harness.job.spec import JobSpec

NODE_FLOORS = frozenset({"floor:shm"})
"""Floor methods that move no byte through the collective library (node-local shared memory):
the network floor (``floor_network_p50_us``) is the fastest of the others."""

PARTS = frozenset(f.name for f in fields(StrategyFigures))


def summarize(spec: JobSpec, results: list[RankResult]) -> JobSummary | Refusal:
    """The job's summary from every rank's result (rank order), or its ``Refusal`` when the
    strategy under test refused (raised on every rank before any collective)."""
    refused = [r.unsupported for r in results if r.unsupported]
    if refused:
        return Refusal(refused[0])
    ran = [phase for phase in PHASES if spec.scope in phase.scopes]
    for phase in ran:
        phase.check(spec, results)
    figures = {name: _figures(spec, name, results, ran) for name in results[0].times_s}
    leaders = [r for r in results if r.is_leader]
    shapes = None
    payload_bytes = leaders[0].payload_bytes
    if spec.workload is not None and spec.workload.varying:
        shapes = per_shape(spec, results)
        payload_bytes = _sequence_bytes(spec, shapes)
    return JobSummary(
        payload_bytes=payload_bytes,
        device=results[0].device,
        strategies=figures,
        floor=best_floor({n: f.p50_us for n, f in figures.items()}, spec.floors(figures)),
        refused=results[0].refused or None,
        shapes=shapes,
        calls_s={
            name: np.array([r.times_s[name] for r in results]).max(axis=0).tolist()
            for name in figures
        },
        blocks=spec.block_of_round(),
    )


def _figures(spec: JobSpec, name: str, results: list[RankResult], ran) -> StrategyFigures:
    """Strategy ``name``'s figures: the part each phase that ran folds (None: not measured)."""
    parts = {}
    for phase in ran:
        if phase.part is not None:
            assert phase.part in PARTS, (
                f"{type(phase).__name__}.part: no such StrategyFigures field"
            )
            parts[phase.part] = phase.fold(spec, name, results)
    return StrategyFigures(**parts)


def _call_shapes(spec: JobSpec) -> list[int]:
    """Per timed iteration, the index (in ``distinct_shapes``) of the shape it moved."""
    index = {shape: k for k, shape in enumerate(spec.distinct_shapes())}
    return [index[spec.shape_of_call(spec.warmup + it)] for it in range(spec.timed_rounds)]


def per_shape(spec: JobSpec, results: list[RankResult]) -> list[ShapeFigures]:
    """A varying workload's figures per distinct shape: the timed calls of the sequence that
    moved it (max over ranks per call, as for the whole job), every strategy's p50 and its
    floor, and each strategy's steady-state p50 where steady rounds ran."""
    which = np.array(_call_shapes(spec))
    leaders = [r for r in results if r.is_leader]
    out = []
    for k, shape in enumerate(spec.distinct_shapes()):
        mine = which == k
        figures = {}
        for name in results[0].times_s:
            per_iter = np.array([r.times_s[name] for r in results]).max(axis=0)
            steady = None
            if results[0].steady_s is not None:
                steady = p50_us(np.array([r.steady_s[name][k] for r in results]).max(axis=0))
            figures[name] = ShapeStrategyFigures(
                p50_us(per_iter[mine]) if mine.any() else None, steady
            )
        timed = {n: f.p50_us for n, f in figures.items() if f.p50_us is not None}
        out.append(
            ShapeFigures(
                shape=shape,
                calls=int(mine.sum()),
                # The largest replica's: with uneven replicas it is the one a call waits for.
                payload_bytes=max(r.shape_bytes[k] for r in leaders),
                strategies=figures,
                floor=best_floor(timed, spec.floors(timed)),
            )
        )
    return out


def _sequence_bytes(spec: JobSpec, shapes: list[ShapeFigures]) -> int:
    """Bytes per call over the timed sequence (mean of each call's largest replica)."""
    calls = _call_shapes(spec)
    return int(round(sum(shapes[k].payload_bytes for k in calls) / len(calls)))


def floor_in_rounds(spec: JobSpec, summary: JobSummary, name: str) -> FloorFigures | None:
    """The job's floor over the rounds ``name`` took part in: under a time budget a slow
    strategy sits out the last rounds (``harness.job.rounds.interleaved``), which run lighter
    (fewer large neighbours) than the ones it shared; its ratio to the floor compares it with
    the floor's calls in the same rounds, as the ratio's interval does. The job's floor
    (``summary.floor``) where every floor method took no more rounds than ``name``."""
    calls = summary.calls_s
    rounds = len(calls.get(name, ()))
    names = spec.floors(summary.strategies)
    if summary.floor is None or not rounds or all(len(calls[n]) <= rounds for n in names):
        return summary.floor
    return best_floor({n: p50_us(calls[n][:rounds]) for n in names}, names)


def best_floor(p50s: dict[str, float], names: list[str]) -> FloorFigures | None:
    """The honest floor: the fastest of the floors ``names`` timed in the job (a broadcast
    job's raw method, one | chunks2 | ... | shm; a dispatch job's floor mode), beside the single
    broadcast and the fastest method through the collective library; None when none was
    timed."""
    floors = {n: p50s[n] for n in names}
    if not floors:
        return None
    method = min(floors, key=floors.get)
    label = Label.parse(method)
    network = {n: p50 for n, p50 in floors.items() if n not in NODE_FLOORS}
    network_name = min(network, key=network.get) if network else None
    return FloorFigures(
        p50_us=floors[method],
        # A broadcast job's floor is named by its raw method; a dispatch job's by its mode.
        method=(label.method or "one") if label.is_floor else method,
        name=method,
        single_p50_us=floors.get("floor"),
        network_p50_us=network[network_name] if network else None,
        network_name=network_name,
    )
