"""``bcastbench run target=dispatch``: the dispatch modes (``harness.job.dispatch``) side by
side on a Ray world, as a Hydra app.

    bcastbench run target=dispatch layout=tp2pp2 payload=rl_rollout payload.batch_size=32 \
        'modes=[leader:header,leader:pickled,all_ranks]' iters=5
    bcastbench run target=dispatch -m layout=tp2pp2,tp2pp2dp2 payload.batch_size=48,704

Configured through ``conf/commands/ray_dispatch.yaml`` (schema ``RayDispatchConf``, checked by
``harness.job.config.validate_dispatch``); each job is a dispatch job (``harness.job.build``)
run by ``harness.job.execute.run_job``, which writes its record to ``result.json`` in its Hydra
job directory (``results/ray/dispatch/...``; ``bcastbench report <sweep dir>`` reads them), and
``out=FILE`` collects every record of the command in one JSON list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from harness.commands.hydra_app import run_app
from harness.commands.tool import job_command, job_dir, write_out
from harness.job import config_schema, records
from harness.job.config import validate_dispatch
from harness.job.config_schema import LayoutConf, PayloadConf, RayNode
from harness.job.dispatch_modes import FLOORS
from harness.job.execute import run_job
from harness.job.job_config import DispatchConfig
from harness.model.dispatch_ranks import ALL_RANKS
from harness.worlds import opening

# -- command line --------------------------------------------------------------------------
MODULE = "harness.commands.ray_dispatch"
"""Where ``bcastbench run target=dispatch`` lives (its printed name: ``harness.errors.program``)."""


def format_table(record: dict) -> str:
    """One line per mode: p50, p90 and the p50 ratio to each floor measured in the same job
    (a job whose first mode was refused: its one line)."""
    if record["status"] != "ok":
        return records.job_line(record)
    floors = [f for f in FLOORS.values() if f in record["modes"]]
    head = f"{'mode':<28}{'p50 ms':>10}{'p90 ms':>10}" + "".join(f"{'/' + f:>18}" for f in floors)
    lines = [
        f"{record['layout']}, {record['payload']} batch {record['batch_size']}/replica, "
        f"{record['payload_bytes'] / 2**20:.2f} MiB per replica, scope {record['scope']}",
        head,
    ]
    for name, row in record["modes"].items():
        ratios = "".join(f"{row['vs_floors'][f]:>18.2f}" for f in floors)
        line = f"{name:<28}{row['p50_us'] / 1e3:>10.2f}{row['p90_us'] / 1e3:>10.2f}{ratios}"
        if "cross_node_bytes_per_call" in row:
            line += f"   {row['cross_node_bytes_per_call'] / 1e6:.2f} MB crossed/call"
        lines.append(line)
    lines += [f"{name}: unsupported ({why})" for name, why in record["unsupported"].items()]
    return "\n".join(lines)


@dataclass
class RayDispatchConf:
    """Root config of ``conf/commands/ray_dispatch.yaml``: one job times ``modes`` on one layout and
    batch; a ``-m`` sweep runs one job per combination on one Ray world per world size."""

    layout: LayoutConf = field(default_factory=LayoutConf)
    """Parallel shape (world size = dp·pp·tp·cp); reuses ``conf/layout/``."""
    payload: PayloadConf = field(default_factory=PayloadConf)
    """What the driver generates per replica: ``payload.batch_size`` rows each, so the global
    batch has ``batch_size * dp``; reuses ``conf/payload/`` (generated payloads only)."""
    modes: list[str] = field(default_factory=lambda: ["leader:header", "leader:pickled", ALL_RANKS])
    """Dispatch modes (``leader:<strategy>``, ``leader:floor``, ``all_ranks``, ``rdt``,
    ``edge_stages``, ``chain``, each of the last four with ``:raw`` for its floor); each
    family's floor is added when missing."""
    iters: int = 5
    """Timed calls per mode, interleaved, each round in its own order."""
    warmup: int = 2
    """Untimed calls per mode first."""
    link_bytes_calls: int = 0
    """Emulated clusters: untimed calls per mode whose node-link bytes are counted; 0 skips."""
    options: dict[str, Any] = field(default_factory=dict)
    """Options of every leader mode's strategy (``strategies.get(name, groups, **options)``)."""
    ray: RayNode = field(default_factory=RayNode)
    """The Ray world (``harness.worlds.ray_cluster.RayConf``'s fields: address, num_cpus, placement,
    ...); ``ray.timeout_s`` also bounds one dispatch call. ``ray.dispatch`` is
    ``bcastbench run``'s and must stay ``none`` here: ``modes`` says what runs."""
    out: str | None = None
    """Also write every record of this command so far to this file (a JSON list)."""
    record: dict[str, Any] = field(default_factory=dict)
    """Fields each record takes as they are: what a command wrapping this one knows and it
    does not (``run target=dispatch-emulated``: the emulated cluster's shape, its own command)."""


def register() -> None:
    """The schema in Hydra's ConfigStore (``conf/commands/ray_dispatch.yaml`` names it)."""
    ConfigStore.instance().store(name="ray_dispatch_schema", node=RayDispatchConf)


def task(cfg) -> dict:
    """One Hydra job: time the modes on this process's Ray world of the layout's size (started
    by the first job of that size, reused by the next ones: ``harness.worlds.opening.ray_world``),
    write the record in the job's directory, print the table."""
    job = DispatchConfig.of(cfg)  # nothing below reads cfg
    world = opening.ray_world(job.spec.layout.world_size, job.ray)
    config_schema.COMMAND[:] = [job_command(MODULE)]  # this job's own line, a sweep's values in it
    record = run_job(world, job.spec, job_dir(), extra=job.record)
    if record["world_start_s"]:
        print(f"Ray world of {world.world_size} ranks started in "
              f"{record['world_start_s']:.1f} s", flush=True)  # fmt: skip
    print(format_table(record) + "\n", flush=True)
    _DONE.append(record)
    write_out(_DONE, job.out)
    return record


_DONE: list[dict] = []
"""Every record this process's jobs made, for ``out`` (a sweep's jobs share one process)."""


def main(argv: list[str] | None = None) -> int:
    """``bcastbench run target=dispatch [overrides]``; a bad value exits 2 with one line."""
    register()
    return run_app(MODULE, "ray_dispatch", task, validate_dispatch, argv)


if __name__ == "__main__":
    raise SystemExit(main())
