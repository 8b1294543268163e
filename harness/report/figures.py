"""The report's figures: latency, speedup over ``pickled``, overhead over the floor and algbw,
one panel per run setting. Each ``plot_*`` takes the table from ``tables.load`` and returns a
matplotlib ``Figure``; ``notebooks/analysis.ipynb`` draws the same ones."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from harness.files import write_figure
from harness.job.dispatch_modes import FLOORS
from harness.job.interval import interval_fields, interval_keys, interval_of
from harness.report.styles import draw_order, emphasis
from harness.report.styles import styles as strategy_styles
from harness.report.tables import (
    BASELINE,
    SINGLE,
    context_line,
    floor_method_words,
    floor_table,
    human_bytes,
    jobs_text,
    layout_label,
    layouts_of,
    recommendation,
    strategies_of,
    strategy_table,
)

FIGURES = {
    "latency": "latency_p50_vs_payload.png",
    "speedup": "speedup_over_pickled.png",
    "overhead": "overhead_over_floor.png",
    "algbw": "algbw_vs_payload.png",
}
_MARKERS = "osD^v<>Ph*Xp"
TITLE_FONT_PT = 10


def _wrap(text: str, inches: float, font_pt: float = TITLE_FONT_PT) -> str:
    """``text`` wrapped line by line to what fits ``inches`` at ``font_pt``, so no title runs
    into its neighbour or off the figure (constrained layout moves axes, never wraps text)."""
    # DejaVu Sans averages about half an em per character in such titles.
    width = max(20, int(inches * 72 / (0.52 * font_pt)))
    return "\n".join(textwrap.fill(line, width) for line in text.splitlines())


def _floor_subtitle(floors: pd.DataFrame, layout: str) -> str:
    """'floor: fastest raw method, median over 11 jobs per size; won by chunked into 2, one
    broadcast' (the methods that won most often first); for one job, that job's method."""
    fl = floors[floors["layout"] == layout]
    if fl.empty:
        return ""
    won: dict[str, int] = {}
    for counts in fl["method_counts"]:
        for method, n in counts:
            won[method] = won.get(method, 0) + n
    methods = _methods_words(sorted(won, key=lambda m: (-won[m], m)))
    low, high = int(fl["n_jobs"].min()), int(fl["n_jobs"].max())
    if high == 1:
        return f"floor: the one job's fastest raw method ({methods})"
    jobs = jobs_text(low) if low == high else f"{low}-{high} jobs"
    return f"floor: fastest raw method, median over {jobs} per size; won by {methods}"


def _methods_words(methods: list[str]) -> str:
    """Floor methods in words, chunk counts merged where the first of them stood:
    'one broadcast, chunked into 2 or 4'."""
    chunks = [m.removeprefix("chunks") for m in methods if m.startswith("chunks")]
    words = []
    for method in methods:
        if not method.startswith("chunks"):
            words.append(floor_method_words(method))
        elif method.removeprefix("chunks") == chunks[0]:
            words.append(f"chunked into {' or '.join(chunks)}")
    return ", ".join(words)


def _panel_title(df, floors: pd.DataFrame, layout: str, ax, extra: str = "") -> str:
    """The layout, the floor's subtitle and ``extra``, wrapped to the panel's width."""
    lines = [layout_label(df, layout), _floor_subtitle(floors, layout), extra]
    # The panel's share of the figure, less its y axis' labels (constrained layout has not
    # placed the axes yet, so their own position would be the pre-layout guess).
    ncols = ax.get_subplotspec().get_gridspec().ncols
    inches = ax.get_figure().get_figwidth() / ncols - 0.9
    return _wrap("\n".join(line for line in lines if line), inches)


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
    if ticks:  # one size alone gets the same margin, not matplotlib's default decade
        ax.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.4)


def _log_y(ax, label: str) -> None:
    ax.margins(y=0.08)  # a point at the top or bottom stays clear of the frame
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
    fig.suptitle(_wrap(f"{title}\n{context_line(df)}", width - 0.4, 11), fontsize=11)
    return fig, list(zip(layouts, axes[: len(layouts)]))


def _refused(table: pd.DataFrame) -> str:
    """A title line naming the strategies that refuse this layout (drawn as no line at all)."""
    refused = sorted(table.loc[~table["supported"], "strategy"].unique())
    if not refused:
        return ""
    return "n/a (refuses this layout, see report.md): " + ", ".join(refused)


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
def recommended(df: pd.DataFrame) -> set[str]:
    """Every strategy some cell recommends (its fastest, and those tied with it)."""
    rec = recommendation(df)
    if rec.empty:
        return set()
    return set(rec["winner"]) | {n for tied in rec["tied_with"] for n in tied}


def line_styles(df: pd.DataFrame) -> tuple[list[str], dict[str, dict]]:
    """The strategies in legend order (recommended first) and each one's colour, marker and
    emphasis (``harness.report.styles``): the same strategy looks the same in every figure."""
    chosen = recommended(df)
    names = draw_order(strategies_of(df), chosen)
    return names, {n: {**s, **emphasis(n, chosen)} for n, s in strategy_styles(names).items()}


def interval_bars(ax, x, y, lo, hi, style: dict) -> None:
    """Each point's 95 % interval as a vertical bar in its line's colour; none where the
    records carry no interval (NaN)."""
    x, y, lo, hi = (np.asarray(v, dtype=float) for v in (x, y, lo, hi))
    have = ~(np.isnan(lo) | np.isnan(hi) | np.isnan(y))
    if not have.any():
        return
    err = [np.clip(y - lo, 0, None)[have], np.clip(hi - y, 0, None)[have]]
    ax.errorbar(x[have], y[have], yerr=err, fmt="none", ecolor=style["color"], capsize=2.5,
                elinewidth=1.0, alpha=style.get("alpha", 1.0), zorder=style.get("zorder", 2))  # fmt: skip


def _layout_panels(df: pd.DataFrame, title: str, ylabel: str, draw) -> Figure:
    """One panel per layout against payload bytes (log-log), one legend for all: ``draw(ax,
    tab, fl, names, styles)`` draws a layout's lines from its supported rows ``tab`` and its
    floors ``fl`` (sorted by payload); the axes, title and legend are the same for every plot."""
    table, floors = strategy_table(df), floor_table(df)
    names, styles = line_styles(df)
    fig, pairs = _panels(df, title)
    for layout, ax in pairs:
        tab = table[(table["layout"] == layout) & table["supported"]]
        fl = floors[floors["layout"] == layout].sort_values("payload_bytes")
        draw(ax, tab, fl, names, styles)
        _bytes_axis(ax, table.loc[table["layout"] == layout, "payload_bytes"].dropna())
        _log_y(ax, ylabel)
        refused = _refused(table[table["layout"] == layout])
        ax.set_title(_panel_title(df, floors, layout, ax, refused), fontsize=TITLE_FONT_PT)
    _legend(fig, pairs)
    return fig


def plot_latency(df: pd.DataFrame) -> Figure:
    """(a) p50 latency with its 95 % interval vs payload, log-log, one panel per layout; the
    floor is its own black line (median of the floors measured by every job at that size)."""

    def draw(ax, tab, fl, names, styles) -> None:
        _strategy_lines(ax, tab, names, styles, "p50_us", 1e-3)
        _floor_line(ax, fl, "floor_p50_us", scale=1e-3)

    return _layout_panels(
        df,
        "Latency per call (p50, bars: its 95 % interval) vs payload size",
        "latency per call (ms, log scale): p50 with its 95 % interval",
        draw,
    )


def plot_speedup(df: pd.DataFrame) -> Figure:
    """(b) Speedup over ``pickled`` (1 / vs_baseline, same job) as a layouts × payload heatmap
    per strategy; grey cells are layouts the strategy refuses (n/a). The figure is sized by its
    content: the panels, and at least the width its title and colour bar need."""
    table = strategy_table(df)
    names = [n for n in strategies_of(df) if n != BASELINE]
    layouts = layouts_of(df)
    sizes = sorted(table["payload_bytes"].dropna().unique())
    ncols = min(4, max(1, len(names)))
    nrows = math.ceil(len(names) / ncols)
    label_in = max((len(x) for x in layouts), default=6) * 0.09 + 0.9  # y tick labels
    panel_w = max(2.4, 1.05 * len(sizes) + 0.4) + label_in
    width = max(8.0, panel_w * ncols + 1.6)  # 1.6: the colour bar and its label
    title = (
        "Speedup over pickled: p50 of pickled / p50 of the strategy, both timed in the same job "
        "(higher is better; above 1× is faster; pickled itself is 1× by definition)"
    )
    title = _wrap(f"{title}\n{context_line(df)}", width - 0.4, 11)
    height = (0.55 * len(layouts) + 1.7) * nrows + 0.25 * (title.count("\n") + 1) + 0.6
    fig = Figure(figsize=(width, max(4.2, height)), layout="constrained")
    fig.suptitle(title, fontsize=11)
    if not sizes or not names:
        fig.text(0.5, 0.5, "no supported records to compare", ha="center", va="center")
        return fig
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    log2 = np.log2(table.loc[table["supported"], "speedup_over_pickled"].dropna())
    span = max(1.0, float(np.abs(log2).max()) if len(log2) else 1.0)
    norm = TwoSlopeNorm(vmin=-span, vcenter=0.0, vmax=span)
    image = None
    for ax, name in zip(axes, names):
        grid, refused = _speedup_grid(table[table["strategy"] == name], layouts, sizes)
        ax.set_facecolor("0.85")
        image = ax.imshow(np.log2(grid), cmap="RdBu", norm=norm, aspect="auto")
        _annotate_cells(ax, grid, refused, span)
        ax.set_xticks(range(len(sizes)), [human_bytes(s) for s in sizes], rotation=30, ha="right")
        ax.set_yticks(range(len(layouts)), layouts)
        ax.set_xlabel("payload (bytes)")
        ax.set_ylabel("layout")
        ax.set_title(name, fontsize=TITLE_FONT_PT)
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    if image is not None:
        ticks = list(range(-math.floor(span), math.floor(span) + 1))  # on the bar only
        bar = fig.colorbar(image, ax=list(axes[: len(names)]), shrink=0.9, ticks=ticks)
        bar.ax.set_yticklabels([f"{2.0**t:g}×" for t in ticks])
        # Three short lines: one long one outgrew a short figure's height and was cut off.
        bar.set_label("speedup over pickled\n(×, log scale)\nblue faster, red slower", fontsize=9)
    return fig


def _speedup_grid(tab: pd.DataFrame, layouts: list[str], sizes: list[float]):
    """One strategy's speedups as a layouts × sizes grid (NaN: not run), and where it refuses."""
    grid = np.full((len(layouts), len(sizes)), np.nan)
    refused = np.zeros_like(grid, dtype=bool)
    for row in tab.itertuples(index=False):
        if row.layout not in layouts or row.payload_bytes not in sizes:
            continue
        i, j = layouts.index(row.layout), sizes.index(row.payload_bytes)
        if row.supported:
            grid[i, j] = row.speedup_over_pickled
        else:
            refused[i, j] = True
    return grid, refused


