"""The job's configuration as Hydra composes it: one typed schema per config group (every field
with its docstring), the resolvers its YAML uses, and the shape's name in folders and records.
Light on purpose (no torch): a mistyped key is refused the moment the config composes, before
anything heavy loads; the values are checked by ``harness.job.config.validate``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

import strategies
from harness.paths import CONF_DIR
from harness.payload.sizes import sizes_for
from harness.worlds.emulated_network import EmulateConf
from harness.worlds.ray_cluster import RayConf
from strategies.core.layout import DEFAULT_ORDER, Layout, LayoutError

COMMAND: list[str] = []
"""The command line as its user typed it, when the command that parsed it changed ``sys.argv``
for Hydra (``harness.commands.run`` appends the sweep directory it claimed); empty: the
process's own ``sys.argv``. Records name it (``harness.job.records.environment``)."""


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


@dataclass
class StrategyConf:
    name: str = MISSING
    """Strategy module name under ``strategies/`` (see ``strategies.names()``)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of that strategy: the fields of its class's ``Options`` dataclass (or
    a plain ``__init__``'s keyword arguments), whose names are checked before any rank starts
    and whose values the dataclass checks where the strategy is built."""
    _target_: str | None = None
    """``strategy=custom``: a Strategy class by import path (``my_pkg.mod.MyStrategy``,
    Hydra's instantiate convention); it is what the job runs and records."""


def _node_type(hint):
    """OmegaConf has no ``Literal``: a choice among strings is a ``str`` in the schema, and the
    runtime type's own check (``__post_init__``, run by ``validate``) names the valid ones."""
    if get_origin(hint) is Literal and all(isinstance(a, str) for a in get_args(hint)):
        return str
    return hint


def _schema_of(runtime: type, name: str, doc: str) -> type:
    """A structured-config dataclass with the init fields of ``runtime`` (names, types,
    defaults), so the fields are written once, on the runtime type."""
    hints = get_type_hints(runtime)
    spec = [
        (f.name, _node_type(hints[f.name]), field(default=f.default))
        for f in fields(runtime)
        if f.init
    ]
    schema = make_dataclass(name, spec)
    schema.__doc__ = doc
    schema.__module__ = __name__
    return schema


LayoutConf = _schema_of(
    Layout,
    "LayoutConf",
    """The ``layout`` node: ``strategies.core.layout.Layout``'s own fields (dp, pp, tp, cp,
    order; their meaning is documented there), made into a schema by ``_schema_of``.

    Why not ``Layout`` itself as the schema: it is frozen, validates in ``__post_init__`` and
    derives ``tokens``, which OmegaConf would expose as one more (missing) config value; and it
    belongs to ``strategies``, which knows nothing of Hydra. Why not a second hand-written
    list: a field added to ``Layout`` must appear here with its type and default, so it is read
    from there. ``layout_of`` turns the node into the runtime ``Layout``.""",
)


RayNode = _schema_of(
    RayConf,
    "RayNode",
    """The ``ray`` node: ``harness.worlds.ray_cluster.RayConf``'s own fields (where the Ray cluster is,
    how ranks are placed, ``dispatch``; each documented there), read when ``world=ray``.""",
)


