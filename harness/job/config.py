"""A job's configuration checked: ``validate`` runs on every job before any process starts
and says what is wrong with the numbers in the message, and the runtime values (the
``Layout``, the workload, the Ray settings, the payload) are read from it here. The schema
Hydra composes is ``harness.job.config_schema``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import OmegaConf

import strategies
from harness.errors import ConfigError
from harness.job.dispatch_modes import DispatchMode, with_floors
from harness.job.fault import Fault
from harness.model.dispatch_ranks import LEADER
from harness.payload import generated, sizes, source, user_files, workload
from harness.units import human_bytes
from harness.worlds.emulated_network import EmulateConf
from harness.worlds.ray_cluster import RayConf, RayUnavailable, import_ray
from strategies.core.layout import Layout, LayoutError
from strategies.floor import VARIANTS as FLOOR_VARIANTS


def layout_of(cfg) -> Layout:
    """The runtime ``Layout`` of ``cfg.layout``, checked by megatron-core's rules too."""
    try:
        layout = Layout(**OmegaConf.to_container(cfg.layout, resolve=True))
        layout.megatron_kwargs()  # an order megatron-core cannot build fails here, not in ranks
        return layout
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class Checked:
    """What checking a job config reads from it, each value once: the job's ``Layout``, its
    ``Workload`` (for a recorded payload, at the recording's own seq_len), its ``Fault``, its
    Ray settings (None off Ray), the payload's source (a recording opened and checked once) and
    its tokens per row. ``harness.job.build.from_run_config`` builds the spec from it and
    ``harness.job.job_config.world_spec`` the world."""

    layout: Layout
    workload: workload.Workload
    fault: Fault
    ray: RayConf | None
    payload: source.PayloadSource
    seq_len: int | None


def validate(cfg, world_size: int | None = None) -> Layout:
    """Check a whole job config; return its Layout (``check`` for every value it reads).
    Raises ConfigError, one line that names the field, what is wrong with it (with the
    arithmetic) and what would be valid."""
    return check(cfg, world_size).layout