def _annotate_cells(ax, grid: np.ndarray, refused: np.ndarray, span: float) -> None:
    """Each cell's speedup (or n/a, not run), white on the darkest colours."""
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            if refused[i, j]:
                text, colour = "n/a", "0.25"
            elif np.isnan(grid[i, j]):
                text, colour = "not run", "0.4"
            else:
                text = f"{grid[i, j]:.2f}×"
                colour = "white" if abs(math.log2(grid[i, j])) > 0.6 * span else "black"
            ax.text(j, i, text, ha="center", va="center", fontsize=8.5, color=colour)


def _floor_line(ax, fl: pd.DataFrame, column: str, scale: float = 1.0) -> None:
    """The honest floor of one layout (``fl``, sorted by payload) as its own dashed line
    (``column`` × ``scale`` against payload bytes) and, where another raw method beat it, the
    single broadcast as a thin dotted one."""
    if fl.empty:
        return
    label = "floor: fastest raw method (median over every job's floor at that size)"
    ax.plot(fl["payload_bytes"], fl[column] * scale, "k--", lw=2.4, label=label,
            **_alone(fl, FLOOR_MARK))  # fmt: skip
    if (fl["floor_method"] != SINGLE).any():
        single = _single_broadcast(fl, column) * scale
        label = "one raw broadcast (the single-broadcast floor)"
        ax.plot(fl["payload_bytes"], single, color="0.4", ls=":", lw=1.4, label=label,
                **_alone(fl, SINGLE_MARK))  # fmt: skip


