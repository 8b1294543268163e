"""The Ray report, ``ray_report.md``: measured Ray dispatch (every rank vs leader + broadcast)
per layout, cluster and payload, with the cost model's price beside each mode and its figure."""

from __future__ import annotations

from pathlib import Path

from harness.files import write_atomic, write_figure
from harness.model.dispatch_prices import load_ray_costs
from harness.report.dispatch_model import compare
from harness.report.dispatch_records import load_dispatch_records
from harness.report.figures import RAY_FIGURE, dispatch_frame, plot_ray_dispatch
from harness.report.md_format import fenced_commands, is_missing, md_table
from harness.report.tables import human_bytes

RAY_TIE = 0.10
"""Relative p50 difference below which the Ray section calls two modes even."""


def _ray_winner(modes: dict[str, float]) -> str:
    """all_ranks against the best leader + broadcast (floors left out: nobody ships them)."""
    leaders = {m: p for m, p in modes.items() if m.startswith("leader:") and m != "leader:floor"}
    if "all_ranks" not in modes or not leaders:
        return "n/a"
    best = min(leaders, key=leaders.get)
    ratio = leaders[best] / modes["all_ranks"]
    if abs(ratio - 1) <= RAY_TIE:
        return f"even: all_ranks and {best} within {RAY_TIE:.0%} ({ratio:.2f}×)"
    if ratio > 1:
        return f"**all_ranks**, {ratio:.2f}× faster than the best leader path ({best})"
    return f"**{best}**, {1 / ratio:.2f}× faster than all_ranks"


def ray_dispatch_markdown(records: list[dict]) -> str:
    """The measured table (p50, cross-node MB, the model's figure and its error) and, per
    layout, cluster and payload, which of all_ranks and leader + broadcast wins."""
    df = dispatch_frame(records)
    model = _ray_model(records)
    rows, wins = [], []
    for (panel, size), g in df.groupby(["panel", "payload_bytes"], sort=False):
        where = panel.replace("\n", ", ")
        for r in g.itertuples():
            pred = model.get((where, size, r.mode))
            cross = "" if is_missing(r.cross_mb) else f"{r.cross_mb:.2f}"
            rows.append([where, human_bytes(size), r.mode, f"{r.p50_ms:.1f}", cross,
                         f"{pred[0]:.1f}" if pred else "", f"{pred[1]:+.0%}" if pred else ""])  # fmt: skip
        wins.append([where, human_bytes(size), _ray_winner(dict(zip(g["mode"], g["p50_ms"])))])
    header = ["layout, cluster", "payload", "mode", "p50 ms", "MB crossed", "model ms", "error"]
    return (
        "### Where each wins\n\n"
        + md_table(["layout, cluster", "payload per replica", "winner (p50)"], wins)
        + "\n\n### Measured, with the cost model's figure beside it\n\n"
        + md_table(header, rows)
    )


def _ray_model(records: list[dict]) -> dict:
    """{(panel, payload, mode): (model ms, error)} from harness.model.dispatch_prices; {} when the
    Ray costs are not calibrated."""
    try:
        ray = load_ray_costs()
    except Exception:  # a missing or unreadable cost file leaves the model's columns empty
        return {}

    panels = dispatch_frame(records)[["panel", "payload_bytes", "mode"]]
    rows = compare(records, ray)
    return {
        (p.replace("\n", ", "), s, m): (r["predicted_ms"], r["error"])
        for (p, s, m), r in zip(panels.itertuples(index=False), rows)
    }


def write_ray_report(root: Path | str) -> Path:
    """``ray_report.md`` and the Ray figure for the dispatch records under ``root``."""
    root = Path(root)
    records = load_dispatch_records(root)
    if not records:
        raise ValueError(f"no dispatch records (JSON lists of scope dispatch+broadcast) in {root}")
    write_figure(root / RAY_FIGURE, plot_ray_dispatch(records))
    commands = sorted({r.get("command", "") for r in records} - {""})
    text = f"""# Ray to every rank vs leader + broadcast: {root.name}

Scope `dispatch+broadcast`: from "the driver holds the global batch" to "every rank of every
replica holds its chunk", chunking and `ray.put` inside the time, every rank verified bit for
bit. `all_ranks`: one object per replica, every rank gets the same ref (verl, NeMo-RL,
OpenRLHF); `leader:<strategy>`: the object to each replica's leader, then that broadcast
(ROLL); `leader:floor` and `all_ranks:raw`: each path with the batch as one flat array. MB
crossed: bytes on the emulated node links per call. Model: `harness.model.dispatch_prices`.
With rails (one link per rank), the broadcasts spread over the rails but Ray's object manager
uses the node's one address, so its transfers all cross on rail 0.

## How this was produced

{fenced_commands(commands)}

{len(records)} job record(s), {records[0].get("iters", "?")} timed iterations per mode; a
2-core shared host: differences within {RAY_TIE:.0%} are noise.

![Ray to every rank vs leader + broadcast]({RAY_FIGURE})

{ray_dispatch_markdown(records)}
"""
    return write_atomic(root / "ray_report.md", text)
