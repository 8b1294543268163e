"""The result record of one job: field names are part of the interface (see README)."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

from harness import files, paths

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
        "git_rev": git_rev(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def build(cfg, layout, spec, summary: dict, layout_name: str, world_start_s: float) -> dict:
    """One flat record for the strategy under test, with its references beside it."""
    if "unsupported" in summary:
        return {
            "strategy": spec.strategy,
            "backend": cfg.backend.name,
            "device": cfg.backend.device,
            "world_size": layout.world_size,
            "layout": layout_name,
            **{k: getattr(layout, k) for k in ("dp", "pp", "tp", "cp")},
            "order": "-".join(layout.tokens),
            "payload": spec.payload,
            "batch_size": spec.batch_size,
            "seq_len": spec.seq_len,
            "supported": False,
            "error": summary["unsupported"],
            "correct": None,
            **environment(),
        }
    mine = summary["strategies"][spec.strategy]
    floor = summary["strategies"].get("floor")
    base = summary["strategies"].get("pickled")
    payload_bytes = summary["payload_bytes"]
    p50_s = mine["p50_us"] / 1e6
    algbw = payload_bytes / p50_s / 1e9 if p50_s > 0 else 0.0
    record = {
        "strategy": spec.strategy,
        "backend": cfg.backend.name,
        "device": cfg.backend.device,
        "world_size": layout.world_size,
        "layout": layout_name,
        "dp": layout.dp,
        "pp": layout.pp,
        "tp": layout.tp,
        "cp": layout.cp,
        "order": "-".join(layout.tokens),
        "payload": spec.payload,
        "batch_size": spec.batch_size,
        "seq_len": spec.seq_len,
        "payload_bytes": payload_bytes,
        "iters": spec.iters,
        "warmup": spec.warmup,
        **{k: mine[k] for k in ("p50_us", "p90_us", "p99_us", "min_us", "max_us", "mean_us")},
        "rank_skew_us": mine["rank_skew_us"],
        "algbw_gbps": algbw,
        "busbw_gbps": algbw,  # broadcast: F = 1, all data must leave the root (nccl-tests)
        "floor_p50_us": floor["p50_us"] if floor else None,
        "baseline_p50_us": base["p50_us"] if base else None,
        "vs_floor": mine["p50_us"] / floor["p50_us"] if floor else None,
        "vs_baseline": mine["p50_us"] / base["p50_us"] if base else None,
        "collectives_per_call": mine["collectives_per_call"],
        "collectives_leader": mine["collectives_leader"],
        "comm_bytes_leader": mine["comm_bytes_leader"],
        "packed_bytes_leader": mine["work_leader"].get("packed_bytes", 0),
        "pickled_bytes_leader": mine["work_leader"].get("pickled_bytes", 0),
        "copied_bytes_leader": mine["work_leader"].get("copied_bytes", 0),
        "pickled_bytes_receiver": mine["work_receiver_max"].get("unpickled_bytes", 0),
        "copied_bytes_receiver": mine["work_receiver_max"].get("copied_bytes", 0),
        "peak_rss_bytes": mine["peak_rss_bytes"],
        "peak_rss_delta_bytes": mine["peak_rss_delta_bytes"],
        "peak_cuda_bytes": mine["peak_cuda_bytes"],
        "correct": True,
        "supported": True,
        "world_start_s": world_start_s,
        "references": {
            name: {k: v for k, v in s.items() if not isinstance(v, dict)}
            for name, s in summary["strategies"].items()
            if name != spec.strategy
        },
        **environment(),
    }
    return record


def write_atomic(path: Path, record: dict) -> None:
    """A record as JSON, never half-written, readable by others (``harness.files``)."""
    files.write_json(path, record)
