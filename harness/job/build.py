"""Every ``JobSpec`` is built here, from what each way in hands over: a ``bcastbench run`` job's
validated config (``from_run_config``), a ``bcastbench ray-dispatch`` job's
(``from_dispatch_config``), and the pytest plugin's keyword arguments (``from_arguments``).
A spec is built once per job, on the process that runs it, and sent to every rank."""

from __future__ import annotations

from omegaconf import OmegaConf

from harness.job.config import (
    Checked,
    dispatch_modes_of,
    layout_of,
    strategy_of,
)
from harness.job.spec import JobSpec
from harness.payload import source
from harness.worlds.launcher import RAY
from harness.worlds.ray_cluster import RayConf
from strategies.core.layout import Layout


def from_run_config(cfg, checked: Checked) -> JobSpec:
    """A ``bcastbench run`` job: everything a rank needs, from the config as ``check`` read it
    (``checked``: the layout, workload, fault and payload, each read once) and its plain
    values."""
    return JobSpec(
        strategy=strategy_of(cfg),
        layout=checked.layout,
        payload=cfg.payload.name,
        payload_path=checked.payload.path,
        payload_trust=bool(cfg.payload.get("trust", False)),
        payload_max_bytes=cfg.payload.get("max_bytes"),
        batch_size=int(cfg.payload.batch_size),
        seq_len=checked.seq_len,
        broadcast_non_tensor=cfg.payload.broadcast_non_tensor,
        seed=int(cfg.payload.seed),
        iters=int(cfg.iters),
        warmup=int(cfg.warmup),
        time_budget_s=None if cfg.get("time_budget_s") is None else float(cfg.time_budget_s),
        floor_methods=_floor_methods(cfg),
        references=tuple(cfg.references),
        record_each=bool(cfg.record_each),
        options=OmegaConf.to_container(cfg.strategy.options, resolve=True) or {},
        fault=checked.fault,
        repeats=int(cfg.repeats),
        # Counted only where the rank context carries the emulated links' counter.
        link_bytes_calls=int(cfg.emulate.bytes_calls) if cfg.emulate.enabled else 0,
        backend=cfg.backend.name,
        device=cfg.backend.device,
        world=str(cfg.world),
        dispatch=str(cfg.ray.dispatch) if cfg.world == RAY else "none",
        workload=checked.workload,
        steady_iters=int(cfg.steady_iters),
        timeout_s=float(cfg.timeout_s),
        source=checked.payload,
    )


def from_dispatch_config(cfg, conf: RayConf) -> JobSpec:
    """A ``bcastbench ray-dispatch`` job (``harness.commands.ray_dispatch.RayDispatchConf``,
    validated by ``harness.job.config.validate_dispatch``; ``conf``, its Ray settings read
    once): a dispatch job whose record is about its first mode, with every other mode (and
    each family's floor) timed beside it."""
    p, first = cfg.payload, dispatch_modes_of(cfg)[0]
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
        world=RAY,
        dispatch=first.kind,
        modes=tuple(str(m) for m in cfg.modes),
        timeout_s=float(conf.timeout_s),
    )


def from_arguments(strategy: str, layout, options: dict, fields: dict) -> JobSpec:
    """A job the pytest plugin runs (``bcastbench_job(strategy=..., layout=..., **fields)``):
    ``fields`` are ``JobSpec``'s own names; a recorded payload's path resolved as every rank
    can open it (a schema by its bare name)."""
    fields = dict(fields)
    if fields.get("payload_path"):
        fields["payload_path"] = source.path_of(fields.get("payload", ""), fields["payload_path"])
    return JobSpec(strategy, layout, options=options, **fields)


def for_calibration(world_size: int, names: list[str], reps: int) -> JobSpec:
    """``bcastbench calibrate``'s collectives: every probe of ``names``
    (``harness.job.probes``) timed in the same interleaved rounds on one replica of the whole
    world, one untimed round first; the batch every job builds is the smallest there is (no
    probe moves it)."""
    return JobSpec(
        strategy=names[0],
        layout=Layout(tp=world_size),
        batch_size=1,
        seq_len=2,
        iters=reps,
        warmup=1,
        references=tuple(names[1:]),
    )


def _floor_methods(cfg) -> tuple[str, ...] | None:
    """``floor_methods`` as the spec holds it (None: every raw method the layout allows)."""
    methods = cfg.get("floor_methods")
    return None if methods is None else tuple(str(m) for m in methods)