def check(cfg, world_size: int | None = None) -> Checked:
    """Check a whole job config; return what it read (``Checked``). Raises ConfigError as
    ``validate`` does."""
    layout = layout_of(cfg)
    if world_size is not None:
        try:
            layout.check_world(world_size)
        except LayoutError as exc:
            raise ConfigError(f"layout does not match the world: {exc}") from None
    _validate_names(cfg)
    work, payload, seq_len = _validate_payload(cfg, layout)
    _validate_backend(cfg, layout)
    if cfg.emulate.enabled:
        _validate_emulate(cfg, layout)
    ray = None
    if cfg.world != "forked" or cfg.ray.dispatch != "none":
        ray = _validate_ray(cfg, joined=world_size is not None)
    if cfg.iters < 1 or cfg.warmup < 0:
        raise ConfigError(
            f"iters must be >= 1 and warmup >= 0, got iters={cfg.iters}, warmup={cfg.warmup}"
        )
    if cfg.timeout_s <= 0:
        raise ConfigError(f"timeout_s must be positive, got {cfg.timeout_s}")
    if cfg.repeats < 1:
        raise ConfigError(f"repeats must be >= 1 (blocks of iters timed rounds), got {cfg.repeats}")
    try:
        fault = fault_of(cfg)
        fault.check_world(layout.world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return Checked(layout, work, fault, ray, payload, seq_len)


def fault_of(cfg) -> Fault:
    """The job's ``Fault``, from ``cfg.fault`` (it checks itself: ``ValueError``)."""
    f = cfg.fault
    return Fault(int(f.rank), int(f.at_iter), str(f.kind), int(f.delay_us))


def strategy_of(cfg) -> str:
    """What the job runs: ``strategy._target_`` (strategy=custom) or ``strategy.name``."""
    return cfg.strategy.get("_target_") or cfg.strategy.name


def _validate_strategy(cfg, known: list[str]) -> None:
    """The strategy exists (a name, or an importable ``_target_``) and takes these options.
    Errors are raised outside the ``except`` so the one-line printer adds no context."""
    strategy, problem = strategy_of(cfg), None
    if cfg.strategy.get("_target_"):
        try:
            strategies.get_class(strategy)
        except KeyError as exc:
            problem = f"strategy._target_: {exc.args[0]}"
    elif strategy == "custom":
        problem = (
            "strategy=custom needs strategy._target_=<package.module.Class>, the import path "
            "of a strategies.Strategy subclass (e.g. strategy._target_=my_pkg.mod.MyStrategy)"
        )
    elif strategy not in known:
        problem = (
            f"strategy.name: unknown strategy {strategy!r}; valid names: {strategies.names()}, "
            "or strategy=custom strategy._target_=<package.module.Class>"
        )
    if problem is None:
        try:
            options = OmegaConf.to_container(cfg.strategy.options, resolve=True) or {}
            strategies.check_options(strategy, options)
        except (TypeError, ValueError) as exc:
            problem = f"strategy.options: {exc}"
    if problem is None:
        problem = _runs_here(cfg, strategy)
    if problem is not None:
        raise ConfigError(problem)


def _runs_here(cfg, strategy: str) -> str | None:
    """Why the strategy under test cannot run in this job (an optional package this
    installation lacks, or a world it needs), or None. References are not checked: one that
    cannot run is refused on every rank at construction and dropped from the job."""
    cls = strategies.get_class(strategy)
    missing = cls.unavailable()
    if missing is not None:
        return f"strategy={strategy}: {missing}"
    if cls.world is not None and cfg.world != cls.world:
        return (
            f"strategy={strategy} runs only on world={cls.world} (this job: world={cfg.world}); "
            f"run it with world={cls.world}"
        )
    return None


def _validate_names(cfg) -> None:
    known = strategies.names(include_floor=True)
    _validate_strategy(cfg, known)
    for ref in cfg.references:
        if ref not in known:
            raise ConfigError(
                f"references: unknown reference strategy {ref!r}; valid names: {known}"
            )
    if cfg.payload.name not in (*generated.PAYLOADS, *source.RECORDED):
        raise ConfigError(
            f"payload.name: unknown payload {cfg.payload.name!r}; "
            f"valid names: {sorted(generated.PAYLOADS) + list(source.RECORDED)}"
        )


def _validate_payload(cfg, layout: Layout):
    """The payload's values; returns the job's workload, its payload source and tokens per
    row (a recording's own, read from it once)."""
    for key in ("batch_size", "seq_len"):
        value = cfg.payload[key]
        if value < 1:
            raise ConfigError(f"payload.{key} must be positive, got {value}")
    check_max_bytes(cfg.payload)
    recorded = cfg.payload.name in source.RECORDED
    work = workload_of(cfg, layout, None if recorded else int(cfg.payload.seq_len))
    if recorded:
        payload = _validate_recorded(cfg.payload, max(s.batch_size for s in work.period))
        seq_len = payload.seq_len(int(cfg.payload.seed))
    else:
        _validate_generated_size(cfg.payload, work)
        payload, seq_len = source.open_payload(cfg.payload.name), int(cfg.payload.seq_len)
    if cfg.steady_iters < 0:
        raise ConfigError(f"steady_iters must be >= 0, got {cfg.steady_iters}")
    unknown = sorted(set(cfg.get("floor_methods") or ()) - set(FLOOR_VARIANTS))
    if unknown:
        raise ConfigError(
            f"floor_methods names no raw method of the floor: {unknown}; valid: "
            f"{list(FLOOR_VARIANTS)} (one broadcast is always timed), or null for every one"
        )
    budget = cfg.get("time_budget_s")
    if budget is not None and budget <= 0:
        raise ConfigError(f"time_budget_s must be positive seconds (or null), got {budget}")
    if budget is not None and cfg.warmup < 1:
        raise ConfigError(
            "time_budget_s sizes each strategy's rounds from its warm-up calls: set warmup >= 1 "
            f"(got warmup={cfg.warmup})"
        )
    if budget is not None and work.varying:
        raise ConfigError(
            "time_budget_s times each strategy's own rounds, which a varying workload "
            "(payload.cycle, draws, dp_split) needs whole for every strategy: drop one of them"
        )
    step = 2 * layout.cp
    for where, length in _seq_lens(cfg, work):
        if length % step:
            below = length // step * step
            raise ConfigError(
                f"{where}={length} is not divisible by 2·cp = {step} "
                f"(Megatron splits the sequence into 2·cp zig-zag chunks); valid: a multiple of "
                f"{step}, e.g. {below or step} or {below + step}"
            )
    if recorded:  # the same cycle at the recording's own seq_len
        work = workload_of(cfg, layout, seq_len)
    return work, payload, seq_len


def _seq_lens(cfg, work) -> list[tuple[str, int]]:
    """The job's seq_len and every other one its workload moves, each with where it was set."""
    out = [("payload.seq_len", int(cfg.payload.seq_len))]
    return out + [
        ("a payload.cycle entry's seq_len", s.seq_len)
        for s in dict.fromkeys(work.period)
        if s.seq_len is not None and s.seq_len != out[0][1]
    ]


def workload_of(cfg, layout: Layout, seq_len: int | None):
    """The job's ``harness.payload.workload.Workload`` (``seq_len``: the job's own, the
    recording's for a recorded payload); ConfigError, one line, for a bad one."""
    node = OmegaConf.to_container(cfg.payload, resolve=True)
    problem = None
    try:
        return workload.build(node, layout.dp, seq_len, cfg.payload.name in source.RECORDED)
    except workload.WorkloadError as exc:
        problem = str(exc)  # raised below, outside the except: one line, no context
    raise ConfigError(problem)


def _validate_recorded(payload, batch_size: int) -> source.PayloadSource:
    """The file exists, loads safely (or is trusted), has a leading batch dimension and fits
    ``payload.max_bytes`` at ``batch_size`` rows (the most any leader holds in one call of the
    workload): a recording is read once here (a
    schema checked whole and one row replayed), so a bad file stops the job before any rank
    starts."""
    if not payload.get("path"):
        raise ConfigError(f"payload.path: payload={payload.name} needs payload.path=<file>")
    problem = None
    try:
        return payload_of(payload, batch_size)
    except source.PayloadError as exc:
        problem = str(exc)  # raised below, outside the except: one line, no context
    raise ConfigError(problem)


def payload_of(payload, rows: int) -> source.PayloadSource:
    """The job's ``PayloadSource`` from its ``payload`` node, a recorded one read and checked
    once (``harness.payload.source.open_payload``) for ``rows`` rows per leader."""
    return source.open_payload(
        payload.name, payload.get("path"), bool(payload.get("trust", False)),
        check_max_bytes(payload), rows,
    )  # fmt: skip


def check_max_bytes(payload) -> int | None:
    """``payload.max_bytes``: a positive integer, or None for the machine's default."""
    max_bytes = payload.get("max_bytes")
    if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes < 1):
        raise ConfigError(f"payload.max_bytes must be a positive integer or null, got {max_bytes}")
    return max_bytes


