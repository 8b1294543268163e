"""Predicted broadcast latency from 8 to 16,384 GPUs: ``bcastbench predict target=scale``.

    bcastbench predict target=scale [cluster=h200_ib] [layout.tp=8] [layout.cp=1]
        [layout.pp=8] [payload.batch_size=512] [cluster.memcpy_gbytes_per_s=...] [max_world=...]

A Hydra app (``conf/commands/extrapolate.yaml``) on the same ``cluster/``, ``layout/`` and
``payload/`` groups as ``harness.commands.predict``. Nothing runs: every strategy's plan is priced
by ``strategies.core.pricing`` (via ``harness.model.prices``) for a fixed payload (default
rl_rollout, B=512, S=4096, an RL step's global batch slice per replica) on layouts tp × cp inside a
node, pp ∈ {1, 2, 4, …, layout.pp} stages and dp filling the world. Writes ``extrapolation.csv``,
``extrapolation.png`` and ``extrapolation.md`` (a recommendation table), all labelled PREDICTED,
into the job directory (``results/predict/extrapolation``).

It also answers the SC'21 question (Narayanan et al., the scatter/gather optimisation of
Megatron's pipeline): once PP stages sit on different nodes and TP inside one, does
scatter_allgather (each TP rank carries 1/t across the slow link, then an NVLink all-gather)
overtake a plain broadcast (header, flat, pickled)? It reports the smallest pp and world size
at which it does, for the whole call and for its network part alone (the whole call includes
host packing, priced at the preset's pack/copy rate).
"""

from __future__ import annotations

import datetime
import logging
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

import strategies
from harness import paths
from harness.commands import emulated_table as table
from harness.commands.hydra_app import run_app
from harness.commands.predict import check as check_prediction
from harness.commands.predict import scaled_spec
from harness.errors import ConfigError, program
from harness.files import write_atomic, write_csv, write_figure
from harness.job.config_schema import LayoutConf, PayloadConf
from harness.model import memory
from harness.model.prices import predict_all
from harness.units import human_bytes
from strategies.core.cluster import ClusterConf, load_cluster
from strategies.core.layout import Layout

# Megatron's import-time warnings say nothing about a price (a strategy may import it).
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron.*")
logging.getLogger("megatron").setLevel(logging.WARNING)

MODULE = "harness.commands.extrapolate"
"""Where this command lives; its printed name comes from ``harness.errors.program``."""
EMULATED_RECORDS = paths.REPO / "results" / "reference_emulated"
"""Where ``harness.commands.emulated_table`` keeps its committed emulated-cluster records."""
PLAIN = ("header", "flat", "pickled")  # the "plain broadcast" side of the SC'21 comparison
MIN_WORLD, MAX_WORLD = 8, 16384