@dataclass
class PayloadConf:
    name: str = "rl_rollout"
    """Batch generator: rl_rollout | pretrain | multimodal (harness/payload/generated.py)."""
    batch_size: int = 8
    """B, the leading dimension of every tensor."""
    seq_len: int = 1024
    """S, tokens per sample; must divide by 2·cp (Megatron's zig-zag CP split)."""
    broadcast_non_tensor: bool | None = None
    """meta_info['_broadcast_non_tensor_batch']; null keeps the payload's default."""
    seed: int = 0
    """Replica r's leader generates its batch from seed + r."""
    path: str | None = None
    """payload=file: a recorded batch; payload=schema: a schema file, or the name of one in
    conf/schemas/ (harness/payload/recording.py, harness/payload/payload_schema.py)."""
    trust: bool = False
    """payload=file: allow arbitrary unpickling (only for a file you trust)."""
    max_bytes: int | None = None
    """The most bytes a replica leader's batches may take: a generated payload's every
    distinct shape together (a leader builds them all before the first call; priced by
    ``harness.payload.sizes.payload_bytes``), a recording's or a schema's batch from the file's
    sizes and shapes; ``bcastbench ray-dispatch``: the driver's global batch. Checked before
    anything is allocated. null: a quarter of this machine's physical memory
    (``harness.payload.user_files.default_max_bytes``)."""
    cycle: Any = None
    """Overrides of batch_size and seq_len (seq_len not for a recorded payload) cycled call
    by call, e.g. ``[{batch_size: 768}, {batch_size: 3}]``; the floor and pickled are timed on
    the same sequence, shape by shape. null: every call moves one shape
    (``harness.payload.workload``)."""
    cycle_file: str | None = None
    """A recorded sequence of shapes: a YAML list of entries as in ``cycle`` (instead of it)."""
    draws: int = 0
    """Seeded draws of the data cycled through (each cycle entry once per draw): a schema's
    jagged and string lengths are drawn anew from its recorded distributions for each, and
    dp_split=drawn draws a split for each. 0: one batch per shape."""
    dp_split: Any = "even"
    """Rows per replica leader (DP > 1): even (batch_size each) | a list of row counts, one per
    replica (the cycle's batch_size then does not apply) | drawn (batch_size·dp rows split at
    seeded random points, one split per draw)."""


@dataclass
class BackendConf:
    name: str = "gloo"
    """Process-group backend: gloo | nccl."""
    device: str = "cpu"
    """Where tensors live: cpu, or cuda (one GPU per rank for nccl; shared for gloo)."""


@dataclass
class FaultConf:
    """The config of ``harness.job.fault.Fault`` (which checks it)."""

    rank: int = -1
    """Rank that misbehaves (-1: none). For testing that failures are reported, not hung."""
    at_iter: int = 0
    """Timed iteration at which it does."""
    kind: str = "crash"
    """crash (the process exits) | hang (it stops answering) | raise (it raises, as a bug
    would) | delay (it spends ``delay_us`` more in every call of the strategy under test, from
    the first: a known regression, to prove a gate catches one) | oom (its address space is
    capped just above what it holds, so its next large allocation fails as on a host out of
    memory)."""
    delay_us: int = 0
    """fault.kind=delay: microseconds added to each of that rank's calls."""


@dataclass
class BenchConf:
    strategy: StrategyConf = field(default_factory=StrategyConf)
    """The strategy under test."""
    layout: LayoutConf = field(default_factory=LayoutConf)
    """Parallel shape of the world (world size = dp·pp·tp·cp)."""
    payload: PayloadConf = field(default_factory=PayloadConf)
    """What the leader holds."""
    backend: BackendConf = field(default_factory=BackendConf)
    """Transport and device."""
    iters: int = 20
    """Timed rounds; each round calls the strategy and every reference once, interleaved."""
    repeats: int = 1
    """Blocks of ``iters`` timed rounds, one after another in the job: each figure's interval
    covers the spread between the blocks as well as the rounds inside them."""
    warmup: int = 3
    """Untimed rounds first (allocations, the wire's first-call size, caches)."""
    time_budget_s: float | None = None
    """Seconds of timed calls each strategy may take in a job (pytest-benchmark's max_time):
    from its warm-up calls (the slowest rank's), a strategy gets budget / seconds per call
    timed rounds, at least ``MIN_ROUNDS`` (an interval needs them) and at most iters·repeats;
    a strategy whose rounds are spent sits out the rounds left, so its figures and ratios pair
    the rounds it shared with each other. null: every strategy every round. Constant
    workloads only."""
    floor_methods: list[str] | None = None
    """The floor's raw methods a job times beside one broadcast (always timed), by the suffix
    of their label: shm, chunks2, chunks4, seed_hops, pp_first (``strategies.floor.VARIANTS``);
    a method the layout does not allow is left out. null: every one the layout allows. A
    sweep whose every call costs a gigabyte names the few that can be its floor there."""
    steady_iters: int = 0
    """A varying workload (payload.cycle, draws, dp_split): after the sequence, this many
    interleaved rounds of each distinct shape alone, for each shape's steady-state p50 in the
    record (``shapes[].steady_p50_us``, ``vs_steady``). 0: none."""
    timeout_s: float = 120.0
    """A rank silent this long fails the job (named); gloo's own timeout sits just past it."""
    references: list[str] = field(default_factory=lambda: ["floor", "pickled"])
    """Measured in the same job for vs_floor and vs_baseline (pickled is the baseline)."""
    record_each: bool = False
    """Every strategy of ``references`` gets a record of its own too, each with the others as
    its references (``<job dir>/<strategy>/result.json``): a sweep that lists them all times
    them side by side in one job per cell, so every cross-strategy ratio is a same-job ratio."""
    fault: FaultConf = field(default_factory=FaultConf)
    """Fault injection (tests)."""
    world: str = "forked"
    """Who runs the ranks when this process launches them: ``forked`` (local processes,
    ``harness.worlds.forked``) | ``ray`` (Ray actors in a placement group, ``harness.worlds.ray_world``;
    needs the optional ``ray`` package). A world a launcher started (torchrun, Slurm) is
    joined whatever this says, and must leave it ``forked``."""
    ray: RayNode = field(default_factory=RayNode)
    """The Ray world (``world=ray``): cluster address, placement, and ``ray.dispatch``."""
    emulate: EmulateConf = field(default_factory=EmulateConf)
    """Emulated multi-node cluster (off by default). Its own key, apart from the cost model's
    ``cluster`` group: this one runs the job, that one predicts it."""


