"""The report's 'Why each costs what it costs' section: per setting, at its largest payload,
the collectives, copies, pickling and memory each strategy's records count (``cost_markdown``)."""

from __future__ import annotations

import pandas as pd

from harness.report.md_format import is_missing, md_table
from harness.report.tables import (
    BASELINE,
    RSS_GROWTH,
    floor_method_words,
    human_bytes,
    layout_label,
    layouts_of,
    winning_floor,
)

COST_COLUMNS = [
    ("collectives_leader", "collectives on the leader", "count"),
    ("comm_bytes_leader", "bytes the leader sends", "bytes"),
    ("packed_bytes_leader", "bytes packed on the leader", "bytes"),
    ("copied_bytes_leader", "bytes copied on the leader", "bytes"),
    ("copied_bytes_receiver", "bytes copied on a receiver (max)", "bytes"),
    ("pickled_bytes_leader", "bytes pickled on the leader", "bytes"),
    ("pickled_bytes_receiver", "bytes unpickled on a receiver (max)", "bytes"),
    ("peak_rss_bytes", "peak RSS of a rank (max over ranks; whole process)", "absolute"),
    ("peak_rss_delta_bytes", "peak RSS growth during one call (max over ranks)", "bytes"),
]
"""The section's columns: (record column, header, how a cell is written: count, absolute or
bytes with their multiple of the payload)."""


def _cost_cell(value, kind: str, payload_bytes: float) -> str:
    """A count, an absolute size, or bytes with their multiple of the payload."""
    if is_missing(value):
        return "—"
    if kind == "count":
        return f"{int(value)}"
    if kind == "absolute":
        return human_bytes(value)
    if value == 0:
        return "0"
    share = value / payload_bytes
    return f"{human_bytes(value)} ({'<0.01' if share < 0.005 else f'{share:.2f}'}×)"


def _floor_cost_row(at_size: pd.DataFrame, size: float, columns) -> list[str]:
    """The honest floor's costs at ``size``: each job's winning raw method's reference."""
    timed = at_size[at_size["floor_method"].notna()]
    methods = ", ".join(floor_method_words(m) for m in sorted(set(timed["floor_method"])))
    calls = winning_floor(timed, "collectives_per_call").dropna()
    row = [
        f"*floor* (reference: {methods or 'not timed'})",
        f"{int(calls.median())}" if len(calls) else "—",
    ]
    for col, _, kind in columns:
        value = winning_floor(timed, col).median() if len(timed) else None
        row.append(_cost_cell(value, kind, size))
    return row


def _baseline_cost_row(at_size: pd.DataFrame, size: float, columns) -> list[str] | None:
    """``pickled`` timed as every job's reference, where no job ran it as the strategy under
    test: the figures its reference records carry (counts, bytes sent, memory); None when the
    jobs recorded none. Its local work (packing, pickling) is not in a reference's figures."""
    prefix = f"ref_{BASELINE}_"
    if not any(c.startswith(prefix) for c in at_size.columns):
        return None

    def median(col: str):
        if prefix + col not in at_size.columns:
            return None
        values = pd.to_numeric(at_size[prefix + col], errors="coerce").dropna()
        return values.median() if len(values) else None

    calls = median("collectives_per_call")
    row = [f"*{BASELINE}* (reference)", "—" if calls is None else f"{int(calls)}"]
    return row + [_cost_cell(median(col), kind, size) for col, _, kind in columns]


def cost_markdown(df: pd.DataFrame) -> str:
    """'Why each costs what it costs': per setting, at its largest payload, the collectives,
    copies, pickling and memory each strategy's records count."""
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
        # No job here measured the growth on fresh pages: a column of dashes says nothing.
        columns = [
            c for c in COST_COLUMNS if c[0] != RSS_GROWTH or lay["rss_growth_measured"].any()
        ]
        header = ["strategy", "collectives per call (max over ranks), at each size"]
        header += [c[1] for c in columns]
        rows = []
        for name in at.index:
            by_size = "/".join(f"{int(v)}" for v in counts_by_size.loc[name].dropna())
            rows.append(
                [name, by_size]
                + [_cost_cell(at.loc[name].get(col), kind, size) for col, _, kind in columns]
            )
        at_size = lay[lay["payload_bytes"] == size]
        baseline = None if BASELINE in at.index else _baseline_cost_row(at_size, size, columns)
        rows += [baseline] if baseline else []
        rows.append(_floor_cost_row(at_size, size, columns))
        parts.append(
            f"### {layout_label(df, layout)}, at {human_bytes(size)} ({int(size)} bytes)\n\n"
            "Byte counts are also given as a multiple of the payload; the collectives column "
            "lists the count at each measured size, smallest first. " + _memory_note(lay) + "\n"
        )
        parts.append(md_table(header, rows, align="l" + "r" * (len(header) - 1)))
        parts.append("")
    return "\n".join(parts)


_WHOLE_PROCESS = "Peak RSS is the whole rank process (torch and megatron-core included)."
_GROWTH_HOW = (
    "Its growth during one call is what that call allocates: before one untimed call after the "
    "timed rounds, each rank hands its free heap back to the kernel (glibc `malloc_trim`) and "
    "resets its high-water mark (`/proc/self/clear_refs` 5), so the growth (VmHWM after the call "
    "minus RSS before it) counts every page the call touches afresh: copies, pickles, receive "
    "buffers. Buffers a strategy allocated when it was built or keeps from an earlier call are "
    "not in it."
)
_UNMEASURED_WHY = (
    "recorded before each rank released its free heap before the memory call, or where there "
    "is no glibc or /proc to ask; such a call reuses pages earlier calls freed and its growth "
    "reads 0 whatever it allocates"
)


def _memory_note(lay: pd.DataFrame) -> str:
    """How the two memory columns were measured, and which jobs lack the growth: all of them
    (the column is left out) or some (their cells read —)."""
    missing = int((~lay["rss_growth_measured"]).sum())
    if missing == len(lay):
        return (
            f"{_WHOLE_PROCESS} Its growth during one call is left out: none of these jobs "
            f"measured it on fresh pages ({_UNMEASURED_WHY}). A re-run records it."
        )
    note = f"{_WHOLE_PROCESS} {_GROWTH_HOW}"
    if missing:
        note += f" —: not measured so in {missing} of {len(lay)} jobs here ({_UNMEASURED_WHY})."
    return note
