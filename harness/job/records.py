"""The result record of one job, built: one shape for every job (ok, unsupported or failed;
broadcast or dispatch; forked, joined, Ray or emulated), its fields declared in
``harness.job.record_fields``; written atomically, and said in one line (``job_line``).
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import torch

from harness import files, paths
from harness.job.config_schema import COMMAND, layout_name
from harness.job.dispatch_modes import FLOORS, DispatchMode
from harness.job.interval import Interval, interval_fields, interval_of
from harness.job.label import Label
from harness.job.phases import PHASES
from harness.job.record_fields import Record, complete
from harness.job.results import (
    FloorFigures,
    JobSummary,
    Refusal,
    ShapeFigures,
    ShapeStrategyFigures,
    StrategyFigures,
)
from harness.job.spec import Scope
from harness.job.stats import excludes_one, ratio_interval
from harness.job.summary import floor_in_rounds
from harness.job.verdict import WINNER, job_verdict, served
from harness.units import human_bytes

REPO = paths.REPO


def vs_floor(p50_us: float | None, floor_p50_us: float | None) -> float | None:
    """The ratio every record, table and gate calls ``vs_floor``: a p50 over the floor's p50
    measured in the same job (lower is better; 1 is the floor). None without a floor."""
    return _ratio(p50_us, floor_p50_us)


def _ratio(p50_us: float | None, other_p50_us: float | None) -> float | None:
    return None if p50_us is None or not other_p50_us else p50_us / other_p50_us


@functools.cache  # a process runs with the packages it started with
def _version(dist_name: str) -> str:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "absent"


def git_rev() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        rev = out.stdout.strip() or "unknown"
        return rev + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict:
    return {
        "torch_version": torch.__version__,
        "megatron_core_version": _version("megatron-core"),
        "tensordict_version": _version("tensordict"),
        "hostname": socket.gethostname(),
        # The report's caveat reads the machine from the records, not from where it runs.
        "cpu_count": os.cpu_count(),
        "git_rev": git_rev(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(COMMAND or [Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def _payload_label(spec) -> str:
    """The payload's name; a recorded one (file, schema) adds its file's stem, so two
    recordings in one sweep stay apart in tables and reports (``schema:rl_rollout``)."""
    if not spec.payload_path:
        return spec.payload
    return f"{spec.payload}:{Path(spec.payload_path).stem}"


def _job_fields(spec) -> dict:
    """What the job was: the same fields whether it ran, was refused or failed."""
    layout = spec.layout
    dispatch = getattr(spec, "dispatch", "none")
    broadcast = dispatch == "none"
    return {
        # Only a leader dispatch runs a broadcast strategy; the other modes carry no name.
        "strategy": spec.strategy if broadcast or dispatch == "leader" else None,
        "options": dict(spec.options),
        "scope": (Scope.BROADCAST if broadcast else Scope.DISPATCH).value,
        **({} if broadcast else {"dispatch": dispatch, "mode": spec.under_test}),
        "world": getattr(spec, "world", "forked"),
        "backend": spec.backend,
        "device": spec.device,
        "world_size": layout.world_size,
        "layout": layout_name(layout),
        **{axis: getattr(layout, axis) for axis in ("dp", "pp", "tp", "cp")},
        "order": "-".join(layout.tokens),
        "payload": _payload_label(spec),
        **({"payload_path": spec.payload_path} if spec.payload_path else {}),
        "batch_size": spec.batch_size,
        "seq_len": spec.seq_len,
        **_workload_fields(spec),
        "iters": spec.iters,
        "repeats": spec.repeats,
        "warmup": spec.warmup,
    }


def _workload_fields(spec) -> dict:
    """A varying workload's name and split, and the largest rows and sequence it moves (the
    job's own figures otherwise: a constant workload's record keeps its shape)."""
    workload = getattr(spec, "workload", None)
    if workload is None or not workload.varying:
        return {}
    shapes = spec.period()
    lengths = [s.seq_len for s in shapes if s.seq_len is not None]
    return {
        "batch_size": max(s.batch_size for s in shapes),
        "seq_len": max(lengths) if lengths else spec.seq_len,
        "workload": workload.label,
        "dp_split": workload.dp_split,
    }


def build(
    spec, summary: JobSummary | Refusal, world_start_s: float = 0.0, env: dict | None = None
) -> Record:
    """One flat record for every job kind: what the job was (from its JobSpec), then what was
    measured for the strategy (or dispatch mode) under test with its references beside it, or
    why it was refused. ``env``: the job's ``environment()``, where its caller builds several
    records of one job (read once: it asks git twice)."""
    if isinstance(summary, Refusal):
        measured = {
            "status": "unsupported",
            "supported": False,
            "error": summary.why,
            "correct": None,
        }
    else:
        measured = {"status": "ok", **_measured(spec, summary), "world_start_s": world_start_s}
    return {**_job_fields(spec), **measured, **(environment() if env is None else env)}


def failed(spec, error: BaseException) -> Record:
    """The record of a job that failed (a rank crashed, hung or ended with wrong data): its
    first line as ``error`` (one table cell), the whole message as ``error_detail``."""
    text = str(error).strip() or type(error).__name__
    return {
        **_job_fields(spec),
        "status": "failed",
        "supported": None,
        "correct": None,
        "error": text.splitlines()[0],
        "error_detail": text,
        **environment(),
    }


def _floor_fields(floor: FloorFigures | None) -> dict:
    """The job's floor as the record names it (all null when no floor was timed)."""
    return {
        "floor_p50_us": floor.p50_us if floor else None,
        "floor_method": floor.method if floor else None,
        "floor_single_p50_us": floor.single_p50_us if floor else None,
        "floor_network_p50_us": floor.network_p50_us if floor else None,
    }