def _validate_generated_size(payload, work) -> None:
    """Every leader's batches fit ``payload.max_bytes`` (``check_size``)."""
    shapes = per_leader(list(dict.fromkeys(work.period)), int(payload.seq_len))
    check_size(payload.name, shapes, payload.get("max_bytes"))


def per_leader(shapes, seq_len: int | None) -> list[list[tuple[int, int]]]:
    """Per replica leader, the (rows, seq_len) of each of a workload's distinct ``shapes``
    (``CallShape``; ``seq_len`` where a shape keeps the job's): what it builds before the
    first call."""
    return [
        [(s.rows[d], seq_len if s.seq_len is None else s.seq_len) for s in shapes]
        for d in range(len(shapes[0].rows))
    ]


DRIVER = "the driver (every global batch and its floor's flat copy)"
"""Who holds a dispatch job's batches: the driver builds each distinct shape's global batch
(every replica's rows) and the floor's flat bytes of it before the first call, and keeps both
(priced as two copies). The chunks each call cuts and puts into Ray's object store come and go
per call and are not counted."""


def check_size(
    name: str,
    per_leader: list[list[tuple[int, int]]],
    max_bytes: int | None,
    holder: str = "replica {d}'s leader",
    copies: int = 1,
) -> None:
    """The batches each holder builds (``per_leader[d]``: (rows, seq_len) of each, all built
    before the first call; ``copies`` of each) fit ``max_bytes`` together (None: a quarter of
    this machine's memory), priced from the shapes alone: 10**12 rows are refused in one line
    instead of failing to allocate petabytes on every rank."""
    limit = user_files.default_max_bytes() if max_bytes is None else int(max_bytes)
    where = "set" if max_bytes is not None else "a quarter of this machine's memory"
    for d, shapes in enumerate(per_leader):
        weights = [sizes.payload_bytes(name, rows, seq_len) for rows, seq_len in shapes]
        need = sum(weights) * copies
        if need <= limit:
            continue
        rows, seq_len = shapes[weights.index(max(weights))]
        what = f"of {rows} rows × {seq_len} tokens"
        if len(shapes) > 1:
            what = (
                f"in its {len(shapes)} shapes together (all built before the first call; the "
                f"largest {rows} rows × {seq_len} tokens)"
            )
        raise ConfigError(
            f"payload {name} {what} takes {need} bytes ({human_bytes(need)}) on "
            f"{holder.format(d=d)} > payload.max_bytes = {limit} ({human_bytes(limit)}; {where}); "
            "lower batch_size or seq_len (or the cycle entries that set them), or raise "
            "payload.max_bytes"
        )


