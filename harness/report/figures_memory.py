"""The node-memory figure: copies of the batch resident on the busiest node at the peak against
payload size, one line per strategy and one panel per layout (``memory_section.memory_table``).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from harness.files import write_figure
from harness.report.figures import _bytes_axis, _legend, _wrap, line_styles
from harness.report.memory_section import memory_table
from harness.report.tables import context_line, layout_label, layouts_of

FIGURE = "node_copies_vs_payload.png"


def plot_copies(df: pd.DataFrame) -> Figure | None:
    """The figure, or None when no record carries the node's memory."""
    table = memory_table(df)
    if table.empty:
        return None
    layouts = [layout for layout in layouts_of(df) if layout in set(table["layout"])]
    names, styles = line_styles(df)
    width = max(8.0, 5.2 * len(layouts) + 0.6)
    fig = Figure(figsize=(width, 5.4), layout="constrained")
    fig.suptitle(_wrap(f"Copies of the batch resident on the node at the peak (leader's batch "
                       f"included, shared memory once)\n{context_line(df)}", width - 0.4, 11),
                 fontsize=11)  # fmt: skip
    axes = fig.subplots(1, len(layouts), squeeze=False)[0]
    pairs = []
    for ax, layout in zip(axes, layouts):
        cell = table[table["layout"] == layout]
        for name in [n for n in names if n in set(cell["strategy"])]:
            rows = cell[cell["strategy"] == name].sort_values("payload_bytes")
            ax.plot(rows["payload_bytes"], rows["node_copies"], label=name, **styles[name])
        ax.set_ylabel("node_copies (batches resident at the peak)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_title(layout_label(df, layout), fontsize=10)
        _bytes_axis(ax, cell["payload_bytes"])
        pairs.append((layout, ax))
    _legend(fig, pairs)
    return fig


def save(df: pd.DataFrame, out_dir: Path | str, dpi: int = 110) -> Path | None:
    """The figure as ``FIGURE`` under ``out_dir`` (atomically); None when nothing to draw."""
    fig = plot_copies(df)
    return None if fig is None else write_figure(Path(out_dir) / FIGURE, fig, dpi=dpi)
