"""Whether a job fits this host's memory, decided on the driver before any rank generates a
batch: every strategy the job builds (the floor's methods share one packed buffer) priced by
``harness.model.memory`` for the layout's ranks on this one host, against what the host has
available now. A job that would not fit is refused in one line and recorded as refused."""

from __future__ import annotations

from dataclasses import replace

import strategies
from harness.job.broadcast import job_order
from harness.job.config_schema import layout_name
from harness.job.label import Label
from harness.job.spec import JobSpec, Scope
from harness.machine import mem_available
from harness.model import memory
from strategies.core.footprint import Footprint
from strategies.registry import resolve_target


def footprints(spec: JobSpec) -> dict[str, Footprint]:
    """Each strategy the job builds (``broadcast.job_order``: the floor as each of its raw
    methods), by the name the job times it under, with its footprint; the floor's methods keep
    one packed buffer between them (``broadcast.prepare_all``), so the first keeps it only."""
    out: dict[str, Footprint] = {}
    order, options = job_order(spec)
    for name in order:
        label = Label.parse(name)
        if "." in name:
            cls = resolve_target(name)
        elif label.strategy in strategies.names(include_floor=True):
            cls = strategies.get_class(label.strategy)
        else:
            continue  # a calibration probe: no batch of its own
        footprint = cls.footprint_for(**options[name])
        if label.is_floor and any(Label.parse(n).is_floor for n in out):
            footprint = replace(footprint, leader_kept=0)
        out[name] = footprint
    return out


def fitted(spec: JobSpec, on_this_host: bool, available: int | None = None) -> JobSpec | str:
    """The job as it fits this host's memory: unchanged where it fits or cannot be priced here
    (a recorded payload, a dispatch job, ranks on other hosts); else with the references that
    would not fit beside the others left out, each with its one line (``left_out``), the
    smallest kept first; or, where the strategy under test and the floor alone do not fit,
    the one line that refuses the job."""
    payload_bytes = spec.largest_generated_bytes()
    if not on_this_host or spec.scope is not Scope.BROADCAST or payload_bytes is None:
        return spec
    node = memory.busiest_node(spec.layout)
    room = mem_available() if available is None else available
    every = footprints(spec)
    what = f"job {spec.strategy} on {layout_name(spec.layout)}"
    if memory.refusal(what, every, node, payload_bytes, room) is None:
        return spec
    core = {n: fp for n, fp in every.items() if n == spec.strategy or Label.parse(n).is_floor}
    too_big = memory.refusal(what, core, node, payload_bytes, room)
    if too_big is not None:
        return too_big
    others = sorted(
        (n for n in every if n not in core),
        key=lambda n: memory.strategy_need(every[n], node, payload_bytes),
    )
    left_out = []
    for name in others:
        line = memory.refusal(f"{what} with {name}", {**core, name: every[name]}, node,
                              payload_bytes, room)  # fmt: skip
        if line is None:
            core[name] = every[name]
        else:
            left_out.append((name, line))
    dropped = {name for name, _ in left_out}
    kept = tuple(n for n in spec.references if n not in dropped)  # unpriced ones stay too
    return replace(spec, references=kept, left_out=spec.left_out + tuple(left_out))