def selectable_strategies() -> str:
    """``${bcastbench.strategies:}`` in a sweep's params: every strategy a user can choose
    (``strategies.names()``), so a named sweep covers a new strategy with no YAML to edit, and
    never the floor (every job's reference) nor a config entry that is not a strategy. Named
    sweeps run on the forked world: a strategy that needs another (``world=ray``) or an
    optional package not installed is left out (``strategies.names_for_world``)."""
    return ",".join(strategies.names_for_world())


def every_strategy() -> list[str]:
    """``${bcastbench.every_strategy:}`` as a job's ``references``: the floor and every
    strategy a user can choose that runs on the forked world, to time side by side in one job
    (``record_each``); a ``world=ray`` job names its Ray-only references itself."""
    return ["floor", *strategies.names_for_world()]


def size_range(begin, end, factor, name="rl_rollout", seq_len=512) -> str:
    """``${bcastbench.sizes:64K,16M,4}`` in a sweep's ``payload.batch_size``: nccl-tests'
    ``-b 64K -e 16M -f 4``, one job per size, as the batch sizes of ``name`` at ``seq_len``
    (``${bcastbench.sizes:64K,16M,4,${payload.name},${payload.seq_len}}`` for the job's own)
    whose payload is nearest each size; the record's ``payload_bytes`` is the exact one."""
    return ",".join(str(rows) for rows in sizes_for(str(name), int(seq_len), begin, end, factor))


def shape_name(layout_node) -> str:
    """``${bcastbench.layout:${layout}}`` in run folder names: the shape that runs
    (``layout=tp2pp2 layout.tp=8 layout.pp=8`` is ``tp8pp8``, not the preset's name). A layout
    that is not valid yet names itself ``invalid-layout``; ``validate`` says why before
    anything is written there."""
    try:
        return layout_name(Layout(**OmegaConf.to_container(layout_node, resolve=True)))
    except (LayoutError, TypeError, ValueError):
        return "invalid-layout"


def register() -> None:
    """The job schema in Hydra's ConfigStore, and the resolver named sweeps list strategies with."""
    cs = ConfigStore.instance()
    cs.store(name="bench_schema", node=BenchConf)
    OmegaConf.register_new_resolver("bcastbench.strategies", selectable_strategies, replace=True)
    OmegaConf.register_new_resolver("bcastbench.layout", shape_name, replace=True)
    OmegaConf.register_new_resolver("bcastbench.every_strategy", every_strategy, replace=True)
    OmegaConf.register_new_resolver("bcastbench.sizes", size_range, replace=True)
    _register_installed_strategies(cs)


def _register_installed_strategies(cs: ConfigStore) -> None:
    """``strategy=<name>`` for every registered strategy without a YAML entry (those installed
    through the ``bcastbench.strategies`` entry point): Hydra finds config-group options in the
    ConfigStore as in ``conf/strategy/``."""
    for name in strategies.installed_names():
        if not (CONF_DIR / "strategy" / f"{name}.yaml").exists():
            cs.store(group="strategy", name=name, node=StrategyConf(name=name))
