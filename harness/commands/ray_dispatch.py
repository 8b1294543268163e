"""``bcastbench ray-dispatch``: the dispatch modes (``harness.job.dispatch``) side by side on a
Ray world, as a Hydra app.

    bcastbench ray-dispatch layout=tp2pp2 payload=rl_rollout payload.batch_size=32 \
        'modes=[leader:header,leader:pickled,all_ranks]' iters=5
    bcastbench ray-dispatch -m layout=tp2pp2,tp2pp2dp2 payload.batch_size=48,704

Configured through ``conf/ray_dispatch.yaml`` (schema ``RayDispatchConf``); each job writes its
record to ``dispatch.json`` in its Hydra job directory (``results/ray/dispatch/...``), a sweep
lists all of them in its directory's ``dispatch.json`` (``bcastbench report <sweep dir>`` reads
it), and ``out=FILE`` collects them in one more list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from harness.commands.hydra_app import run_app
from harness.commands.tool import job_command, write_records
from harness.errors import ConfigError
from harness.job import records
from harness.job.broadcast import JobSpec
from harness.job.config import (
    DRIVER,
    LayoutConf,
    PayloadConf,
    RayNode,
    check_max_bytes,
    check_size,
    layout_of,
)
from harness.job.dispatch import run_dispatch
from harness.job.dispatch_modes import ALL_RANKS, FLOORS, Mode
from harness.payload import source
from harness.worlds import launcher
from harness.worlds.ray_world import RayConf, RayUnavailable, import_ray

# -- command line --------------------------------------------------------------------------
MODULE = "harness.commands.ray_dispatch"
"""Where ``bcastbench ray-dispatch`` lives (its printed name: ``harness.errors.program``)."""


RECORDS = "dispatch.json"
"""Each job's record, a JSON list of one, in the job's directory; a sweep's list of all of them
in the sweep's directory (``harness.commands.tool.write_records``; ``harness.report`` reads such lists)."""


def format_table(record: dict) -> str:
    """One line per mode: p50, p90 and the p50 ratio to each floor measured in the same job
    (a job whose first mode was refused: its one line)."""
    if record["status"] != "ok":
        return records.job_line(record)
    floors = [f for f in FLOORS.values() if f in record["modes"]]
    head = f"{'mode':<28}{'p50 ms':>10}{'p90 ms':>10}" + "".join(f"{'/' + f:>16}" for f in floors)
    lines = [
        f"{record['layout']}, {record['payload']} batch {record['batch_size']}/replica, "
        f"{record['payload_bytes'] / 2**20:.2f} MiB per replica, scope {record['scope']}",
        head,
    ]
    for name, row in record["modes"].items():
        ratios = "".join(f"{row['vs_floors'][f]:>16.2f}" for f in floors)
        line = f"{name:<28}{row['p50_us'] / 1e3:>10.2f}{row['p90_us'] / 1e3:>10.2f}{ratios}"
        if "cross_node_bytes_per_call" in row:
            line += f"   {row['cross_node_bytes_per_call'] / 1e6:.2f} MB crossed/call"
        lines.append(line)
    lines += [f"{name}: unsupported ({why})" for name, why in record["unsupported"].items()]
    return "\n".join(lines)


@dataclass
class RayDispatchConf:
    """Root config of ``conf/ray_dispatch.yaml``: one job times ``modes`` on one layout and
    batch; a ``-m`` sweep runs one job per combination on one Ray world per world size."""

    layout: LayoutConf = field(default_factory=LayoutConf)
    """Parallel shape (world size = dp·pp·tp·cp); reuses ``conf/layout/``."""
    payload: PayloadConf = field(default_factory=PayloadConf)
    """What the driver generates per replica: ``payload.batch_size`` rows each, so the global
    batch has ``batch_size * dp``; reuses ``conf/payload/`` (generated payloads only)."""
    modes: list[str] = field(default_factory=lambda: ["leader:header", "leader:pickled", ALL_RANKS])
    """Dispatch modes (``leader:<strategy>``, ``leader:floor``, ``all_ranks``,
    ``all_ranks:raw``); each family's floor is added when missing."""
    iters: int = 5
    """Timed calls per mode, interleaved with the first mode rotating."""
    warmup: int = 2
    """Untimed calls per mode first."""
    link_bytes_calls: int = 0
    """Emulated clusters: untimed calls per mode whose node-link bytes are counted; 0 skips."""
    options: dict[str, Any] = field(default_factory=dict)
    """Options of every leader mode's strategy (``strategies.get(name, groups, **options)``)."""
    ray: RayNode = field(default_factory=RayNode)
    """The Ray world (``harness.worlds.ray_world.RayConf``'s fields: address, num_cpus, placement,
    ...); ``ray.timeout_s`` also bounds one dispatch call. ``ray.dispatch`` is
    ``bcastbench run``'s and must stay ``none`` here: ``modes`` says what runs."""
    out: str | None = None
    """Also write every record of this command so far to this file (a JSON list)."""


