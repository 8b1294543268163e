"""Turn a run or sweep directory into ``report.md`` and PNG figures written beside the records.

    python -m harness.report.build results/bench/<dir>

The plotting functions take the table from ``load`` and return a matplotlib ``Figure``;
``notebooks/analysis.ipynb`` calls the same functions, so the notebook and the report agree.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from harness.report import collect

BASELINE = "pickled"
"""Every job times this beside the strategy under test; speedups are over it."""
FLOOR = "floor"
TIE_FRACTION = 0.10
"""Two strategies whose vs_floor differ by less than this are called a tie: on 2 shared
cores a job's p50 moves by about this much from one run to the next."""
FIGURES = {
    "latency": "latency_p50_vs_payload.png",
    "speedup": "speedup_over_pickled.png",
    "overhead": "overhead_over_floor.png",
    "algbw": "algbw_vs_payload.png",
}
CAVEAT = (
    "Every ratio (`vs_floor`, `vs_baseline`, speedup over `pickled`) is measured inside one job: "
    "the strategy, the floor and `pickled` run interleaved in the same world, so machine noise "
    "hits all three alike. Absolute times are noisy: this machine has 2 cores shared with other "
    "work, and a 4- or 8-rank gloo world on it is CPU-bound. Compare ratios, not absolute times "
    "across jobs or runs."
)
_MARKERS = "osD^v<>Ph*Xp"


# -- the table ------------------------------------------------------------------------------
def load(root: Path | str) -> pd.DataFrame:
    """Every record under ``root`` (``collect.load``), with the columns the report needs."""
    df = collect.load(root)
    if df.empty:
        return df
    if "supported" not in df.columns:
        df["supported"] = True
    df["supported"] = df["supported"].fillna(True).astype(bool)
    if "error" not in df.columns:
        df["error"] = None
    # A refused job has no payload_bytes of its own; the same payload spec elsewhere has it.
    key = ["payload", "batch_size", "seq_len"]
    if "payload_bytes" not in df.columns:
        df["payload_bytes"] = np.nan
    known = df.dropna(subset=["payload_bytes"]).groupby(key)["payload_bytes"].max()
    missing = df["payload_bytes"].isna()
    if missing.any():
        df.loc[missing, "payload_bytes"] = [
            known.get(tuple(row), np.nan) for row in df.loc[missing, key].itertuples(index=False)
        ]
    for col in ("p50_us", "p90_us", "floor_p50_us", "vs_floor", "vs_baseline", "algbw_gbps"):
        # Refused rows (and jobs run without a reference) leave gaps: make them NaN, not None.
        df[col] = pd.to_numeric(df[col], errors="coerce") if col in df.columns else np.nan
    df["speedup_over_pickled"] = 1.0 / df["vs_baseline"]
    return df


def layouts_of(df: pd.DataFrame) -> list[str]:
    """Layouts in a stable order: smaller worlds first, then by name."""
    return list(df.sort_values(["world_size", "layout"])["layout"].drop_duplicates())


def strategies_of(df: pd.DataFrame) -> list[str]:
    return sorted(df["strategy"].unique())


def strategy_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (layout, strategy, payload_bytes): medians over the jobs that measured it.

    Unsupported combinations keep a row with ``supported`` False and their ``error``.
    """
    cols = ["p50_us", "p90_us", "vs_floor", "vs_baseline", "algbw_gbps", "speedup_over_pickled"]
    key = ["layout", "strategy", "payload_bytes"]
    ok = df[df["supported"]]
    measured = ok.groupby(key, as_index=False).agg(
        **{c: (c, "median") for c in cols if c in ok.columns}, n_jobs=("strategy", "size")
    )
    measured["supported"] = True
    measured["error"] = None
    refused = df[~df["supported"]].drop_duplicates(key)[[*key, "error"]].copy()
    refused["supported"] = False
    refused["n_jobs"] = 0
    out = pd.concat([measured, refused], ignore_index=True)
    return out.sort_values(key).reset_index(drop=True)


def floor_table(df: pd.DataFrame) -> pd.DataFrame:
    """The floor per (layout, payload_bytes): every job measures it, so take the median over
    the jobs and keep how many there were (``n_jobs``)."""
    ok = df[df["supported"] & df["floor_p50_us"].notna()]
    agg = {"floor_p50_us": ("floor_p50_us", "median"), "n_jobs": ("floor_p50_us", "size")}
    if "ref_floor_p90_us" in ok.columns:
        agg["floor_p90_us"] = ("ref_floor_p90_us", "median")
    out = ok.groupby(["layout", "payload_bytes"], as_index=False).agg(**agg)
    out["floor_algbw_gbps"] = out["payload_bytes"] / (out["floor_p50_us"] / 1e6) / 1e9
    return out


# -- labels ---------------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    """Binary units, as the sweep names its sizes (69 KiB, 2.9 MiB)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "?"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


