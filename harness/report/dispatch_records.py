"""Ray dispatch records from a results directory: the JSON lists a dispatch CLI writes and a
Hydra sweep's per-job result.json files, merged into one record per setting (the Ray report's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.job.spec import Scope
from harness.report.collect import read_record

DISPATCH_SCOPE = Scope.DISPATCH.value
_SAME_RUN = (
    "layout", "order", "world_size", "payload", "batch_size", "seq_len", "workload", "dp_split",
    "backend",
)  # fmt: skip
"""What one setting of a dispatch sweep shares (a varying workload is its own setting, never
merged with a constant one of the same largest shape)."""


def load_dispatch_records(root: Path | str) -> list[dict]:
    """Every dispatch record in the JSON lists directly under ``root`` (the ``dispatch.json``
    a ``bcastbench ray-dispatch`` or ``ray-emulated`` sweep writes), then those of a
    ``bcastbench run world=ray ray.dispatch=...`` sweep's result.json files, merged into one
    record per setting (``_merge_hydra_dispatch``)."""
    out = []
    for path in sorted(Path(root).glob("*.json")):
        if path.name == "result.json":
            continue  # a job record, read below
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"bcastbench: skipped {path}: not readable JSON ({exc})", file=sys.stderr)
            continue
        if isinstance(data, list):
            # A job whose first mode was refused timed nothing: it has no modes to show.
            out += [
                r for r in data
                if isinstance(r, dict) and r.get("scope") == DISPATCH_SCOPE
                and isinstance(r.get("modes"), dict)
            ]  # fmt: skip
    # Quiet: the report's own reader (``collect.load``) says what it skips.
    jobs = [read_record(p, quiet=True) for p in sorted(Path(root).rglob("result.json"))]
    return out + _merge_hydra_dispatch(
        [
            r for r in jobs
            if r is not None and r.get("scope") == DISPATCH_SCOPE and r.get("status") == "ok"
        ]
    )  # fmt: skip


def _hashable(value):
    """A record's value as a dict key part (a dp_split list becomes a tuple)."""
    return tuple(value) if isinstance(value, list) else value


def _merge_hydra_dispatch(jobs: list[dict]) -> list[dict]:
    """One dispatch job times its mode and that mode's raw floor; a sweep's jobs of one setting
    (layout, payload, size, backend, emulated links) become one record holding every mode, as
    the dispatch CLI writes it. A floor several jobs measured keeps its median-p50 row."""
    groups: dict[tuple, list[dict]] = {}
    for job in jobs:
        key = tuple(_hashable(job.get(k)) for k in _SAME_RUN) + tuple(
            job.get(k) for k in sorted(job) if k.startswith("emulate_")
        )
        groups.setdefault(key, []).append(job)
    merged = []
    for group in groups.values():
        rows: dict[str, list[dict]] = {}
        for job in group:
            for mode, row in job["modes"].items():
                rows.setdefault(mode, []).append(row)
        modes = {
            m: sorted(r, key=lambda x: x["p50_us"])[(len(r) - 1) // 2] for m, r in rows.items()
        }
        first = group[0]
        drop = ("modes", "mode", "dispatch", "strategy", "options", "status")
        merged.append({**{k: v for k, v in first.items() if k not in drop}, "modes": modes})
    return merged
