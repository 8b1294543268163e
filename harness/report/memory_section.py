"""The node's memory in the report: each strategy's copies of the batch resident on its node
at the peak (``node_copies``) by layout and payload size, the memory model's error against the
measured node peaks (``harness.model.memory``), and the largest batch each strategy lets a node
of a given host memory take. Records without the node's memory (made before it was measured):
no section."""

from __future__ import annotations

import numpy as np
import pandas as pd

import strategies
from harness.model import memory
from harness.report.md_format import md_table
from harness.report.sure import bare
from harness.report.tables import layouts_of
from harness.units import human_bytes
from strategies.core.layout import Layout

HOSTS_BYTES = (24 * 2**30, 512 * 2**30, 2 * 2**40)
"""Host memories the report sizes batches for: this project's machines, and two GPU nodes'."""

ERROR_TARGET = 0.15
"""The model's median error the report holds it to."""


def _predicted(row) -> float | None:
    """The model's node peak for one record's strategy, layout and batch."""
    name = bare(row.strategy)
    if name not in strategies.names(include_floor=True):
        return None
    layout = Layout(dp=int(row.dp), pp=int(row.pp), tp=int(row.tp), cp=int(row.cp))
    node = memory.busiest_node(layout)
    footprint = strategies.get_class(name).footprint
    return float(memory.strategy_need(footprint, node, int(row.payload_bytes)))


def memory_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (layout, payload size, strategy) measured: median node copies and peak over
    its jobs, the model's peak and its error (predicted / measured − 1)."""
    if "node_copies" not in df.columns:
        return pd.DataFrame()
    ok = df[(df["status"] == "ok") & df["node_copies"].notna()]
    if ok.empty:
        return pd.DataFrame()
    key = ["layout", "dp", "pp", "tp", "cp", "payload_bytes", "strategy"]
    table = ok.groupby(key, as_index=False).agg(
        node_copies=("node_copies", "median"), node_peak_bytes=("node_peak_bytes", "median"),
        harness_copies=("harness_copies", "median"), node_ranks=("node_ranks", "max"),
    )  # fmt: skip
    table["predicted_bytes"] = [_predicted(r) for r in table.itertuples()]
    table["model_error"] = table["predicted_bytes"] / table["node_peak_bytes"] - 1
    return table


def largest_batch_bytes(copies: float, ranks: int, host_bytes: int) -> int:
    """The largest batch a node of ``host_bytes`` holds with ``copies`` of it resident at the
    peak, beside every rank's base and the harness's copies, within the job margin."""
    room = (1 - memory.MARGIN) * host_bytes - ranks * memory.RANK_BASE_BYTES
    return max(0, int(room / (copies + memory.HARNESS_COPIES)))


def memory_markdown(df: pd.DataFrame) -> str:
    """The section (heading included), or '' without node memory in the records."""
    table = memory_table(df)
    if table.empty:
        return ""
    parts = [
        "## Memory on the node\n\nCopies of the batch resident on the busiest node at a call's "
        "peak (`node_copies`: the leader's own batch included; shared memory counted once; "
        "each strategy measured alone, [records.md](../docs/records.md)), by payload size. "
        "A strategy that would not have fitted beside the others was left out of its job and "
        "is listed as refused in the results."
    ]
    for layout in layouts_of(table.assign(world_size=table["dp"] * table["pp"] * table["tp"]
                                          * table["cp"])):  # fmt: skip
        cell = table[table["layout"] == layout]
        sizes = sorted(cell["payload_bytes"].unique())
        names = sorted(cell["strategy"].unique(), key=lambda n: cell[
            (cell["strategy"] == n)]["node_copies"].max())  # fmt: skip
        body = []
        for name in names:
            mine = cell[cell["strategy"] == name].set_index("payload_bytes")
            row = [name]
            for size in sizes:
                row.append(f"{mine.at[size, 'node_copies']:.2f}" if size in mine.index else "")
            top = mine.loc[max(mine.index)]
            ranks = int(top["node_ranks"])
            row += [human_bytes(largest_batch_bytes(top["node_copies"], ranks, h))
                    for h in HOSTS_BYTES]  # fmt: skip
            body.append(row)
        header = ["strategy", *(f"copies at {human_bytes(s)}" for s in sizes),
                  *(f"largest batch, {human_bytes(h)} host" for h in HOSTS_BYTES)]  # fmt: skip
        parts.append(
            f"### {layout}\n\n" + md_table(header, body, align="l" + "r" * (len(header) - 1))
        )
    errors = table["model_error"].dropna().abs()
    if not errors.empty:
        median = float(np.median(errors))
        worst = table.loc[errors.idxmax()]
        verdict = "within" if median <= ERROR_TARGET else "outside"
        parts.append(
            f"The memory model (each strategy's `footprint`, `harness/model/memory.py`) predicts "
            f"these node peaks with a median error of {median:.0%} over {len(errors)} points "
            f"({verdict} the {ERROR_TARGET:.0%} target); the worst is {worst.strategy} on "
            f"{worst.layout} at {human_bytes(worst.payload_bytes)} "
            f"({worst.model_error:+.0%}). The largest batches assume the measured copies at the "
            f"largest size, every rank's base ({human_bytes(memory.RANK_BASE_BYTES)}) and a "
            f"{memory.MARGIN:.0%} margin."
        )
    return "\n\n".join(parts)