FLOOR_MARK = {"marker": "_", "ms": 16, "mew": 2.4}
SINGLE_MARK = {"marker": "_", "ms": 11, "mew": 1.4}


def _alone(rows: pd.DataFrame, mark: dict) -> dict:
    """``mark`` (a wide dash) where a line has one point, which a line alone would not draw;
    nothing where it has more, so the legend still shows the line's dashes."""
    return mark if len(rows) == 1 else {}


def _single_broadcast(fl: pd.DataFrame, column: str) -> pd.Series:
    """The single broadcast in ``column``'s terms: its p50 latency, or its algbw."""
    if column == "floor_algbw_gbps":
        return fl["payload_bytes"] / (fl["floor_single_p50_us"] / 1e6) / 1e9
    return fl["floor_single_p50_us"]


def bounds(rows: pd.DataFrame, column: str) -> tuple[pd.Series, pd.Series]:
    """The 95 % interval of ``column`` in ``rows`` (NaN where none): its own
    (``harness.job.interval``), or for a bandwidth the p50's turned round (bytes over a longer
    time is fewer GB/s)."""
    nan = pd.Series(np.nan, index=rows.index)
    if column in ("algbw_gbps", "busbw_gbps"):
        p50_low, p50_high = (rows.get(key, nan) for key in interval_keys("p50_us"))
        return rows[column] * rows["p50_us"] / p50_high, rows[column] * rows["p50_us"] / p50_low
    lo, hi = interval_keys(column)
    return rows.get(lo, nan), rows.get(hi, nan)


