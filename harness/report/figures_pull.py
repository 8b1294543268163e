"""Push beside pull as a figure (``push_vs_pull.png``), beside the report's "Push or pull"
table: per layout, every strategy's ``vs_floor`` against payload size, the pull strategies
solid and the push ones dashed, and below it the best pull over the best push with its paired
interval (``harness.report.pull_section.push_pull_table``). No cell with both kinds: no figure.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from harness.files import write_figure
from harness.report.figures import (
    _bytes_axis,
    _legend,
    _log_y,
    _strategy_lines,
    _wrap,
    interval_bars,
    line_styles,
)
from harness.report.pull_section import NEITHER, PULL, push_pull_table
from harness.report.sure import bare
from harness.report.tables import context_line, layout_label, strategy_table

FIGURE = "push_vs_pull.png"
RATIO_STYLE = {"color": "k", "marker": "o", "lw": 2.0, "ms": 6.0}
"""The ratio's line: one per panel, so black, apart from every strategy's colour."""


def _kind_styles(names: list[str], styles: dict[str, dict]) -> dict[str, dict]:
    """Each strategy's own colour and marker, dashed when it pushes (a reader tells the two
    kinds apart at a glance, and each strategy still by its colour)."""
    return {n: {**styles[n], "ls": "-" if bare(n) in PULL else "--"} for n in names}


def _ratio_panel(ax, rows: pd.DataFrame) -> None:
    """Best pull over best push per size, its paired interval as bars, 1 = a tie."""
    rows = rows.sort_values("payload_bytes")
    x, y = rows["payload_bytes"], rows["pull_over_push"]
    ax.plot(x, y, label="best pull / best push (paired 95 % interval)", **RATIO_STYLE)
    lo = [np.nan if i is None else i.lo for i in rows["interval"]]
    hi = [np.nan if i is None else i.hi for i in rows["interval"]]
    interval_bars(ax, x, y, lo, hi, RATIO_STYLE)
    ax.axhline(1.0, color="0.4", ls=":", lw=1.4, label="pull = push")
    for xi, yi, pull, push in zip(x, y, rows["pull"], rows["push"]):
        ax.annotate(f"{bare(pull)}\n/ {bare(push)}", (xi, yi), textcoords="offset points",
                    xytext=(0, 8), ha="center", fontsize=7)  # fmt: skip


def plot_push_pull(df: pd.DataFrame) -> Figure | None:
    """Two rows of panels (vs_floor of every strategy; pull over push) by one column per layout
    with both kinds measured; None when no layout has."""
    ratios = push_pull_table(df)
    if ratios.empty:
        return None
    layouts = list(dict.fromkeys(ratios["layout"]))
    table = strategy_table(df)
    names, styles = line_styles(df)
    names = [n for n in names if bare(n) not in NEITHER]
    styles = _kind_styles(names, styles)
    width = max(11.0, 5.2 * len(layouts) + 0.6)
    fig = Figure(figsize=(width, 9.6), layout="constrained")
    fig.suptitle(
        _wrap(f"Push or pull: each strategy over the floor (pull solid, push dashed), and the "
              f"best pull over the best push\n{context_line(df)}", width - 0.4, 11), fontsize=11,
    )  # fmt: skip
    axes = fig.subplots(2, len(layouts), squeeze=False)
    pairs = []
    for j, layout in enumerate(layouts):
        tab = table[(table["layout"] == layout) & table["supported"]]
        sizes = table.loc[table["layout"] == layout, "payload_bytes"].dropna()
        top, bottom = axes[0, j], axes[1, j]
        _strategy_lines(top, tab, names, styles, "vs_floor")
        top.axhline(1.0, color="k", ls="--", lw=1.2, label="floor = 1×")
        _log_y(top, "vs_floor: p50 / floor p50 (×, log scale; lower is better)")
        top.set_title(layout_label(df, layout), fontsize=10)
        _ratio_panel(bottom, ratios[ratios["layout"] == layout])
        _log_y(bottom, "best pull / best push (×, log; above 1: push wins)")
        for ax in (top, bottom):
            _bytes_axis(ax, sizes)
        pairs += [(layout, top), (layout, bottom)]
    _legend(fig, pairs)
    return fig


def save(df: pd.DataFrame, out_dir: Path | str, dpi: int = 110) -> Path | None:
    """The figure as ``FIGURE`` under ``out_dir`` (atomically) and its path; None (nothing
    written) when no cell measured both kinds."""
    fig = plot_push_pull(df)
    if fig is None:
        return None
    return write_figure(Path(out_dir) / FIGURE, fig, dpi=dpi)