def _validate_backend(cfg, layout: Layout) -> None:
    if cfg.backend.name not in ("gloo", "nccl"):
        raise ConfigError(f"backend.name must be gloo or nccl, got {cfg.backend.name!r}")
    if cfg.backend.device not in ("cpu", "cuda"):
        raise ConfigError(f"backend.device must be cpu or cuda, got {cfg.backend.device!r}")
    if cfg.backend.name == "nccl" and cfg.backend.device != "cuda":
        raise ConfigError("backend nccl carries CUDA tensors: set backend.device=cuda")
    if cfg.backend.device != "cuda":
        return
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise ConfigError("backend.device=cuda but no CUDA device is visible")
    if cfg.backend.name == "nccl" and gpus < layout.world_size:
        raise ConfigError(
            f"nccl needs one GPU per rank: world {layout.world_size} > {gpus} GPUs "
            "(NCCL refuses two ranks on one GPU; use backend=gloo_cuda to share one)"
        )


def ray_conf(cfg) -> RayConf:
    """The runtime ``RayConf`` of ``cfg.ray``, with the job's backend, device and timeout. A
    cluster the job starts itself (``address: local``) also advertises the CPUs the job's
    strategies' own actors reserve (``Strategy.actor_cpus``: a store's controller and storage
    units), so that no strategy needs ``ray.num_cpus`` raised to run."""
    conf = OmegaConf.to_container(cfg.ray, resolve=True)
    conf.update(backend=cfg.backend.name, device=cfg.backend.device, timeout_s=cfg.timeout_s)
    if conf.get("address", "local") == "local":
        conf["num_cpus"] = int(conf.get("num_cpus", 2)) + _actor_cpus(cfg)
    return RayConf(**conf)


def _actor_cpus(cfg) -> int:
    """The Ray CPUs the job's strategies' own actors reserve (each named strategy once),
    rounded up to whole CPUs (Ray advertises a cluster's CPUs whole)."""
    names = {cfg.strategy.name, *(cfg.references or ())}
    need = 0.0
    for name in names:
        try:
            need += strategies.get_class(name).actor_cpus
        except (KeyError, ValueError, ImportError):  # not a named strategy: nothing of its own
            continue
    return math.ceil(need)