def _unique(df: pd.DataFrame, col: str) -> str:
    if col not in df.columns:
        return "?"
    # NaN in refused rows turns integer columns into floats: print 8, not 8.0.
    values = sorted({f"{v:g}" if isinstance(v, float) else str(v) for v in df[col].dropna()})
    return ", ".join(values) if values else "?"


def run_dates(df: pd.DataFrame) -> str:
    if "timestamp" not in df.columns:
        return "?"
    days = sorted({str(t)[:10] for t in df["timestamp"].dropna()})
    if not days:
        return "?"
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def context_line(df: pd.DataFrame) -> str:
    """Backend, device, machine and date: the line under every figure's title."""
    payload = _unique(df, "payload")
    seq = _unique(df, "seq_len")
    iters = _unique(df, "iters")
    return (
        f"backend {_unique(df, 'backend')}, device {_unique(df, 'device')}, "
        f"machine {_unique(df, 'hostname')}, {run_dates(df)}; "
        f"payload {payload} (seq_len {seq}), {iters} timed iterations per job"
    )


def layout_label(df: pd.DataFrame, layout: str) -> str:
    row = df[df["layout"] == layout].iloc[0]
    dims = " × ".join(f"{a}{int(row[a])}" for a in ("dp", "pp", "tp", "cp") if int(row[a]) > 1)
    return f"{layout}: {int(row['world_size'])} ranks ({dims or 'one rank'})"


def _panel_title(df: pd.DataFrame, floors: pd.DataFrame, layout: str) -> str:
    n = floors.loc[floors["layout"] == layout, "n_jobs"]
    if n.empty:
        return layout_label(df, layout)
    jobs = f"{int(n.min())}" if n.min() == n.max() else f"{int(n.min())}-{int(n.max())}"
    return f"{layout_label(df, layout)}\nfloor = median of {jobs} jobs' floors per size"


def clean_reason(error: str | None) -> str:
    """A refusal without the repeated 'name: rank k: name:' prefix the runner adds."""
    return re.sub(r"^(\w+: )?(rank \d+: )?(\w+: )?", "", str(error or "refused")).strip()


def _styles(names: Iterable[str]) -> dict[str, dict]:
    """One colour and marker per strategy, the same in every figure of a report."""
    palette = matplotlib.colormaps["tab10"].colors
    return {
        name: {"color": palette[i % len(palette)], "marker": _MARKERS[i % len(_MARKERS)]}
        for i, name in enumerate(sorted(names))
    }


def _bytes_axis(ax, sizes: Iterable[float]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    ax.set_xticks(ticks)
    ax.set_xticklabels([human_bytes(s) for s in ticks], rotation=30, ha="right")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("payload (bytes, log scale)")
    if len(ticks) > 1:
        ax.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.4)


def _log_y(ax, label: str) -> None:
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    # Short ranges get more labelled ticks, so every line sits near a number.
    subs = (1.0, 2.0, 3.0, 5.0) if high / max(low, 1e-12) < 20 else (1.0, 2.0, 5.0)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=20))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel(label)
    ax.grid(True, which="major", alpha=0.3)


