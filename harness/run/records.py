"""The result record of one job: field names are part of the interface (see README)."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

from harness import files, paths
from strategies.core.layout import DEFAULT_ORDER

REPO = paths.REPO


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
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def layout_name(layout) -> str:
    """The shape's own name: the axes larger than 1 in the presets' spelling (``tp2pp2dp2``,
    ``pp2``, ``tp2cp2``), then ``@order`` when the order is not megatron-core's default, so two
    runs share a name exactly when they share a shape (``layout=tp2pp2 layout.tp=1`` is
    ``pp2``; the seed's DP-slowest world is ``tp2pp2dp2@tp-cp-ep-pp-dp``)."""
    name = "".join(
        f"{axis}{getattr(layout, axis)}" for axis in NAME_AXES if getattr(layout, axis) > 1
    )
    order = "-".join(layout.tokens)
    return (name or "tp1") + ("" if order == DEFAULT_ORDER else f"@{order}")


NAME_AXES = ("tp", "pp", "cp", "dp")
"""The order axes appear in a shape's name (the presets' order: tp2pp2, pp2cp2, tp2pp2dp2)."""


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
    return {
        "strategy": None if dispatch == "all_ranks" else spec.strategy,  # no strategy runs
        "options": dict(spec.options),
        "scope": SCOPE_BROADCAST if dispatch == "none" else SCOPE_DISPATCH,
        **({"dispatch": dispatch} if dispatch != "none" else {}),
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
        "iters": spec.iters,
        "warmup": spec.warmup,
    }


SCOPE_BROADCAST, SCOPE_DISPATCH = "broadcast", "dispatch+broadcast"
"""What a job's clock covers: the broadcast from a leader that holds its batch, or everything
from the driver holding the global batch to every rank holding its chunk (Ray dispatch)."""


def build_dispatch(spec, timed: dict, world_start_s: float = 0.0) -> dict:
    """The record of a dispatch job from ``harness.ray.dispatch.run_dispatch``'s record: the
    job's mode flat (p50, its raw floor, vs_floor) and every mode measured in the job under
    ``modes``, the shape the Ray report reads."""
    from harness.ray.dispatch import FLOORS, LEADER

    mode = f"{LEADER}:{spec.strategy}" if spec.dispatch == LEADER else "all_ranks"
    job = _job_fields(spec)
    if mode not in timed["modes"]:  # the leader's strategy refused the layout
        why = timed["unsupported"].get(spec.strategy, "refused")
        unsupported = {"status": "unsupported", "supported": False, "error": why}
        return {**job, "mode": mode, **unsupported, "correct": None, **environment()}
    mine, floor = timed["modes"][mode], timed["modes"][FLOORS[spec.dispatch]]
    return {
        **job,
        "mode": mode,
        "status": "ok",
        "payload_bytes": timed["payload_bytes"],
        **{k: mine[k] for k in ("p50_us", "p90_us", "p99_us", "min_us", "max_us", "mean_us")},
        "floor_p50_us": floor["p50_us"],
        "vs_floor": mine["vs_floor"],
        "modes": timed["modes"],
        "unsupported": timed["unsupported"],
        "correct": True,
        "supported": True,
        "world_start_s": world_start_s,
        **environment(),
    }


def build(spec, summary: dict, world_start_s: float = 0.0) -> dict:
    """One flat record: what the job was (from its JobSpec), then what was measured for the
    strategy under test with its references beside it, or why it was refused."""
    if "unsupported" in summary:
        measured = {
            "status": "unsupported",
            "supported": False,
            "error": summary["unsupported"],
            "correct": None,
        }
    else:
        measured = {"status": "ok", **_measured(spec, summary), "world_start_s": world_start_s}
    return {**_job_fields(spec), **measured, **environment()}


def failed(spec, error: BaseException) -> dict:
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


def _measured(spec, summary: dict) -> dict:
    mine = summary["strategies"][spec.strategy]
    floor_us = summary.get("floor_p50_us")
    single_us = summary.get("floor_single_p50_us")
    base = summary["strategies"].get("pickled")
    payload_bytes = summary["payload_bytes"]
    p50_s = mine["p50_us"] / 1e6
    algbw = payload_bytes / p50_s / 1e9 if p50_s > 0 else 0.0
    work, received = mine["work_leader"], mine["work_receiver_max"]
    return {
        "payload_bytes": payload_bytes,
        **{k: mine[k] for k in ("p50_us", "p90_us", "p99_us", "min_us", "max_us", "mean_us")},
        "rank_skew_us": mine["rank_skew_us"],
        "algbw_gbps": algbw,
        "busbw_gbps": algbw,  # broadcast: F = 1, all data must leave the root (nccl-tests)
        "floor_p50_us": floor_us,
        "floor_method": summary.get("floor_method"),
        "floor_single_p50_us": single_us,
        "baseline_p50_us": base["p50_us"] if base else None,
        "vs_floor": mine["p50_us"] / floor_us if floor_us else None,
        "vs_floor_single": mine["p50_us"] / single_us if single_us else None,
        "vs_baseline": mine["p50_us"] / base["p50_us"] if base else None,
        **{k: mine[k] for k in ("collectives_per_call", "collectives_leader", "comm_bytes_leader")},
        "packed_bytes_leader": work.get("packed_bytes", 0),
        "pickled_bytes_leader": work.get("pickled_bytes", 0),
        "copied_bytes_leader": work.get("copied_bytes", 0),
        "pickled_bytes_receiver": received.get("unpickled_bytes", 0),
        "copied_bytes_receiver": received.get("copied_bytes", 0),
        # Present when a collective count could not be established (the counts are None).
        **{k: mine[k] for k in ("collectives_unavailable",) if k in mine},
        **{k: mine[k] for k in ("peak_rss_bytes", "peak_rss_delta_bytes", "peak_cuda_bytes")},
        **(
            {"cross_node_bytes_per_call": mine["cross_node_bytes_per_call"]}
            if "cross_node_bytes_per_call" in mine  # emulated-cluster workers
            else {}
        ),
        **({"auto_choice": mine["choice"]} if "choice" in mine else {}),
        "correct": True,
        "supported": True,
        "references": {
            name: {k: v for k, v in s.items() if not isinstance(v, dict)}
            for name, s in summary["strategies"].items()
            if name != spec.strategy
        },
    }


def write_atomic(path: Path, record: dict) -> None:
    """A record as JSON, never half-written, readable by others (``harness.files``)."""
    files.write_json(path, record)