def layouts(tp: int, cp: int, pps: list[int], max_world: int = MAX_WORLD):
    """(world, Layout) for every power-of-two world from 8 to ``max_world`` that tp·cp·pp
    divides, dp filling it."""
    world = MIN_WORLD
    while world <= max_world:
        for pp in pps:
            per_replica = tp * cp * pp
            if world % per_replica == 0:
                yield world, Layout(dp=world // per_replica, pp=pp, tp=tp, cp=cp)
        world *= 2


def sweep(cluster, spec, tp: int, cp: int, pps: list[int], max_world: int) -> pd.DataFrame:
    """One row per (world, pp, strategy) with predicted seconds and the dominant term."""
    rows = []
    payload = spec.sent_bytes
    for world, layout in layouts(tp, cp, pps, max_world):
        node = memory.busiest_node(layout, cluster.gpus_per_node)
        for name, p in predict_all(layout, spec, cluster).items():
            if isinstance(p, str):
                continue  # unsupported (tensordict_broadcast at dp > 1)
            footprint = strategies.get_class(name).footprint
            rows.append(
                dict(
                    world_size=world,
                    dp=layout.dp,
                    pp=layout.pp,
                    tp=layout.tp,
                    cp=layout.cp,
                    strategy=name,
                    predicted_ms=p.total_s * 1e3,
                    predicted_comm_ms=p.comm_s * 1e3,
                    predicted_local_ms=p.local_s * 1e3,
                    predicted_inter_ms=p.inter_s * 1e3,
                    dominant=p.dominant(),
                    node_copies=footprint.node_copies(node.leaders, node.receivers),
                    node_peak_bytes=memory.strategy_need(footprint, node, payload),
                )
            )
    return pd.DataFrame(rows)


def crossover(df: pd.DataFrame, column: str) -> dict:
    """Where scatter_allgather first beats the best plain broadcast on ``column``."""
    out = {"column": column, "pp": None, "world_size": None, "rows": []}
    for (pp, world), g in df.groupby(["pp", "world_size"], sort=True):
        g = g.set_index("strategy")[column]
        if "scatter_allgather" not in g:
            continue
        plain = g[[s for s in PLAIN if s in g]]
        best_plain = plain.idxmin()
        ratio = g["scatter_allgather"] / plain.min()
        out["rows"].append(dict(pp=pp, world_size=world, best_plain=best_plain, ratio=ratio))
    wins = [r for r in out["rows"] if r["ratio"] < 1]
    if wins:
        first = min(wins, key=lambda r: (r["pp"], r["world_size"]))
        out.update(pp=first["pp"], world_size=first["world_size"])
    return out


def size_crossover(cluster, payload: str, seq_len: int, tp: int, cp: int, pp: int, top: int):
    """Smallest B (powers of two up to ``top``) at which scatter_allgather beats the best plain
    broadcast at this pp (smallest world: dp=1), on the whole call and on the network part."""
    layout = Layout(pp=pp, tp=tp, cp=cp)
    found: dict[str, tuple[int, int] | None] = {"total_s": None, "comm_s": None}
    b = 1
    while b <= top and None in found.values():
        spec = scaled_spec(payload, b, seq_len)
        preds = predict_all(layout, spec, cluster, [*PLAIN, "scatter_allgather"])
        for attr in found:
            best_plain = min(getattr(preds[s], attr) for s in PLAIN)
            if found[attr] is None and getattr(preds["scatter_allgather"], attr) < best_plain:
                found[attr] = (b, spec.tensor_bytes)
        b *= 2
    return found


def emulated_check(root: Path = EMULATED_RECORDS) -> list[str]:
    """The emulated-cluster records under ``root`` (tp=2 inside a node, pp=2 across a shaped
    link, written by ``bcastbench validate target=emulated``) beside what the model predicts for
    them: the one place the SC'21 effect is measured rather than predicted."""
    try:
        rows = table.compare(root)
    except FileNotFoundError as exc:
        made_by = "`bcastbench validate target=emulated` makes them"
        return [f"(no emulated-cluster records: {exc}; {made_by})"]
    lines = [
        "| cluster | strategy | measured p50 ms | PREDICTED ms | pred/meas |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['strategy']} | {r['measured_ms']:.0f} | "
            f"{r['predicted_ms']:.0f} | {r['predicted_ms'] / r['measured_ms']:.2f} |"
        )
    return lines


def sc21_sentence(cross: dict, cluster, label: str) -> str:
    rows = cross["rows"]
    by_pp = {}
    for r in rows:
        by_pp.setdefault(r["pp"], []).append(r["ratio"])
    ratios = ", ".join(
        f"pp={pp}: {min(v):.2f}–{max(v):.2f}×" if min(v) != max(v) else f"pp={pp}: {v[0]:.2f}×"
        for pp, v in sorted(by_pp.items())
    )
    if cross["pp"] is None:
        return (
            f"{label}: scatter_allgather never beats the best plain broadcast on {cluster.name} "
            f"(its time / best plain: {ratios})."
        )
    return (
        f"{label}: scatter_allgather overtakes the best plain broadcast from pp={cross['pp']} "
        f"(smallest world {cross['world_size']} GPUs) on {cluster.name} "
        f"(its time / best plain: {ratios}; < 1 = scatter_allgather faster)."
    )


def size_lines(sizes: dict, payload: str, seq_len: int, batch_size: int) -> list[str]:
    lines = []
    for pp, found in sizes.items():
        parts = []
        for attr, label in (("total_s", "whole call"), ("comm_s", "network part")):
            hit = found[attr]
            parts.append(
                f"{label} from B={hit[0]} ({hit[1] / 2**20:.3g} MiB)"
                if hit
                else f"{label}: not up to B={4 * batch_size}"
            )
        lines.append(
            f"Payload-size crossover at pp={pp}, dp=1 ({payload}, S={seq_len}): scatter_allgather "
            f"wins the {'; the '.join(parts)}."
        )
    return lines


def plot(df: pd.DataFrame, path: Path, title: str, pps: list[int]) -> None:
    """Row 1: the whole call; row 2: its network part (where the SC'21 effect shows), per pp."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pps = [pp for pp in pps if pp in set(df.pp)]
    fig, axes = plt.subplots(
        2, len(pps), figsize=(4.2 * len(pps) + 2, 8), sharey="row", squeeze=False
    )
    marks = "osD^v<>ph*"
    styles = {s: marks[i % len(marks)] + "-" for i, s in enumerate(sorted(df.strategy.unique()))}
    for row, (col, what) in enumerate(
        (("predicted_ms", "whole call"), ("predicted_comm_ms", "network part"))
    ):
        for ax, pp in zip(axes[row], pps):
            g = df[df.pp == pp]
            for s, gs in g.groupby("strategy"):
                style = "k--" if s == "floor" else styles[s]
                ax.plot(gs.world_size, gs[col], style, label=s, ms=4, lw=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"pp={pp}, {what}", fontsize=10)
            ax.grid(True, which="both", lw=0.3)
            if row == 1:
                ax.set_xlabel("world size (GPUs)")
        axes[row][0].set_ylabel(f"PREDICTED {what} (ms)")
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    write_figure(path, fig, dpi=110)
    plt.close(fig)


def recommendation(df: pd.DataFrame) -> list[str]:
    lines = [
        "| pp | world sizes (GPUs) | PREDICTED best | ms | runner-up | × | best plain broadcast | "
        "ms | scatter_allgather ms (network part) | dominant term of best |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pp, g in df[df.strategy != "floor"].groupby("pp"):
        # Winners per world; runs of equal winners are merged (replicas do not interact when
        # tp·cp fills whole nodes, so dp rarely changes the answer).
        for world, gw in g.groupby("world_size"):
            gw = gw.sort_values("predicted_ms")
            plain = gw[gw.strategy.isin(PLAIN)].iloc[0]
            sag = gw[gw.strategy == "scatter_allgather"].iloc[0]
            best, second = gw.iloc[0], gw.iloc[1]
            lines.append(
                f"| {pp} | {world} | {best.strategy} | {best.predicted_ms:.3g} | "
                f"{second.strategy} | {second.predicted_ms / best.predicted_ms:.2f} | "
                f"{plain.strategy} | {plain.predicted_ms:.3g} | {sag.predicted_ms:.3g} "
                f"({sag.predicted_comm_ms:.3g}) | {best.dominant} |"
            )
    return _merge_runs(lines)


def _merge_runs(lines: list[str]) -> list[str]:
    """Collapse consecutive rows that differ only in the world size into one range row."""
    out = lines[:2]
    prev_key, first_world, last = None, None, None
    for line in lines[2:] + [None]:
        if line is not None:
            cells = line.split(" | ")
            key = (cells[0], *cells[2:])
        if line is None or key != prev_key:
            if last is not None:
                cells = last.split(" | ")
                world = cells[1] if first_world == cells[1] else f"{first_world}–{cells[1]}"
                out.append(" | ".join([cells[0], world, *cells[2:]]))
            if line is None:
                break
            prev_key, first_world = key, line.split(" | ")[1]
        last = line
    return out


def _markdown(cluster: ClusterConf, title: str, sentences, sizes, spec_args, df) -> str:
    payload, seq_len, batch_size = spec_args
    return "\n".join(
        [
            f"# PREDICTED broadcast latency vs world size — {cluster.name}",
            "",
            f"**PREDICTED by the α–β cost model (`strategies/core/pricing.py`), not measured.** "
            f"{title}. Generated {datetime.date.today().isoformat()} by `{program(MODULE)} "
            f"cluster={cluster.name}`.",
            "",
            "## SC'21: does scatter_allgather overtake a plain broadcast?",
            "",
            *[f"- {s}" for s in sentences],
            *[f"- {line}" for line in size_lines(sizes, payload, seq_len, batch_size)],
            "- World size matters only through dp; with tp·cp filling whole nodes DP replicas "
            "share no node and no NIC, so every world of a given pp predicts the same time: the "
            "crossover is in pp (and payload size), not in world size.",
            "",
            "### Check against the measured emulated cluster (whole call, tp=2 × pp=2)",
            "",
            *emulated_check(),
            "",
            "## Recommendation (PREDICTED)",
            "",
            *recommendation(df),
            "",
            "## Host memory on a node (PREDICTED)",
            "",
            *memory_lines(df, cluster),
            "",
        ]
    )


def memory_lines(df: pd.DataFrame, cluster: ClusterConf) -> list[str]:
    """Each strategy's copies of the batch and bytes on the busiest node of the largest world
    (``harness.model.memory``): what a node's host memory must hold for it."""
    top = df[df["world_size"] == df["world_size"].max()]
    top = top.sort_values("node_peak_bytes").drop_duplicates("strategy")
    lines = [
        f"Copies of one replica's batch on a node of {cluster.gpus_per_node} ranks at a call's "
        "peak (the leader's own included; shared memory once), from each strategy's measured "
        "footprint:",
        "",
        "| strategy | copies | node peak |",
        "| :--- | ---: | ---: |",
    ]
    lines += [
        f"| {r.strategy} | {r.node_copies:.1f} | {human_bytes(r.node_peak_bytes)} |"
        for r in top.itertuples()
    ]
    return lines


def run(
    cluster: str | ClusterConf = "h200_ib",
    out: Path | str = "results/predict/extrapolation",
    payload: str = "rl_rollout",
    batch_size: int = 512,
    seq_len: int = 4096,
    tp: int = 8,
    cp: int = 1,
    pps: tuple[int, ...] = (1, 2, 4, 8),
    max_world: int = MAX_WORLD,
    quiet: bool = False,
) -> dict:
    """Price every strategy on every world, find the crossovers, write csv, png and md."""
    t0 = time.perf_counter()
    cluster = load_cluster(cluster) if isinstance(cluster, str) else cluster
    spec = scaled_spec(payload, batch_size, seq_len)
    df = sweep(cluster, spec, tp, cp, list(pps), max_world)
    total = crossover(df, "predicted_ms")
    comm = crossover(df, "predicted_comm_ms")
    sizes = {pp: size_crossover(cluster, payload, seq_len, tp, cp, pp, 4 * batch_size)
             for pp in pps if pp > 1}  # fmt: skip
    out = Path(out)
    title = (
        f"PREDICTED (cost model, not measured): cluster {cluster.name} "
        f"({cluster.gpus_per_node} GPUs, {cluster.nics_per_node} NICs per node, pack/copy "
        f"{cluster.pack_copy_bytes_per_s / 1e9:.3g} GB/s), {payload} B={batch_size} "
        f"S={seq_len} ({spec.tensor_bytes / 2**20:.3g} MiB), tp={tp} cp={cp}, dp fills the world"
    )
    write_csv(out / "extrapolation.csv", df)
    plot(df, out / "extrapolation.png", title, list(pps))
    sentences = [
        sc21_sentence(total, cluster, "Whole call"),
        sc21_sentence(comm, cluster, "Network part only (local packing excluded)"),
    ]
    md = _markdown(cluster, title, sentences, sizes, (payload, seq_len, batch_size), df)
    write_atomic(out / "extrapolation.md", md)
    elapsed = time.perf_counter() - t0
    if not quiet:
        print(md)
        print(f"-> {out}/extrapolation.{{csv,png,md}} in {elapsed:.1f} s")
    return dict(
        table=df, total=total, comm=comm, sizes=sizes, sentences=sentences, elapsed_s=elapsed
    )


@dataclass
class ExtrapolateConf:
    """Root config of ``conf/commands/extrapolate.yaml``."""

    layout: LayoutConf = field(default_factory=LayoutConf)
    """tp and cp: the shape inside a node; pp: the deepest pipeline (1, 2, 4, … up to it are
    priced); dp is ignored (it fills each world)."""
    payload: PayloadConf = field(default_factory=PayloadConf)
    """The batch each replica's leader holds (sized, never built at full size)."""
    cluster: ClusterConf = field(default_factory=ClusterConf)
    """Machine room to price on; ``conf/cluster/``."""
    max_world: int = MAX_WORLD
    """Largest world priced; worlds are powers of two from 8."""
    quiet: bool = False
    """Write the files, print only where they are."""


def pipeline_depths(max_pp: int) -> tuple[int, ...]:
    """1, 2, 4, … up to ``max_pp`` (and ``max_pp`` itself when it is not a power of two)."""
    out = [1]
    while out[-1] * 2 <= max_pp:
        out.append(out[-1] * 2)
    return tuple(dict.fromkeys([*out, max_pp]))


def check(cfg) -> None:

    check_prediction(cfg)
    per_replica = cfg.layout.tp * cfg.layout.cp
    if cfg.max_world < MIN_WORLD or cfg.max_world < per_replica:
        raise ConfigError(
            f"max_world must be >= {MIN_WORLD} and >= layout.tp·cp = {per_replica}, "
            f"got {cfg.max_world}"
        )


def task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    run(
        OmegaConf.to_object(cfg.cluster),  # type: ignore[arg-type]
        HydraConfig.get().runtime.output_dir,
        cfg.payload.name,
        cfg.payload.batch_size,
        cfg.payload.seq_len,
        cfg.layout.tp,
        cfg.layout.cp,
        pipeline_depths(cfg.layout.pp),
        cfg.max_world,
        cfg.quiet,
    )


def main(argv: list[str] | None = None) -> int:
    """``bcastbench predict target=scale [overrides]``; a bad value exits 2 with one line."""
    return run_app(MODULE, "extrapolate", task, check, argv, schema=ExtrapolateConf)


if __name__ == "__main__":
    sys.exit(main())