def _measured(spec, summary: JobSummary) -> dict:
    """The strategy under test's measured fields: every phase's own (``record_fields``), then
    what is derived from them beside its floor and pickled, timed in the same rounds."""
    figures = summary.strategies[spec.under_test]
    mine = figures.flat()
    floor = floor_in_rounds(spec, summary, spec.under_test)
    floors = _floor_fields(floor)
    base = summary.strategies.get(spec.baseline)
    payload_bytes = summary.payload_bytes
    p50_s = mine["p50_us"] / 1e6
    algbw = payload_bytes / p50_s / 1e9 if p50_s > 0 else 0.0
    return {
        "payload_bytes": payload_bytes,
        **{k: mine.get(k) for phase in PHASES for k in phase.record_fields},
        "algbw_gbps": algbw,
        "busbw_gbps": algbw,  # broadcast: F = 1, all data must leave the root (nccl-tests)
        **floors,
        "baseline_p50_us": base.p50_us if base else None,
        "vs_floor": vs_floor(mine["p50_us"], floors["floor_p50_us"]),
        "vs_floor_single": vs_floor(mine["p50_us"], floors["floor_single_p50_us"]),
        "vs_floor_network": vs_floor(mine["p50_us"], floors["floor_network_p50_us"]),
        "vs_baseline": mine["p50_us"] / base.p50_us if base else None,
        **_ratio_intervals(spec, summary, floor),
        **_work_fields(figures),
        **({"auto_choice": figures.choice.choice} if figures.choice else {}),
        **_auto_ties(spec, summary, figures),
        "correct": True,
        "supported": True,
        "references": {
            name: _reference(summary, name, spec.under_test)
            for name in summary.strategies
            if name != spec.under_test
        },
        **({"shapes": shape_entries(spec, summary.shapes)} if summary.shapes else {}),
        **(_modes(spec, summary) if spec.scope is Scope.DISPATCH else {}),
        **(
            {"unsupported": summary.refused}
            if summary.refused and spec.scope is Scope.BROADCAST
            else {}
        ),  # fmt: skip
    }


def _interval(summary: JobSummary, a: str, b: str | None, field: str) -> dict:
    """``field``'s interval (``harness.job.interval``): a's time over b's, paired round by round
    (``harness.job.stats.ratio_interval``); null where b was not timed or rounds are too few."""
    calls = summary.calls_s
    interval = None
    if b is not None and a in calls and b in calls:
        interval = Interval.of(ratio_interval(calls[a], calls[b], summary.blocks))
    return interval_fields(field, interval)


