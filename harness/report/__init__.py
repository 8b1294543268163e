"""From records to readers: one table of every job (``collect``), the report's tables, figures
and text (``tables``, ``figures`` with ``figures_sizes`` and ``styles``, ``markdown`` with
``cost_section`` and ``md_format``; the figures drawn beside the text by ``drawing``), how
sure they are (``sure``), and
measured Ray dispatch beside the model (``dispatch_records``, ``dispatch_model``,
``ray_report``); ``bcastbench report`` (``harness.commands.report``) writes them.

``from harness import report; report.plot_latency(df)`` (the notebook's spelling) works for every
public name of those modules, imported on first use so that a caller of ``collect`` alone does
not import matplotlib.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "tables": (
        "BASELINE", "FLOOR", "SETTING", "SINGLE", "clean_reason",
        "context_line", "crossovers", "floor_method_text", "floor_reference", "floor_table",
        "human_bytes", "layout_label", "layouts_of", "load",
        "recommendation", "recommendation_ranges", "run_dates", "strategies_of",
        "strategy_table", "unique_values", "winning_floor",
    ),
    "figures": (
        "FIGURES", "PLOTS", "plot_algbw", "plot_latency", "plot_overhead", "plot_speedup",
        "save_figure", "save_figures",
    ),
    "markdown": (
        "caveat", "commands_markdown", "recommendation_markdown", "results_markdown",
        "write_report",
    ),
    "cost_section": ("COST_COLUMNS", "cost_markdown"),
    "figures_sizes": ("plot_time_and_busbw",),
    "sure": ("MARK", "check_samples", "host_text", "oversubscribed_cells", "samples_markdown"),
}  # fmt: skip
_WHERE = {name: module for module, names in _HOMES.items() for name in names}
_MODULES = (
    "collect", "md_format", "dispatch_records", "dispatch_model", "ray_report", "styles",
)  # fmt: skip
"""Modules reached as attributes only (``report.collect``), their names not lifted up."""


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"harness.report.{_WHERE[name]}"), name)
    if name in _HOMES or name in _MODULES:
        return importlib.import_module(f"harness.report.{name}")
    raise AttributeError(f"module 'harness.report' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*_WHERE, *_HOMES, *_MODULES])