def _panels(df: pd.DataFrame, title: str, max_cols: int = 3) -> tuple[Figure, list]:
    layouts = layouts_of(df)
    ncols = min(max_cols, len(layouts))
    nrows = math.ceil(len(layouts) / ncols)
    # At least 11 inches wide: the two-line title and the shared legend must fit one panel.
    width = max(11.0, 5.2 * ncols + 0.6)
    fig = Figure(figsize=(width, 4.3 * nrows + 1.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(layouts) :]:
        ax.set_visible(False)
    fig.suptitle(f"{title}\n{context_line(df)}", fontsize=11)
    return fig, list(zip(layouts, axes[: len(layouts)]))


def _refused(table: pd.DataFrame) -> str:
    """A title line naming the strategies that refuse this layout (drawn as no line at all)."""
    refused = sorted(table.loc[~table["supported"], "strategy"].unique())
    if not refused:
        return ""
    return "\nn/a (refuses this layout, see report.md): " + ", ".join(refused)


def _legend(fig: Figure, axes_pairs) -> None:
    handles, labels = {}, []
    for _, ax in axes_pairs:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend(
        [handles[lab] for lab in labels],
        labels,
        loc="outside lower center",
        ncols=min(5, len(labels)),
        fontsize=8.5,
        frameon=False,
    )


# -- figures --------------------------------------------------------------------------------
def plot_latency(df: pd.DataFrame) -> Figure:
    """(a) p50 latency with a p50..p90 band vs payload, log-log, one panel per layout; the
    floor is its own black line (median of the floors measured by every job at that size)."""
    table, floors = strategy_table(df), floor_table(df)
    styles = _styles(strategies_of(df))
    fig, pairs = _panels(df, "Latency per call (p50, band up to p90) vs payload size")
    for layout, ax in pairs:
        tab = table[(table["layout"] == layout) & table["supported"]]
        for name in strategies_of(df):
            rows = tab[tab["strategy"] == name].sort_values("payload_bytes")
            if rows.empty:
                continue
            x, p50, p90 = rows["payload_bytes"], rows["p50_us"] / 1e3, rows["p90_us"] / 1e3
            ax.plot(x, p50, label=name, lw=1.6, ms=5, **styles[name])
            ax.fill_between(x, p50, p90, color=styles[name]["color"], alpha=0.12, lw=0)
        _floor_line(ax, floors, layout, "floor_p50_us", scale=1e-3)
        _bytes_axis(ax, table.loc[table["layout"] == layout, "payload_bytes"].dropna())
        _log_y(ax, "latency per call (ms, log scale): line p50, band p50 to p90")
        refused = _refused(table[table["layout"] == layout])
        ax.set_title(_panel_title(df, floors, layout) + refused, fontsize=10)
    _legend(fig, pairs)
    return fig


def plot_speedup(df: pd.DataFrame) -> Figure:
    """(b) Speedup over ``pickled`` (1 / vs_baseline, same job) as a layouts × payload heatmap
    per strategy; grey cells are layouts the strategy refuses (n/a)."""
    table = strategy_table(df)
    names = [n for n in strategies_of(df) if n != BASELINE]
    layouts = layouts_of(df)
    sizes = sorted(table["payload_bytes"].dropna().unique())
    ncols = min(4, max(1, len(names)))
    nrows = math.ceil(len(names) / ncols)
    fig = Figure(
        figsize=(
            max(3.2, 1.05 * len(sizes) + 1.6) * ncols + 1.2,
            (0.55 * len(layouts) + 1.5) * nrows + 1.4,
        ),
        layout="constrained",
    )
    fig.suptitle(
        "Speedup over pickled (p50 of pickled / p50 of the strategy, both timed in the same job;"
        " >1 = faster; pickled itself is 1× by definition)\n" + context_line(df),
        fontsize=11,
    )
    if not sizes or not names:
        fig.text(0.5, 0.5, "no supported records to compare", ha="center", va="center")
        return fig
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    log2 = np.log2(table.loc[table["supported"], "speedup_over_pickled"].dropna())
    span = max(1.0, float(np.abs(log2).max()) if len(log2) else 1.0)
    norm = TwoSlopeNorm(vmin=-span, vcenter=0.0, vmax=span)
    image = None
    for ax, name in zip(axes, names):
        grid = np.full((len(layouts), len(sizes)), np.nan)
        refused = np.zeros_like(grid, dtype=bool)
        tab = table[table["strategy"] == name]
        for row in tab.itertuples(index=False):
            if row.layout not in layouts or row.payload_bytes not in sizes:
                continue
            i, j = layouts.index(row.layout), sizes.index(row.payload_bytes)
            if row.supported:
                grid[i, j] = row.speedup_over_pickled
            else:
                refused[i, j] = True
        ax.set_facecolor("0.85")
        image = ax.imshow(np.log2(grid), cmap="RdBu", norm=norm, aspect="auto")
        for i in range(len(layouts)):
            for j in range(len(sizes)):
                if refused[i, j]:
                    text, colour = "n/a", "0.25"
                elif np.isnan(grid[i, j]):
                    text, colour = "not run", "0.4"
                else:
                    text = f"{grid[i, j]:.2f}×"
                    colour = "white" if abs(math.log2(grid[i, j])) > 0.6 * span else "black"
                ax.text(j, i, text, ha="center", va="center", fontsize=8.5, color=colour)
        ax.set_xticks(range(len(sizes)), [human_bytes(s) for s in sizes], rotation=30, ha="right")
        ax.set_yticks(range(len(layouts)), layouts)
        ax.set_xlabel("payload (bytes)")
        ax.set_ylabel("layout")
        ax.set_title(name, fontsize=10)
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    if image is not None:
        ticks = [t for t in range(-math.ceil(span), math.ceil(span) + 1)]
        bar = fig.colorbar(image, ax=list(axes[: len(names)]), shrink=0.8, ticks=ticks)
        bar.ax.set_yticklabels([f"{2.0**t:g}×" for t in ticks])
        bar.set_label("speedup over pickled (×, log scale; blue = faster, red = slower)")
    return fig


def _floor_line(ax, floors: pd.DataFrame, layout: str, column: str, scale: float = 1.0) -> None:
    """The floor as its own dashed line: ``column`` × ``scale`` against payload bytes."""
    fl = floors[floors["layout"] == layout].sort_values("payload_bytes")
    if not fl.empty:
        label = "floor: one raw broadcast (median over every job's floor at that size)"
        ax.plot(fl["payload_bytes"], fl[column] * scale, "k--", lw=2.4, label=label)


def _strategy_lines(ax, tab: pd.DataFrame, names, styles, column: str) -> None:
    """One line per strategy: ``column`` against payload bytes."""
    for name in names:
        rows = tab[tab["strategy"] == name].sort_values("payload_bytes")
        if not rows.empty:
            ax.plot(rows["payload_bytes"], rows[column], label=name, lw=1.6, ms=5, **styles[name])


def plot_overhead(df: pd.DataFrame) -> Figure:
    """(c) vs_floor = p50 / floor p50 (same job) per strategy and payload, one panel per layout."""
    table = strategy_table(df)
    styles = _styles(strategies_of(df))
    fig, pairs = _panels(df, "Overhead over the floor: p50 / floor p50, both timed in the same job")
    for layout, ax in pairs:
        tab = table[(table["layout"] == layout) & table["supported"]]
        _strategy_lines(ax, tab, strategies_of(df), styles, "vs_floor")
        ax.axhline(1.0, color="k", ls="--", lw=2, label="floor = 1× (one raw broadcast)")
        _bytes_axis(ax, table.loc[table["layout"] == layout, "payload_bytes"].dropna())
        _log_y(ax, "vs_floor: p50 / floor p50 (×, log scale)")
        refused = _refused(table[table["layout"] == layout])
        ax.set_title(layout_label(df, layout) + refused, fontsize=10)
    _legend(fig, pairs)
    return fig


def plot_algbw(df: pd.DataFrame) -> Figure:
    """(d) algbw = payload bytes / p50 (nccl-tests convention, GB/s = 1e9 B/s) vs payload."""
    table, floors = strategy_table(df), floor_table(df)
    styles = _styles(strategies_of(df))
    fig, pairs = _panels(df, "Algorithm bandwidth: payload bytes / p50 (nccl-tests algbw)")
    for layout, ax in pairs:
        tab = table[(table["layout"] == layout) & table["supported"]]
        _strategy_lines(ax, tab, strategies_of(df), styles, "algbw_gbps")
        _floor_line(ax, floors, layout, "floor_algbw_gbps")
        _bytes_axis(ax, table.loc[table["layout"] == layout, "payload_bytes"].dropna())
        _log_y(ax, "algbw (GB/s = 1e9 bytes/s, log scale)")
        refused = _refused(table[table["layout"] == layout])
        ax.set_title(_panel_title(df, floors, layout) + refused, fontsize=10)
    _legend(fig, pairs)
    return fig


PLOTS = {
    "latency": plot_latency,
    "speedup": plot_speedup,
    "overhead": plot_overhead,
    "algbw": plot_algbw,
}


def save_figures(df: pd.DataFrame, out_dir: Path | str, dpi: int = 110) -> dict[str, Path]:
    """Draw every figure and write it as PNG under ``out_dir``; returns name -> path."""
    out_dir = Path(out_dir)
    paths = {}
    for name, plot in PLOTS.items():
        fig = plot(df)
        path = out_dir / FIGURES[name]
        fig.savefig(path, dpi=dpi)
        paths[name] = path
    return paths


# -- tables ---------------------------------------------------------------------------------
def recommendation(df: pd.DataFrame) -> pd.DataFrame:
    """Per layout and payload: the strategy with the lowest vs_floor (a same-job ratio, so jobs
    measured at different moments compare fairly), the runner-up, and whether it is a tie."""
    table = strategy_table(df)
    rows = []
    for layout in layouts_of(df):
        tab = table[(table["layout"] == layout) & table["supported"]]
        for size in sorted(tab["payload_bytes"].unique()):
            ranked = tab[tab["payload_bytes"] == size].sort_values("vs_floor")
            best = ranked.iloc[0]
            second = ranked.iloc[1] if len(ranked) > 1 else None
            tie = second is not None and second["vs_floor"] <= best["vs_floor"] * (1 + TIE_FRACTION)
            rows.append(
                {
                    "layout": layout,
                    "payload_bytes": int(size),
                    "winner": best["strategy"],
                    "winner_vs_floor": best["vs_floor"],
                    "winner_speedup_over_pickled": best["speedup_over_pickled"],
                    "runner_up": None if second is None else second["strategy"],
                    "runner_up_vs_floor": np.nan if second is None else second["vs_floor"],
                    "tie": bool(tie),
                }
            )
    return pd.DataFrame(rows)


def recommendation_ranges(rec: pd.DataFrame) -> pd.DataFrame:
    """Consecutive payload sizes with the same winner merged into one range per layout."""
    out = []
    for layout, group in rec.groupby("layout", sort=False):
        group = group.sort_values("payload_bytes")
        start = 0
        records = group.to_dict("records")
        for i in range(1, len(records) + 1):
            if i == len(records) or records[i]["winner"] != records[start]["winner"]:
                span = records[start:i]
                out.append(
                    {
                        "layout": layout,
                        "from_bytes": span[0]["payload_bytes"],
                        "to_bytes": span[-1]["payload_bytes"],
                        "winner": span[0]["winner"],
                        "winner_vs_floor": [r["winner_vs_floor"] for r in span],
                        "winner_speedup_over_pickled": [
                            r["winner_speedup_over_pickled"] for r in span
                        ],
                        "runner_up": [r["runner_up"] for r in span],
                        "runner_up_vs_floor": [r["runner_up_vs_floor"] for r in span],
                        "ties": [r["tie"] for r in span],
                        "sizes": [r["payload_bytes"] for r in span],
                    }
                )
                start = i
    return pd.DataFrame(out)


def crossovers(rec: pd.DataFrame) -> list[str]:
    """Sentences naming where the winner changes, between which two measured sizes."""
    lines = []
    for layout, group in rec.groupby("layout", sort=False):
        group = group.sort_values("payload_bytes").to_dict("records")
        changes = [
            f"{a['winner']} → {b['winner']} between {human_bytes(a['payload_bytes'])} and "
            f"{human_bytes(b['payload_bytes'])}"
            + (" (not clear: a tie within the margin on one side)" if a["tie"] or b["tie"] else "")
            for a, b in zip(group, group[1:])
            if a["winner"] != b["winner"]
        ]
        lines.append(
            f"**{layout}**: "
            + (
                "; ".join(changes)
                if changes
                else f"no crossover: {group[0]['winner']} wins at every measured size"
            )
            + "."
        )
    return lines


def _md_table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    marks = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt_ratio(values: list[float]) -> str:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return "—"
    lo, hi = min(vals), max(vals)
    return f"{lo:.2f}×" if abs(hi - lo) < 0.005 else f"{lo:.2f}–{hi:.2f}×"


def recommendation_markdown(df: pd.DataFrame) -> str:
    rec = recommendation(df)
    if rec.empty:
        return "(no supported records: nothing to recommend)"
    ranges = recommendation_ranges(rec)
    rows = []
    for r in ranges.to_dict("records"):
        span = human_bytes(r["from_bytes"])
        if r["to_bytes"] != r["from_bytes"]:
            span += f" – {human_bytes(r['to_bytes'])}"
        runners = sorted({x for x in r["runner_up"] if x})
        tie_sizes = [human_bytes(b) for b, t in zip(r["sizes"], r["ties"]) if t]
        tie = f" (≈ runner-up at {', '.join(tie_sizes)})" if tie_sizes else ""
        rows.append(
            [
                r["layout"],
                span,
                f"**{r['winner']}**{tie}",
                _fmt_ratio(r["winner_vs_floor"]),
                _fmt_ratio(r["winner_speedup_over_pickled"]),
                ", ".join(runners) or "—",
                _fmt_ratio(r["runner_up_vs_floor"]),
            ]
        )
    table = _md_table(
        [
            "layout",
            "payload range (measured sizes)",
            "winner (lowest vs_floor)",
            "winner vs_floor",
            "winner speedup over pickled",
            "runner-up",
            "runner-up vs_floor",
        ],
        rows,
        align="lllrrlr",
    )
    note = (
        f"The winner at a size is the strategy with the lowest `vs_floor` (its p50 over the floor "
        f"p50 of the same job). '≈ runner-up at …' marks sizes where the runner-up is within "
        f"{TIE_FRACTION:.0%} of the winner, "
        "inside this machine's run-to-run noise: either is a fine choice there, and a "
        "crossover next to a tie is not a clear one."
    )
    return table + "\n\n" + note + "\n\n" + "\n".join(f"- {line}" for line in crossovers(rec))


def results_markdown(df: pd.DataFrame) -> str:
    """Per layout: every strategy at every size, as 'p50 / vs_floor / speedup over pickled'."""
    table, floors = strategy_table(df), floor_table(df)
    parts = []
    for layout in layouts_of(df):
        tab = table[table["layout"] == layout]
        sizes = sorted(tab["payload_bytes"].dropna().unique())
        rows, reasons = [], {}
        for name in strategies_of(df):
            cells = [name]
            for size in sizes:
                hit = tab[(tab["strategy"] == name) & (tab["payload_bytes"] == size)]
                if hit.empty:
                    cells.append("not run")
                elif not hit.iloc[0]["supported"]:
                    cells.append("n/a")
                    reasons[name] = clean_reason(hit.iloc[0]["error"])
                else:
                    h = hit.iloc[0]
                    cells.append(
                        f"{h['p50_us'] / 1e3:.2f} ms · {h['vs_floor']:.2f}× · "
                        f"{h['speedup_over_pickled']:.2f}×"
                    )
            rows.append(cells)
        fl = floors[floors["layout"] == layout].set_index("payload_bytes")
        rows.append(
            ["*floor* (median over jobs)"]
            + [
                f"{fl.loc[s, 'floor_p50_us'] / 1e3:.2f} ms (n={int(fl.loc[s, 'n_jobs'])})"
                if s in fl.index
                else "—"
                for s in sizes
            ]
        )
        parts.append(f"### {layout_label(df, layout)}\n")
        parts.append(_md_table(["strategy", *[human_bytes(s) for s in sizes]], rows))
        for name, reason in reasons.items():
            parts.append(f"\n- **{name}**: n/a here. {reason}")
        parts.append("")
    return "\n".join(parts)


COST_COLUMNS = [
    ("collectives_leader", "collectives on the leader", "count"),
    ("comm_bytes_leader", "bytes the leader sends", "bytes"),
    ("packed_bytes_leader", "bytes packed on the leader", "bytes"),
    ("copied_bytes_leader", "bytes copied on the leader", "bytes"),
    ("copied_bytes_receiver", "bytes copied on a receiver (max)", "bytes"),
    ("pickled_bytes_leader", "bytes pickled on the leader", "bytes"),
    ("pickled_bytes_receiver", "bytes unpickled on a receiver (max)", "bytes"),
    ("peak_rss_bytes", "peak RSS of a rank (max; whole process)", "absolute"),
    ("peak_rss_delta_bytes", "peak RSS growth during the call (max)", "bytes"),
]


def _cost_cell(value, kind: str, payload_bytes: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if kind == "count":
        return f"{int(value)}"
    if kind == "absolute":
        return human_bytes(value)
    if value == 0:
        return "0"
    share = value / payload_bytes
    return f"{human_bytes(value)} ({'<0.01' if share < 0.005 else f'{share:.2f}'}×)"


def cost_markdown(df: pd.DataFrame) -> str:
    """Issue 5's 'why each costs what it costs': per layout, at its largest payload, the
    collectives, copies, pickling and memory each strategy's records count."""
    ok = df[df["supported"]]
    parts = []
    for layout in layouts_of(df):
        lay = ok[ok["layout"] == layout]
        if lay.empty:
            continue
        size = lay["payload_bytes"].max()
        at = lay[lay["payload_bytes"] == size].groupby("strategy").median(numeric_only=True)
        counts_by_size = (
            lay.groupby(["strategy", "payload_bytes"])["collectives_per_call"].median().unstack()
        )
        header = ["strategy", "collectives per call (max over ranks), at each size"]
        header += [c[1] for c in COST_COLUMNS]
        rows = []
        for name in at.index:
            by_size = "/".join(f"{int(v)}" for v in counts_by_size.loc[name].dropna())
            rows.append(
                [name, by_size]
                + [_cost_cell(at.loc[name].get(col), kind, size) for col, _, kind in COST_COLUMNS]
            )
        floor_calls = lay.loc[lay["payload_bytes"] == size, "ref_floor_collectives_per_call"]
        floor_row = [
            "*floor* (reference)",
            f"{int(floor_calls.median())}" if len(floor_calls) else "—",
        ]
        for col, _, kind in COST_COLUMNS:
            ref = f"ref_floor_{col}"
            value = lay.loc[lay["payload_bytes"] == size, ref].median() if ref in lay else None
            floor_row.append(_cost_cell(value, kind, size))
        rows.append(floor_row)
        parts.append(
            f"### {layout_label(df, layout)}, at {human_bytes(size)} ({int(size)} bytes)\n\n"
            "Byte counts are also given as a multiple of the payload; the collectives column "
            "lists the count at each measured size, smallest first. Peak RSS is the whole "
            "rank process (torch and megatron-core included); its growth during one call is "
            "what the strategy itself allocates.\n"
        )
        parts.append(_md_table(header, rows, align="l" + "r" * (len(header) - 1)))
        parts.append("")
    return "\n".join(parts)


def commands_markdown(df: pd.DataFrame) -> str:
    """The command(s) recorded in the records, runnable form first."""
    commands = sorted({str(c) for c in df.get("command", pd.Series(dtype=str)).dropna()})
    lines = []
    for cmd in commands:
        # Hydra records argv[0] as the module's file; the runnable form is `python -m harness`.
        runnable = re.sub(r"^__main__\.py\b", "python -m harness", cmd)
        lines.append(f"```\n{runnable}\n```")
    return "\n".join(lines) if lines else "(the records name no command)"


def write_report(root: Path | str, df: pd.DataFrame | None = None) -> Path:
    """Write report.md and the PNG figures into ``root``; returns the report's path."""
    root = Path(root)
    df = load(root) if df is None else df
    figures = save_figures(df, root)
    n_refused = int((~df["supported"]).sum())
    title_figs = "\n\n".join(f"![{name}]({path.name})" for name, path in figures.items())
    text = f"""# bcastbench report: {root.name}

{context_line(df)}. {len(df)} job record(s), {n_refused} of them unsupported (shown as n/a);
layouts {", ".join(layouts_of(df))}; git {_unique(df, "git_rev")}, torch {_unique(df, "torch_version")}.

## How this was produced

{commands_markdown(df)}

{CAVEAT} The floor is one raw broadcast of an already packed buffer of the payload's size; every
job measures it, so each layout and size has several floor measurements: the figures and tables
use their median and say over how many jobs.

Regenerate this report with `python -m harness.report.build {root}`.

## Recommendation

{recommendation_markdown(df)}

## Figures

{title_figs}

## Results per layout

Each cell: p50 per call · `vs_floor` (p50 / floor p50, same job) · speedup over `pickled`
(1 / `vs_baseline`, same job). n/a: the strategy refuses the layout (reason below the table).

{results_markdown(df)}

## Why each costs what it costs

{cost_markdown(df)}
"""
    path = root / "report.md"
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    matplotlib.use("Agg")  # files only; never open a window
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", help="a run or sweep directory (every result.json below it)")
    args = ap.parse_args(argv)
    df = load(args.root)
    if df.empty:
        print(f"no result.json under {args.root}", file=sys.stderr)
        return 1
    path = write_report(args.root, df)
    figures = ", ".join(FIGURES.values())
    print(f"bcastbench report: {path} (figures beside it: {figures})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