def _strategy_lines(ax, tab: pd.DataFrame, names, styles, column: str, scale=1.0) -> None:
    """One line per strategy: ``column`` (× ``scale``) against payload bytes, each point with
    its interval bar."""
    for name in names:
        rows = tab[tab["strategy"] == name].sort_values("payload_bytes")
        if not rows.empty:
            x, y = rows["payload_bytes"], rows[column] * scale
            ax.plot(x, y, label=name, **styles[name])
            lo, hi = bounds(rows, column)
            interval_bars(ax, x, y, lo * scale, hi * scale, styles[name])


def plot_overhead(df: pd.DataFrame) -> Figure:
    """(c) vs_floor = p50 / floor p50 (same job) per strategy and payload, one panel per layout;
    where another raw method beat one broadcast, the single broadcast is a dotted line."""

    def draw(ax, tab, fl, names, styles) -> None:
        _strategy_lines(ax, tab, names, styles, "vs_floor")
        ax.axhline(1.0, color="k", ls="--", lw=2, label="floor = 1× (fastest raw method)")
        if (fl["floor_method"] != SINGLE).any():
            ratio = fl["floor_single_p50_us"] / fl["floor_p50_us"]
            label = "one raw broadcast (single-broadcast floor / floor)"
            ax.plot(fl["payload_bytes"], ratio, color="0.4", ls=":", lw=1.4, label=label,
                    **_alone(fl, SINGLE_MARK))  # fmt: skip

    return _layout_panels(
        df,
        "Overhead over the floor: p50 / floor p50, both timed in the same job",
        "vs_floor: p50 / floor p50 (×, log scale; lower is better)",
        draw,
    )


def plot_algbw(df: pd.DataFrame) -> Figure:
    """(d) algbw = payload bytes / p50 (nccl-tests convention, GB/s = 1e9 B/s) vs payload."""

    def draw(ax, tab, fl, names, styles) -> None:
        _strategy_lines(ax, tab, names, styles, "algbw_gbps")
        _floor_line(ax, fl, "floor_algbw_gbps")

    return _layout_panels(
        df,
        "Algorithm bandwidth: payload bytes / p50 (nccl-tests algbw)",
        "algbw (GB/s = 1e9 bytes/s, log scale; higher is better)",
        draw,
    )


PLOTS = {
    "latency": plot_latency,
    "speedup": plot_speedup,
    "overhead": plot_overhead,
    "algbw": plot_algbw,
}


