"""The cost model's price of Ray dispatch (``harness.model.dispatch_prices``) as a Hydra app,
``task=example`` (all_ranks against leader + broadcast at 16,384 GPUs: ``bcastbench predict
target=ray``) or ``task=validate`` (measured dispatch records beside the model,
``harness.report.dispatch_model``: ``bcastbench validate target=ray``, which sets the task).

    bcastbench predict target=ray [cluster=h200_ib] [ray=local]   # the 16,384-GPU answer
    bcastbench validate target=ray \
        'records=[results/reference_ray/emulated_node.json]'       # per-cell error

Configured through ``conf/commands/ray_model.yaml`` (schema ``RayModelConf``; ``cluster/`` and
``ray/`` groups); what it prints also goes to ``ray_model_<task>.json`` in the Hydra job's
directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from harness.commands.hydra_app import run_app
from harness.commands.predict import EXAMPLE, scaled_spec
from harness.commands.tool import job_command, job_dir
from harness.files import write_json
from harness.model.dispatch_prices import (
    ASSUMPTIONS,
    EXAMPLE_BATCHES,
    EXAMPLE_DPS,
    LEADER_STRATEGIES,
    TIE,
    RayCostConf,
    example_answer,
    format_scan,
    price_all_ranks,
    price_hops,
    price_leader,
)
from harness.model.dispatch_ranks import HOPS
from harness.model.prices import price_strategy
from harness.report.dispatch_model import compare, format_compare
from strategies.core.cluster import ClusterConf, ClusterError
from strategies.core.layout import Layout

MODULE = "harness.commands.ray_model"
"""Where this command lives; its printed name comes from ``harness.errors.program``."""


def example_scan(cluster: ClusterConf, ray: RayCostConf, seq_len: int = 4096,
                 dps=EXAMPLE_DPS, batches=EXAMPLE_BATCHES) -> list[dict]:  # fmt: skip
    """``all_ranks`` against the best leader + broadcast for the example's replica shape
    (tp8·cp2·pp8 = 128 ranks) at each DP degree and rows per replica, the hop modes
    (``edge_stages``, ``chain``) priced beside them."""
    shape = {k.split("=")[0].split(".")[1]: int(k.split("=")[1])
             for k in EXAMPLE if k.startswith("layout.")}  # fmt: skip
    out = []
    for batch in batches:
        spec = scaled_spec("rl_rollout", batch, seq_len)
        nbytes = spec.tensor_bytes + spec.non_tensor_bytes
        for dp in dps:
            layout = Layout(**{**shape, "dp": dp})
            leader = {}
            for name in LEADER_STRATEGIES:
                try:
                    bcast_s = price_strategy(name, layout, spec, cluster).total_s
                except Exception as exc:  # strategies.Unsupported: not a candidate here
                    if type(exc).__name__ != "Unsupported":
                        raise
                    continue
                leader[name] = price_leader(layout, nbytes, cluster, ray, name, bcast_s).total_s
            best = min(leader, key=leader.get)
            all_s = price_all_ranks(layout, nbytes, cluster, ray).total_s
            hops = {k: price_hops(k, layout, spec, cluster, ray).total_s for k in HOPS}
            out.append({
                "dp": dp, "nodes": layout.world_size // cluster.gpus_per_node,
                "gpus": layout.world_size, "batch_size": batch, "payload_bytes": nbytes,
                "all_ranks_ms": all_s * 1e3, "leader": best, "leader_ms": leader[best] * 1e3,
                **{f"{k}_ms": v * 1e3 for k, v in hops.items()},
                "all_ranks_wins": all_s < (1 - TIE) * leader[best],
                "tie": abs(all_s / leader[best] - 1) <= TIE,
            })  # fmt: skip
    return out


TASKS = ("example", "validate")


@dataclass
class RayModelConf:
    """Root config of ``conf/commands/ray_model.yaml``."""

    task: str = "example"
    """``example``: all_ranks against leader + broadcast at 16,384 GPUs on ``cluster``;
    ``validate``: the measured dispatch ``records`` against the model, per cell."""
    records: list[str] = field(default_factory=list)
    """``task=validate``: JSON lists of dispatch records (``bcastbench run target=dispatch``
    or ``target=dispatch-emulated``'s ``out=``/``dispatch.json``); each names the cluster it
    ran on."""
    cluster: ClusterConf = field(default_factory=ClusterConf)
    """``task=example``: the machine room to price on; ``conf/cluster/``."""
    ray: RayCostConf = field(default_factory=RayCostConf)
    """Ray's put, get and call costs; ``conf/ray/`` (written by ``bcastbench calibrate
    target=ray``)."""


def _records(paths_: list[str]) -> list[dict]:
    """Every dispatch record of the files in ``paths_`` (each a JSON list), read-only."""
    out = []
    for path in paths_:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ClusterError(f"records: cannot read {path}: {exc}") from None
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ClusterError(f"records: {path} is not a JSON list of dispatch records")
        out += data
    return out


def check(cfg) -> None:
    """The values a job reads, checked before any job runs (``command.run_app``)."""
    if cfg.task not in TASKS:
        raise ClusterError(f"task must be one of {list(TASKS)}, got {cfg.task!r}")
    if cfg.task == "validate" and not cfg.records:
        raise ClusterError("task=validate needs records=[FILE,...] (dispatch record lists)")
    if cfg.task == "example" and cfg.records:
        raise ClusterError("records are read by task=validate; task=example prices, reads none")
    OmegaConf.to_object(cfg.ray)  # RayCostConf checks its numbers
    OmegaConf.to_object(cfg.cluster)
    if cfg.task == "validate":
        for rec in _records(list(cfg.records)):
            missing = {"dp", "pp", "tp", "cp", "order", "modes", "payload"} - set(rec)
            if missing:
                raise ClusterError(f"records: a record lacks {sorted(missing)}")


def task(cfg) -> dict:
    """One Hydra job: print the example's scan or the validation table; record it."""
    ray = OmegaConf.to_object(cfg.ray)
    if cfg.task == "example":
        rows = example_scan(OmegaConf.to_object(cfg.cluster), ray)
        answer = example_answer(rows)
        print(format_scan(rows) + "\n\n" + answer + "\n\nAssumptions:")
        print("\n".join(f"- {a}" for a in ASSUMPTIONS))
        record = {"rows": rows, "answer": answer.splitlines(), "assumptions": list(ASSUMPTIONS)}
    else:
        rows = compare(_records(list(cfg.records)), ray)
        print(format_compare(rows))
        record = {"rows": rows, "records": list(cfg.records)}
    record = {"kind": f"ray_model_{cfg.task}", **record, "command": job_command(MODULE)}
    write_json(job_dir() / f"ray_model_{cfg.task}.json", record)
    return record


def main(argv: list[str] | None = None) -> int:
    """``bcastbench predict|validate target=ray [overrides]``; a bad value exits 2 with one
    line."""
    return run_app(MODULE, "ray_model", task, check, argv, schema=RayModelConf)


if __name__ == "__main__":
    raise SystemExit(main())
