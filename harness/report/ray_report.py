"""The Ray report, ``ray_report.md``: measured Ray dispatch (every rank vs leader + broadcast)
per layout, cluster and payload, with the cost model's price beside each mode and its figure."""

from __future__ import annotations

from pathlib import Path

from harness.files import write_atomic, write_figure
from harness.job.dispatch_modes import FLOORS
from harness.job.interval import interval_of
from harness.job.verdict import NO_INTERVAL, decide, interval_text
from harness.model.dispatch_prices import load_ray_costs
from harness.report.dispatch_model import compare
from harness.report.dispatch_records import load_dispatch_records
from harness.report.figures import RAY_FIGURE, dispatch_frame, plot_ray_dispatch
from harness.report.md_format import fenced_commands, is_missing, md_table
from harness.report.tables import human_bytes


def _ray_winner(modes: dict[str, float]) -> str:
    """Which of all_ranks, the leader paths and the hop modes (edge_stages, chain) is fastest
    (floors left out: nobody ships them),
    by the rule of ``harness.job.verdict``. A dispatch record keeps no paired interval between
    two modes (a sweep's job times one mode and its raw floor; the older CLI's record keeps
    each mode's own figures only), so the answer names the fastest and its lead, and says there
    is no interval instead of claiming a winner."""
    shipped = {m: p for m, p in modes.items() if m not in FLOORS.values()}
    if len(shipped) < 2:  # one mode (and its floor): nothing to rank
        return "n/a"
    verdict = decide(shipped, lambda mode: None)
    if verdict.kind != NO_INTERVAL:  # a paired interval: the rule's own words
        return verdict.text()
    return (
        f"no interval: {verdict.best} fastest, {verdict.runner_up} "
        f"{verdict.runner_up_ratio:.2f}× its p50 (no paired interval)"
    )


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
            rows.append([where, human_bytes(size), r.mode, _p50_cell(r), cross,
                         f"{pred[0]:.1f}" if pred else "", f"{pred[1]:+.0%}" if pred else ""])  # fmt: skip
        wins.append([where, human_bytes(size), _ray_winner(dict(zip(g["mode"], g["p50_ms"])))])
    header = ["layout, cluster", "payload", "mode", "p50 ms", "MB crossed", "model ms", "error"]
    return (
        "### Where each wins\n\n"
        + md_table(["layout, cluster", "payload per replica", "fastest (p50)"], wins)
        + "\n\n### Measured, with the cost model's figure beside it\n\n"
        + md_table(header, rows)
    )


def _p50_cell(row) -> str:
    """A mode's p50 in ms with its 95 % interval where the record carries one."""
    return interval_text(row.p50_ms, interval_of(row._asdict(), "p50_ms"), unit="")


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

{len(records)} job record(s), {records[0].get("iters", "?")} timed iterations per mode; p50 in
brackets: its 95 % interval where the records carry one. Dispatch records keep no paired
interval of one mode's time over another's (a sweep times each mode in a job of its own), so
the table below names the fastest mode and its lead, never a winner it cannot back.

![Ray to every rank vs leader + broadcast]({RAY_FIGURE})

{ray_dispatch_markdown(records)}
"""
    return write_atomic(root / "ray_report.md", text)
