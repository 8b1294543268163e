"""The one way a job runs: ``run_job(world, spec) -> Record``. ``bcastbench run`` (and so
``bench``), ``bcastbench ray-dispatch``, ``calibrate`` and the pytest plugin all call it; it runs
the job's phases where its scope puts them (a broadcast job on every rank, a dispatch job on
the Ray driver), summarizes them (``harness.job.summary``), builds the record
(``harness.job.records``) and, given a directory, writes it there atomically.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.job import records
from harness.job.broadcast import run_job_on_rank
from harness.job.config_schema import layout_name
from harness.job.dispatch import run_dispatch
from harness.job.label import Label
from harness.job.record_fields import Record
from harness.job.results import JobSummary, Refusal
from harness.job.samples import write_samples
from harness.job.spec import JobSpec, Scope
from harness.job.summary import summarize
from harness.machine import host_before_job
from harness.worlds.launcher import WorldSpec
from harness.worlds.opening import open_world
from harness.worlds.protocol import World

RESULT_FILE = "result.json"
"""The record's name in a job's directory."""


def run_job(
    world: World | WorldSpec,
    spec: JobSpec,
    out_dir: Path | None = None,
    record_failures: tuple[type[BaseException], ...] = (),
    extra: dict[str, Any] | None = None,
) -> Record | None:
    """Run ``spec`` on ``world`` (a running world, or the spec of one: the live one is reused
    or one is started, ``harness.worlds.opening.open_world``); its record (None on a joined
    world's ranks other than 0).

    A refusal is a record (``status: unsupported``). A job that failed (its world did not
    start, a rank crashed, hung or ended with wrong data) raises, unless its error is one of
    ``record_failures`` (a sweep's job: ``JOB_FAILURES``): then it is a ``failed`` record. With
    ``out_dir`` the record is also written there (``result.json``, atomically). ``extra``:
    fields the record takes as they are (what a wrapping command knows and the job does not)."""
    host = host_before_job()
    others: dict[str, Record] = {}
    try:
        if isinstance(world, WorldSpec):
            world = open_world(world)
        start_s, world.start_s = world.start_s, 0.0  # paid once: later jobs started nothing
        results = _measure(world, spec)
        if results is None:
            return None
        summary = summarize(spec, results)
        fields = world.record_fields()
        # An emulated cluster's nodes are namespaces of this one host: every rank shares its cores.
        here = (tuple(range(world.world_size)),) if "emulate_nodes" in fields else world.nodes
        common = {**fields, **host.fields(here), **_samples(out_dir, spec, results)}
        env = records.environment()
        record = {**records.build(spec, summary, start_s, env), **common, **(extra or {})}
        if spec.record_each and not isinstance(summary, Refusal):
            others = _each_strategy(spec, summary, start_s, {**common, **(extra or {})}, env)
    except record_failures as exc:
        record = {**records.failed(spec, exc), **(extra or {})}
    record = records.complete(record)
    if out_dir is not None:
        records.write_atomic(Path(out_dir) / RESULT_FILE, record)
        for name, other in others.items():
            records.write_atomic(Path(out_dir) / name / RESULT_FILE, other)
    return record


def _each_strategy(
    spec: JobSpec, summary: JobSummary, start_s: float, common: dict, env: dict
) -> dict:
    """``record_each``: a record for every other strategy the job timed (floor methods
    aside), each about that strategy with the others as its references, and one saying why
    for every reference that refused; their samples are the job's (one directory up)."""
    out = {}
    if common.get("samples_file"):
        common = {**common, "samples_file": f"../{common['samples_file']}"}
    for name in summary.strategies:
        if name != spec.strategy and not Label.parse(name).is_floor:
            as_tested = replace(spec, strategy=name, options={})
            out[name] = records.complete({**records.build(as_tested, summary, start_s, env),
                                          **common})  # fmt: skip
    for name, why in (summary.refused or {}).items():
        refusal = Refusal(f"{name}: {why}")
        out[name] = records.complete({**records.build(replace(spec, strategy=name, options={}),
                                                      refusal, start_s, env), **common})  # fmt: skip
    return out


def _samples(out_dir: Path | None, spec: JobSpec, results) -> dict:
    """Every timed call beside the record (``harness.job.samples``), when there is a place."""
    if out_dir is None or results[0].unsupported:
        return {}
    path = write_samples(Path(out_dir), results, spec.block_of_round())
    return {"samples_file": path.name}


def _measure(world: World, spec: JobSpec):
    """Every rank's result of a broadcast job, or the driver's one of a dispatch job."""
    if spec.scope is Scope.DISPATCH:
        return [run_dispatch(world, spec)]
    what = f"job {spec.strategy} on {layout_name(spec.layout)}"
    return world.run(run_job_on_rank, spec, what=what, timeout_s=spec.timeout_s)
