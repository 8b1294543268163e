"""Measured Ray dispatch records beside the cost model's price of them, one row per mode
(``harness.model.dispatch_prices``): read by the report and by ``bcastbench ray-model
task=validate``."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from harness.megatron_import import quiet_megatron
from harness.model.dispatch_prices import RayCostConf, price_mode
from harness.payload import generated
from strategies.core.cluster import ClusterConf, load_cluster
from strategies.core.layout import Layout
from strategies.core.plan import spec_of


# -- against measurements --------------------------------------------------------------------
def _record_cluster(record: dict) -> ClusterConf:
    """The preset a dispatch record ran on: the emulated cluster (links and ranks per node as
    recorded) or the local world."""
    # A record of today's local world carries the emulate_* fields as null; older ones lack them.
    if not record.get("emulate_nodes"):
        return load_cluster("local")
    preset = "emulated" if record.get("emulate_links", "node") == "node" else "emulated_rails"
    return replace(load_cluster(preset), gpus_per_node=int(record["emulate_ranks_per_node"]))


def compare(records: list[dict], ray: RayCostConf) -> list[dict]:
    """Measured p50 beside the model for every mode of every dispatch record, one row each.
    The records ran on the calibration host, so its cores bound every rank's sharing. A
    varying workload's record is left out: its p50 mixes shapes the model prices one by one."""
    quiet_megatron()  # strategies' plans may import megatron-core

    rows = []
    for rec in records:
        if rec.get("workload"):
            continue
        layout = Layout(**{k: rec[k] for k in ("dp", "pp", "tp", "cp", "order")})
        spec = spec_of(generated.make(rec["payload"], rec["batch_size"], rec["seq_len"], 0, None))
        cluster = _record_cluster(rec)
        for mode, row in rec["modes"].items():
            cost = price_mode(mode, layout, spec, cluster, ray, ray.calibrated_cores or None)
            measured_s = row["p50_us"] / 1e6
            rows.append({
                "cluster": cluster.name,
                "layout": rec["layout"].split(" ")[0],
                "payload_bytes": rec["payload_bytes"],
                "mode": mode,
                "measured_ms": measured_s * 1e3,
                "predicted_ms": cost.total_s * 1e3,
                "error": cost.total_s / measured_s - 1,
                "measured_cross_mb": (row.get("cross_node_bytes_per_call") or 0) / 1e6,
                "predicted_cross_mb": cost.cross_node_bytes / 1e6,
            })  # fmt: skip
    return rows


def format_compare(rows: list[dict]) -> str:
    """The per-cell table and the median absolute error."""
    lines = [
        f"{'cluster':<16}{'layout':<22}{'MiB':>7}  {'mode':<26}{'measured ms':>12}"
        f"{'model ms':>10}{'error':>8}{'MB crossed':>12}{'model MB':>10}"
    ]
    for r in rows:
        lines.append(
            f"{r['cluster']:<16}{r['layout']:<22}{r['payload_bytes'] / 2**20:>7.2f}  "
            f"{r['mode']:<26}{r['measured_ms']:>12.1f}{r['predicted_ms']:>10.1f}"
            f"{r['error']:>+8.0%}{r['measured_cross_mb']:>12.2f}{r['predicted_cross_mb']:>10.2f}"
        )
    for cluster in sorted({r["cluster"] for r in rows}):
        errors = [abs(r["error"]) for r in rows if r["cluster"] == cluster]
        lines.append(f"{cluster}: median |error| over {len(errors)} cells: {np.median(errors):.1%}")
    if rows:
        median = float(np.median([abs(r["error"]) for r in rows]))
        lines.append(f"all: median |error| over {len(rows)} cells: {median:.1%}")
    return "\n".join(lines)