def _ratio_intervals(spec, summary: JobSummary, floor: FloorFigures | None) -> dict:
    """The same-job ratios' intervals of the strategy under test: to the floor (the method
    that was fastest in its rounds), to the network floor, and to the baseline."""
    mine = spec.under_test
    return {
        **_interval(summary, mine, floor.name if floor else None, "vs_floor"),
        **_interval(summary, mine, floor.network_name if floor else None, "vs_floor_network"),
        **_interval(summary, mine, spec.baseline, "vs_baseline"),
    }


def _reference(summary: JobSummary, name: str, mine: str) -> dict:
    """A strategy timed beside the one under test: its own figures, and its time over the
    strategy under test's (``vs_strategy``) with that ratio's interval."""
    figures = summary.strategies[name]
    out = {k: v for k, v in figures.flat().items() if not isinstance(v, dict)}
    out["vs_strategy"] = _ratio(figures.p50_us, summary.strategies[mine].p50_us)
    return {**out, **_interval(summary, name, mine, "vs_strategy")}


def _auto_ties(spec, summary: JobSummary, figures: StrategyFigures) -> dict:
    """``auto``'s choice against every other strategy the job timed: the ones it is tied with
    (their ratio's interval holds 1), so the record names a winner only when it is one."""
    choice = figures.choice.choice if figures.choice else None
    calls = summary.calls_s
    if choice is None or choice not in calls:
        return {}
    others = [n for n in calls
              if n not in (spec.under_test, choice) and Label.parse(n).competes]  # fmt: skip
    tied = [
        n for n in others
        if not excludes_one(ratio_interval(calls[n], calls[choice], summary.blocks))
    ]  # fmt: skip
    return {"auto_tied_with": tied}


def _work_fields(figures: StrategyFigures) -> dict:
    """The bytes a call packs, pickles and copies (where the collectives phase ran: on the
    ranks of a broadcast job)."""
    if figures.collectives is None:
        return {}
    work, received = figures.collectives.work_leader, figures.collectives.work_receiver_max
    return {
        "packed_bytes_leader": work.get("packed_bytes", 0),
        "pickled_bytes_leader": work.get("pickled_bytes", 0),
        "copied_bytes_leader": work.get("copied_bytes", 0),
        "pickled_bytes_receiver": received.get("unpickled_bytes", 0),
        "copied_bytes_receiver": received.get("copied_bytes", 0),
    }


def _modes(spec, summary: JobSummary) -> dict:
    """A dispatch job's ``modes`` (every mode timed, each beside its own family's floor and
    every floor of the job) and ``unsupported`` (the modes whose strategy refused)."""
    timed = summary.strategies
    floors = {f: timed[f].p50_us for f in FLOORS.values() if f in timed}
    rows = {}
    for name, figures in timed.items():
        mode = DispatchMode.parse(name)
        own = FLOORS[mode.kind]
        rows[name] = {
            "mode": name, "kind": mode.kind, "strategy": mode.strategy, "raw": mode.raw,
            "floor_mode": own,
            **{k: v for k, v in figures.flat().items() if not isinstance(v, dict)},
            "vs_floor": vs_floor(figures.p50_us, floors.get(own)),
            "vs_floors": {f: figures.p50_us / p50 for f, p50 in floors.items()},
        }  # fmt: skip
    return {"modes": rows, "unsupported": summary.refused or {}}