def register() -> None:
    """The schema in Hydra's ConfigStore (``conf/ray_dispatch.yaml`` names it)."""
    ConfigStore.instance().store(name="ray_dispatch_schema", node=RayDispatchConf)


def ray_conf(cfg):
    """The runtime ``RayConf`` of ``cfg.ray``."""
    return RayConf(**OmegaConf.to_container(cfg.ray, resolve=True))


def spec_of_job(cfg) -> JobSpec:
    """The ``JobSpec`` of one job's config: a dispatch job whose record is about its first
    mode, with every other mode (and each family's floor) timed beside it."""
    p, first = cfg.payload, Mode.parse(str(cfg.modes[0])) if cfg.modes else None
    if first is None:
        raise ConfigError("modes: name at least one dispatch mode, e.g. modes=[leader:header]")
    conf = ray_conf(cfg)
    return JobSpec(
        strategy=first.strategy or "",  # all_ranks runs no strategy
        layout=layout_of(cfg),
        payload=p.name,
        batch_size=int(p.batch_size),
        seq_len=int(p.seq_len),
        broadcast_non_tensor=p.broadcast_non_tensor,
        seed=int(p.seed),
        iters=int(cfg.iters),
        warmup=int(cfg.warmup),
        options=OmegaConf.to_container(cfg.options, resolve=True),
        link_bytes_calls=int(cfg.link_bytes_calls),
        backend=conf.backend,
        device=conf.device,
        world="ray",
        dispatch=first.kind,
        modes=tuple(str(m) for m in cfg.modes),
    )


def check(cfg) -> None:
    """Every value a dispatch job reads, checked before any job runs (``command.run_app``)."""
    if cfg.payload.name not in source.PAYLOADS:
        raise ConfigError(
            f"payload.name: {cfg.payload.name!r} is not generated; the driver builds the "
            f"global batch, valid: {sorted(source.PAYLOADS)}"
        )
    for key, least in (("payload.batch_size", 1), ("payload.seq_len", 1), ("iters", 1),
                       ("warmup", 0), ("link_bytes_calls", 0)):  # fmt: skip
        value = OmegaConf.select(cfg, key)
        if value < least:
            raise ConfigError(f"{key} must be >= {least}, got {value}")
    p, dp = cfg.payload, layout_of(cfg).dp
    # The driver builds the global batch of every replica: dp × batch_size rows.
    rows = int(p.batch_size) * dp
    check_size(p.name, [[(rows, int(p.seq_len))]], check_max_bytes(p), DRIVER, copies=2)
    try:
        spec_of_job(cfg).dispatch_modes()
        conf = ray_conf(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if conf.dispatch != "none":
        raise ConfigError(
            f"ray.dispatch={conf.dispatch} is bcastbench run's setting; here modes= says what "
            "runs (leave ray.dispatch=none)"
        )
    try:
        import_ray()
    except RayUnavailable as exc:
        raise ConfigError(str(exc)) from None


def task(cfg) -> dict:
    """One Hydra job: time the modes on this process's Ray world of the layout's size (started
    by the first job of that size, reused by the next ones: ``harness.worlds.launcher.ray_world``),
    print the table, write the record."""
    spec = spec_of_job(cfg)
    world = launcher.ray_world(spec.layout.world_size, ray_conf(cfg))
    start_s, world.start_s = world.start_s, 0.0  # paid once, by the job that started it
    if start_s:
        print(f"Ray world of {world.world_size} ranks started in {start_s:.1f} s", flush=True)
    summary = run_dispatch(world, spec, float(cfg.ray.timeout_s))
    record = records.complete(records.build(spec, summary, start_s))
    record["command"] = job_command(MODULE)
    print(format_table(record) + "\n", flush=True)
    _DONE.append(record)
    write_records(RECORDS, _DONE, cfg.out)
    return record


_DONE: list[dict] = []
"""Every record this process's jobs made, for ``out`` (a sweep's jobs share one process)."""


def main(argv: list[str] | None = None) -> int:
    """``bcastbench ray-dispatch [overrides]``; a bad value exits 2 with one line."""
    register()
    return run_app(MODULE, "ray_dispatch", task, check, argv)


if __name__ == "__main__":
    raise SystemExit(main())