def save_figure(df: pd.DataFrame, out_dir: Path | str, name: str, dpi: int = 110) -> Path:
    """Draw figure ``name`` (of ``PLOTS``) and write it as PNG under ``out_dir`` (atomically);
    its path."""
    return write_figure(Path(out_dir) / FIGURES[name], PLOTS[name](df), dpi=dpi)


def save_figures(df: pd.DataFrame, out_dir: Path | str, dpi: int = 110) -> dict[str, Path]:
    """Draw every figure of ``PLOTS`` and write it as PNG under ``out_dir`` (atomically);
    name -> path."""
    return {name: save_figure(df, out_dir, name, dpi) for name in PLOTS}


# -- Ray dispatch (harness.job.dispatch records) ---------------------------------------------
RAY_FIGURE = "ray_dispatch_p50_vs_payload.png"


def dispatch_frame(records: list[dict]) -> pd.DataFrame:
    """One row per (dispatch record, mode): where it ran, payload, p50/p90, cross-node bytes."""
    rows = []
    for rec in records:
        where = "local Ray"
        if rec.get("emulate_nodes") is not None:  # a local world's record carries nulls
            links = "node" if rec.get("emulate_links", "node") == "node" else "rank (rails)"
            where = (f"{rec['emulate_nodes']} nodes, one {rec['emulate_rate_mbit']} Mbit/s "
                     f"link per {links}")  # fmt: skip
        for mode, row in rec["modes"].items():
            rows.append({
                "panel": f"{rec['layout'].split(' ')[0]}\n{where}", "mode": mode,
                "payload_bytes": rec["payload_bytes"], "p50_ms": row["p50_us"] / 1e3,
                "p90_ms": row["p90_us"] / 1e3,
                **_p50_ms_interval(row),
                "cross_mb": (row.get("cross_node_bytes_per_call") or float("nan")) / 1e6,
            })  # fmt: skip
    return pd.DataFrame(rows)


def _p50_ms_interval(row: dict) -> dict:
    """A mode's p50 interval in milliseconds, as ``dispatch_frame``'s columns (NaN ends where
    the record has none)."""
    interval = interval_of(row, "p50_us")
    if interval is None:
        return dict.fromkeys(interval_keys("p50_ms"), float("nan"))
    return interval_fields("p50_ms", interval.scaled(1e-3))


def plot_ray_dispatch(records: list[dict]) -> Figure:
    """ "Ray to every rank vs leader + broadcast": p50 (p90 band) vs payload, one panel per
    layout and cluster, one line per dispatch mode (floors dashed); cross-node MB per call
    written beside each point where the links were counted."""
    df = dispatch_frame(records)
    panels = list(dict.fromkeys(df["panel"]))
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(max(11.0, 5.2 * ncols + 0.6), 4.6 * nrows + 1.4), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle("Ray to every rank vs leader + broadcast (dispatch+broadcast scope)", fontsize=11)
    styles = _styles(df["mode"].unique())
    for panel, ax in zip(panels, axes):
        sub = df[df["panel"] == panel]
        for mode, g in sub.groupby("mode", sort=True):
            g = g.sort_values("payload_bytes")
            raw = mode in FLOORS.values()
            ax.plot(g["payload_bytes"], g["p50_ms"], label=mode, ls="--" if raw else "-",
                    lw=2.2 if mode == "all_ranks" else 1.3, **styles[mode])  # fmt: skip
            ax.fill_between(g["payload_bytes"], g["p50_ms"], g["p90_ms"], alpha=0.08,
                            color=styles[mode]["color"])  # fmt: skip
            last = g.tail(1)  # one label per line, at the largest payload: legible
            for x, y, mb in zip(last["payload_bytes"], last["p50_ms"], last["cross_mb"]):
                if not math.isnan(mb):
                    ax.annotate(f"{mb:.1f} MB", (x, y), fontsize=6.5, xytext=(4, 0),
                                textcoords="offset points", color=styles[mode]["color"])  # fmt: skip
        _bytes_axis(ax, sub["payload_bytes"])
        _log_y(ax, "p50 per call, ms (driver → every rank)")
        ax.set_title(panel, fontsize=9)
    _legend(fig, list(zip(panels, axes)))
    return fig