def shape_entries(spec, shapes: list[ShapeFigures]) -> list[dict]:
    """The record's ``shapes``: per distinct shape, the strategy under test beside that
    shape's floor and pickled, timed in the same rounds (and its steady state, when run)."""
    out = []
    for entry in shapes:
        shape, figures = entry.shape, entry.strategies
        mine, base = figures[spec.under_test], figures.get(spec.baseline)
        p50, steady = mine.p50_us, mine.steady_p50_us
        base_p50 = base.p50_us if base else None
        floor_p50 = entry.floor.p50_us if entry.floor else None
        out.append(
            {
                "batch_size": shape.batch_size,
                "seq_len": shape.seq_len,
                "dp_rows": list(shape.rows) if len(set(shape.rows)) > 1 else None,
                "draw": shape.draw,
                "calls": entry.calls,
                "payload_bytes": entry.payload_bytes,
                "p50_us": p50,
                "floor_p50_us": floor_p50,
                "floor_method": entry.floor.method if entry.floor else None,
                "vs_floor": vs_floor(p50, floor_p50),
                "baseline_p50_us": base_p50,
                "vs_baseline": _ratio(p50, base_p50),
                "steady_p50_us": steady,
                "vs_steady": _ratio(p50, steady),
                "references": {
                    n: _shape_reference(f) for n, f in figures.items() if n != spec.under_test
                },
            }
        )
    return out


def _shape_reference(figures: ShapeStrategyFigures) -> dict:
    """A reference's figures on one shape, as records have always named them (the steady
    p50 only where steady rounds ran)."""
    out = {"p50_us": figures.p50_us}
    if figures.steady_p50_us is not None:
        out["steady_p50_us"] = figures.steady_p50_us
    return out


def write_atomic(path: Path, record: dict) -> Path:
    """A record as JSON with every field (``complete``), never half-written, readable by others
    (``harness.files``)."""
    return files.write_json(path, complete(record))


def _range(rec: dict, field: str, scale: float = 1.0) -> str:
    """`` [lo-hi]``: the 95 % interval of the record's ``field`` (``harness.job.interval``), or
    nothing where the record has none."""
    interval = interval_of(rec, field)
    if interval is None:
        return ""
    lo, hi = interval.scaled(scale)
    return f" [{lo:.2f}-{hi:.2f}]"


def job_line(rec, others: Iterable[dict] = ()) -> str:
    """One job in one line: what ran (strategy, layout, payload size) and how it did (p50,
    ``vs_floor``, the speedup over ``pickled`` measured in the same job), which strategy it
    found fastest, tied or not (``harness.job.verdict``; ``others``: the records the job wrote
    for its other strategies), or why it did not run."""
    if not isinstance(rec, dict):
        return f"FAILED: {str(rec)[:160]}"
    # A dispatch job is named by its mode (leader:<strategy>, all_ranks): it has no baseline.
    name = rec.get("mode") or served(str(rec.get("strategy")), rec.get("auto_choice"))
    who = f"{name} {rec.get('layout')}"
    if rec.get("status") == "failed":
        return f"{who}  FAILED: {str(rec.get('error'))[:160]}"
    if rec.get("supported") is False:
        return f"{who}  UNSUPPORTED: {str(rec.get('error'))[:120]}"
    what = f"{rec.get('payload')} b{rec.get('batch_size')} {human_bytes(rec['payload_bytes'])}"
    if rec.get("workload"):  # a varying workload: its name, and bytes are a mean per call
        what = f"{rec.get('payload')} {rec['workload']} {human_bytes(rec['payload_bytes'])}/call"
    line = f"{who}  {what}  p50 {rec['p50_us'] / 1000:.2f} ms{_range(rec, 'p50_us', 1e-3)}"
    if rec.get("vs_floor"):
        line += f"  vs_floor {rec['vs_floor']:.2f}{_range(rec, 'vs_floor')}"
        if rec.get("floor_method"):
            line += f" ({rec['floor_method']})"
    if rec.get("vs_baseline") and not rec.get("mode") and rec.get("strategy") != "pickled":
        line += f"  {1 / rec['vs_baseline']:.1f}x faster than pickled"
    verdict = job_verdict([rec, *others])
    if verdict is not None and verdict.runner_up is not None:
        line += f"  fastest: {verdict.text()}"
        if verdict.kind == WINNER:
            line += f", then {verdict.runner_up_text()}"
    if rec.get("oversubscribed"):
        line += f"  † oversubscribed: {rec['ranks_on_node']} ranks on {rec['host_cores']} cores"
    return line