def _validate_ray(cfg, joined: bool) -> RayConf:
    """``world=ray`` and ``ray.dispatch``: the values, where they can run, and Ray itself,
    checked before any cluster starts; the job's ``RayConf``."""
    if cfg.world not in ("forked", "ray"):
        raise ConfigError(f"world must be forked or ray, got {cfg.world!r}")
    try:
        conf = ray_conf(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.world != "ray":
        raise ConfigError(
            f"ray.dispatch={cfg.ray.dispatch} needs world=ray (dispatch goes through Ray)"
        )
    if joined or cfg.emulate.enabled:
        where = "emulate.enabled=true" if cfg.emulate.enabled else "a launched world (torchrun)"
        raise ConfigError(
            f"world=ray starts its own ranks as Ray actors; it cannot run under {where} "
            "(Ray on the emulated cluster: bcastbench run target=dispatch-emulated)"
        )
    if cfg.ray.dispatch != "none":
        _validate_dispatch(cfg)
    try:
        import_ray()
    except RayUnavailable as exc:
        raise ConfigError(f"world=ray: {exc}") from None
    return conf


def _validate_dispatch(cfg) -> None:
    if cfg.payload.name not in generated.PAYLOADS:
        raise ConfigError(
            f"ray.dispatch={cfg.ray.dispatch}: the driver generates the global batch, so the "
            f"payload must be one of {sorted(generated.PAYLOADS)}, got {cfg.payload.name!r}"
        )
    if cfg.fault.rank >= 0:
        raise ConfigError("fault injection runs on broadcast jobs only: set ray.dispatch=none")
    seq_len = int(cfg.payload.seq_len)
    work = workload_of(cfg, layout_of(cfg), seq_len)
    driver = [
        (sum(s.rows), seq_len if s.seq_len is None else s.seq_len)
        for s in dict.fromkeys(work.period)
    ]
    check_size(cfg.payload.name, [driver], check_max_bytes(cfg.payload), DRIVER, copies=2)
    if cfg.ray.dispatch == LEADER:
        try:
            DispatchMode.parse(f"{LEADER}:{strategy_of(cfg)}")
        except ValueError as exc:
            raise ConfigError(f"ray.dispatch=leader, strategy: {exc}") from None


def _validate_emulate(cfg, layout: Layout) -> None:
    """What a harness job adds to ``EmulateConf.check`` (the cluster's own values)."""
    conf = EmulateConf(**OmegaConf.to_container(cfg.emulate, resolve=True))
    if conf.bytes_calls < 0:
        raise ConfigError(f"emulate.bytes_calls must be >= 0, got {conf.bytes_calls}")
    per_node = layout.world_size // conf.nodes if conf.nodes >= 1 else 0
    if conf.ranks_per_node is not None and conf.ranks_per_node != per_node:
        raise ConfigError(
            f"emulate.ranks_per_node={conf.ranks_per_node} but world {layout.world_size} / "
            f"nodes {conf.nodes} = {per_node}"
        )
    try:
        conf.for_world(layout.world_size).check()
    except ValueError as exc:
        raise ConfigError(f"{exc} ({layout.describe()}): every node holds as many ranks") from None
    if cfg.backend.name != "gloo" or cfg.backend.device != "cpu":
        raise ConfigError(
            "emulate.enabled needs backend=gloo on cpu: the emulated links carry TCP, "
            f"got {cfg.backend.name}/{cfg.backend.device}"
        )


# -- a bcastbench ray-dispatch job (harness.commands.ray_dispatch.RayDispatchConf) -------------
def dispatch_ray_conf(cfg) -> RayConf:
    """The runtime ``RayConf`` of a ray-dispatch job: its ``ray`` node as it is (backend,
    device and timeout included)."""
    return RayConf(**OmegaConf.to_container(cfg.ray, resolve=True))


def dispatch_modes_of(cfg) -> list[DispatchMode]:
    """A ray-dispatch job's modes, parsed, its first the one under test."""
    if not cfg.modes:
        raise ConfigError("modes: name at least one dispatch mode, e.g. modes=[leader:header]")
    try:
        return [DispatchMode.parse(str(m)) for m in cfg.modes]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def validate_dispatch(cfg) -> None:
    """Every value a ray-dispatch job reads, checked before any job runs: a generated payload
    the driver can hold for every replica, counts in range, the modes (each family's floor
    added), the Ray settings, and Ray itself installed."""
    if cfg.payload.name not in generated.PAYLOADS:
        raise ConfigError(
            f"payload.name: {cfg.payload.name!r} is not generated; the driver builds the "
            f"global batch, valid: {sorted(generated.PAYLOADS)}"
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
        with_floors([str(m) for m in cfg.modes] if cfg.modes else ())
        conf = dispatch_ray_conf(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    dispatch_modes_of(cfg)
    if conf.dispatch != "none":
        raise ConfigError(
            f"ray.dispatch={conf.dispatch} is bcastbench run's setting; here modes= says what "
            "runs (leave ray.dispatch=none)"
        )
    try:
        import_ray()
    except RayUnavailable as exc:
        raise ConfigError(str(exc)) from None
