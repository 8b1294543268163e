"""Sizes the nccl-tests way: time per call and bus bandwidth (``busbw_gbps``) against payload
size, one line per strategy with each point's 95 % interval, one column per run setting
(``time_and_busbw_vs_payload.png``). nccl-tests prints exactly these two figures per size; a
reader who knows its tables reads this one."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from harness.files import write_figure
from harness.report.figures import (
    _bytes_axis,
    _floor_line,
    _legend,
    _log_y,
    _strategy_lines,
    _wrap,
    line_styles,
)
from harness.report.tables import (
    context_line,
    floor_table,
    layout_label,
    layouts_of,
    strategy_table,
)

FIGURE = "time_and_busbw_vs_payload.png"
ROWS = (
    ("p50_us", "time per call (µs, log scale): p50, 95 % interval", 1.0, "floor_p50_us"),
    ("busbw_gbps", "busbw (GB/s, log scale; higher is better)", 1.0, "floor_algbw_gbps"),
)
"""(column, y label, scale, the floor's column): the rows of panels. For a broadcast busbw
equals algbw (nccl-tests' factor is 1), so the floor's algbw is its busbw."""


def plot_time_and_busbw(df: pd.DataFrame) -> Figure:
    """Two rows of panels (time, busbw) by one column per setting, against payload bytes."""
    table, floors = strategy_table(df), floor_table(df)
    names, styles = line_styles(df)
    layouts = layouts_of(df)
    width = max(11.0, 5.2 * len(layouts) + 0.6)
    fig = Figure(figsize=(width, 8.6 + 1.6), layout="constrained")
    fig.suptitle(
        _wrap(f"Time and bus bandwidth vs payload size (nccl-tests' two figures)\n"
              f"{context_line(df)}", width - 0.4, 11), fontsize=11,
    )  # fmt: skip
    axes = fig.subplots(len(ROWS), len(layouts), squeeze=False)
    pairs = []
    for j, layout in enumerate(layouts):
        tab = table[(table["layout"] == layout) & table["supported"]]
        fl = floors[floors["layout"] == layout].sort_values("payload_bytes")
        for i, (column, label, scale, floor_column) in enumerate(ROWS):
            ax = axes[i, j]
            if column in tab.columns:
                _strategy_lines(ax, tab, names, styles, column, scale)
            _floor_line(ax, fl, floor_column)
            _bytes_axis(ax, table.loc[table["layout"] == layout, "payload_bytes"].dropna())
            _log_y(ax, label)
            if i == 0:
                ax.set_title(layout_label(df, layout), fontsize=10)
            pairs.append((layout, ax))
    _legend(fig, pairs)
    return fig


def save(df: pd.DataFrame, out_dir: Path | str, dpi: int = 110) -> Path:
    """The figure as ``FIGURE`` under ``out_dir`` (atomically); its path."""
    return write_figure(Path(out_dir) / FIGURE, plot_time_and_busbw(df), dpi=dpi)
