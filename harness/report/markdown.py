"""The report's text: ``report.md`` with its recommendation, per-setting results, the costs
each strategy's records count, the commands that made the records and a caveat built from the
records' own machine fields (``write_report``)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

from harness.files import write_atomic, write_figure
from harness.job.spec import Scope
from harness.report.figures import RAY_FIGURE, dispatch_frame, plot_ray_dispatch, save_figures
from harness.report.tables import (
    BASELINE,
    RSS_GROWTH,
    SINGLE,
    TIE_FRACTION,
    clean_reason,
    context_line,
    crossovers,
    floor_method_text,
    floor_method_words,
    floor_table,
    human_bytes,
    layout_label,
    layouts_of,
    load,
    recommendation,
    recommendation_ranges,
    shapes_table,
    strategies_of,
    strategy_table,
    unique_values,
    winning_floor,
)

CORE_FIELDS = ("cpu_count", "cpus", "cores")
"""Record fields that may say how many cores the machine had (the first present is used)."""


def caveat(df: pd.DataFrame) -> str:
    """Why to compare ratios: built from the records' hostname, backend, device (and core
    count where the records carry one), not from where the report is read."""
    where = f"host {unique_values(df, 'hostname')}"
    cores = next((unique_values(df, c) for c in CORE_FIELDS if c in df.columns), None)
    if cores and cores != "?":
        where += f" ({cores} cores)"
    devices = set(df["device"].dropna()) if "device" in df.columns else set()
    cpu_only = devices == {"cpu"}
    shared = (
        ": every rank is a CPU process on that host, so a world of more ranks than cores "
        "time-slices them and is CPU-bound"
        if cpu_only
        else ""
    )
    return (
        "Every ratio (`vs_floor`, `vs_baseline`, speedup over `pickled`) is measured inside one "
        "job: the strategy, the floor and `pickled` run interleaved in the same world, so "
        "machine noise hits all three alike. Absolute times are noisier: these jobs ran on "
        f"{where}, backend {unique_values(df, 'backend')}, device "
        f"{unique_values(df, 'device')}{shared}. Compare ratios, not absolute times across "
        "jobs or runs."
    )


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
        runners = sorted({x for x in r["runner_up"] if isinstance(x, str)})  # NaN: none
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
            "winner vs_floor (×, lower is better)",
            "winner speedup over pickled (×, higher is better)",
            "runner-up",
            "runner-up vs_floor (×, lower is better)",
        ],
        rows,
        align="lllrrlr",
    )
    note = (
        f"The winner at a size is the strategy with the lowest `vs_floor` (its p50 over the floor "
        f"p50 of the same job). '≈ runner-up at …' marks sizes where the runner-up is within "
        f"{TIE_FRACTION:.0%} of the winner, "
        "inside the run-to-run noise of such jobs: either is a fine choice there, and a "
        "crossover next to a tie is not a clear one."
    )
    return table + "\n\n" + note + "\n\n" + "\n".join(f"- {line}" for line in crossovers(rec))


RESULT_TABLES = (
    (
        "p50_us",
        "p50 per call (ms, median over jobs; lower is better)",
        lambda v: f"{v / 1e3:.2f}",
    ),
    (
        "vs_floor",
        "`vs_floor`: p50 / floor p50, both timed in the same job (×; lower is better, 1× is the "
        "floor, below 1× beats it)",
        lambda v: f"{v:.2f}×",
    ),
    (
        "speedup_over_pickled",
        "Speedup over `pickled`: pickled's p50 / the strategy's p50, both timed in the same job "
        "(×; higher is better, above 1× is faster than pickled)",
        lambda v: f"{v:.2f}×",
    ),
)
"""The per-layout tables: (column, caption saying its unit and which way is better, cell)."""


def results_markdown(df: pd.DataFrame) -> str:
    """Per layout, three tables of every strategy at every size: p50 per call, ``vs_floor`` and
    the speedup over ``pickled`` (each caption says which way is better), the floor in words."""
    table, floors = strategy_table(df), floor_table(df)
    parts = []
    for layout in layouts_of(df):
        tab = table[table["layout"] == layout]
        fl = floors[floors["layout"] == layout].set_index("payload_bytes")
        sizes = sorted(tab["payload_bytes"].dropna().unique())
        header = ["strategy", *[human_bytes(s) for s in sizes]]
        parts.append(f"### {layout_label(df, layout)}\n")
        reasons: dict[str, str] = {}
        for column, caption, fmt in RESULT_TABLES:
            rows = [
                [name, *[_result_cell(tab, name, s, column, fmt, reasons) for s in sizes]]
                for name in strategies_of(df)
            ]
            rows += _floor_rows(fl, sizes, column)
            parts.append(f"**{caption}**\n")
            parts.append(_md_table(header, rows))
            if column == "p50_us" and not fl.empty:
                parts += ["", *_floor_method_lines(fl, sizes)]
            parts.append("")
        parts += [f"- **{name}**: n/a here. {reason}" for name, reason in reasons.items()]
    return "\n".join(parts).rstrip("\n") + "\n"


def _floor_method_lines(fl: pd.DataFrame, sizes) -> list[str]:
    """Which raw method was the floor at each size, in words; one line when every size agrees."""
    texts = {s: floor_method_text(fl.loc[s]) for s in sizes if s in fl.index}
    if len(texts) > 1 and len(set(texts.values())) == 1:
        return [f"- *floor* at every size: fastest raw method: {next(iter(texts.values()))}"]
    return [f"- *floor* at {human_bytes(s)}: fastest raw method: {t}" for s, t in texts.items()]


def _result_cell(tab: pd.DataFrame, name: str, size, column: str, fmt, reasons: dict) -> str:
    """One strategy's figure at one size: not run, n/a (its reason kept for below the tables)
    or ``fmt`` of ``column``."""
    hit = tab[(tab["strategy"] == name) & (tab["payload_bytes"] == size)]
    if hit.empty:
        return "not run"
    row = hit.iloc[0]
    if not row["supported"]:
        reasons[name] = clean_reason(row["error"])
        return "n/a"
    value = row.get(column)
    return "—" if value is None or math.isnan(value) else fmt(value)


def _floor_rows(fl: pd.DataFrame, sizes, column: str) -> list[list[str]]:
    """The floor's rows in the table of ``column``: in the p50 table the honest floor (median
    over jobs) and, where another method beat it, the single broadcast; in the vs_floor table
    that single broadcast's ratio to the floor. The speedup table has none."""

    def row(label, text) -> list[str]:
        return [label] + [text(fl.loc[s]) if s in fl.index else "—" for s in sizes]

    beaten = not fl.empty and (fl["floor_method"] != SINGLE).any()
    single = "*one raw broadcast* (the single-broadcast floor)"
    if column == "p50_us":
        rows = [row("*floor*: fastest raw method (median over jobs)",
                    lambda r: f"{r['floor_p50_us'] / 1e3:.2f}")]  # fmt: skip
        if beaten:
            rows.append(row(single, lambda r: f"{r['floor_single_p50_us'] / 1e3:.2f}"))
        return rows if not fl.empty else []
    if column == "vs_floor" and beaten:
        return [row(single, lambda r: f"{r['floor_single_p50_us'] / r['floor_p50_us']:.2f}×")]
    return []


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
        parts.append(_md_table(header, rows, align="l" + "r" * (len(header) - 1)))
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


def commands_markdown(df: pd.DataFrame) -> str:
    """The command(s) recorded in the records, runnable form first."""
    commands = sorted({str(c) for c in df.get("command", pd.Series(dtype=str)).dropna()})
    lines = []
    for cmd in commands:
        # Hydra records argv[0] as the module's file; the runnable form is `python -m harness`.
        runnable = re.sub(r"^__main__\.py\b", "python -m harness", cmd)
        lines.append(f"```\n{runnable}\n```")
    return "\n".join(lines) if lines else "(the records name no command)"


def _ms(value) -> str:
    missing = value is None or (isinstance(value, float) and math.isnan(value))
    return "—" if missing else f"{value / 1e3:.2f}"


def _x(value) -> str:
    missing = value is None or (isinstance(value, float) and math.isnan(value))
    return "—" if missing else f"{value:.2f}×"


def shapes_markdown(df: pd.DataFrame) -> str:
    """A section for jobs whose calls change shape (``workload``), one table per job and one
    row per shape: its p50 inside the sequence beside its floor, pickled and its own steady
    state, all from that job. Empty when every job moved one shape."""
    tab = shapes_table(df)
    if tab.empty:
        return ""
    header = ["shape", "rows", "seq_len", "bytes", "calls", "p50 ms", "floor ms", "vs_floor",
              "pickled ms", "vs_baseline", "steady ms", "vs_steady"]  # fmt: skip
    parts = [
        "## Varying workloads, shape by shape\n",
        "Jobs whose calls cycle through shapes (`workload`); their rows above are their own "
        "setting, never merged with one-shape jobs. Per shape: its calls inside the sequence, "
        "the floor and `pickled` timed on the same calls, and the same shape alone "
        "(`steady`, when the job ran `steady_iters`). `vs_steady` above 1: the shape pays "
        "for the one before it.\n",
    ]
    for (layout, workload, strategy), g in tab.groupby(["layout", "workload", "strategy"]):
        rows = [
            [str(r.shape), "+".join(map(str, r.dp_rows)) if isinstance(r.dp_rows, list)
             else str(r.batch_size), str(r.seq_len), human_bytes(r.payload_bytes), str(r.calls),
             _ms(r.p50_us), _ms(r.floor_p50_us), _x(r.vs_floor), _ms(r.baseline_p50_us),
             _x(r.vs_baseline), _ms(r.steady_p50_us), _x(r.vs_steady)]
            for r in g.itertuples()
        ]  # fmt: skip
        parts += [f"**{strategy}**, {layout}, `{workload}`\n", _md_table(header, rows), ""]
    return "\n".join(parts)


def write_report(root: Path | str, df: pd.DataFrame | None = None) -> Path:
    """Write report.md and the PNG figures into ``root``; returns the report's path."""
    root = Path(root)
    df = load(root) if df is None else df
    figures = save_figures(df, root)
    n_refused = int((~df["supported"]).sum())
    title_figs = "\n\n".join(f"![{name}]({path.name})" for name, path in figures.items())
    text = f"""# bcastbench report: {root.name}

{context_line(df)}. {len(df)} job record(s), {n_refused} of them unsupported (shown as n/a){_failed_note(df)};
layouts {", ".join(layouts_of(df))}; git {unique_values(df, "git_rev")}, torch {unique_values(df, "torch_version")}.

## How this was produced

{commands_markdown(df)}

{caveat(df)} The floor is the fastest raw way to move an already packed buffer of the payload's
size from the leader to every rank of its replica: one broadcast, a few concurrent chunk
broadcasts and the hop orders the layout allows, all timed in the same job. Every job measures
it, so each layout and size has several floor measurements: the figures and tables use their
median, say over how many jobs and name the method that won; the single broadcast stays beside
it where another method beat it.

Regenerate this report with `bcastbench report {root}`.

## Recommendation

{recommendation_markdown(df)}

## Figures

{title_figs}

## Results per layout

Three tables per layout: p50 per call (lower is better), `vs_floor` (lower is better) and the
speedup over `pickled` (1 / `vs_baseline`; higher is better). Both ratios are taken inside each
job, then the median over jobs. n/a: the strategy refuses the layout (reason below the
tables); not run: no job measured it.

{results_markdown(df)}

{shapes_markdown(df)}

## Why each costs what it costs

{cost_markdown(df)}
"""
    return write_atomic(root / "report.md", text)


def _failed_note(df: pd.DataFrame) -> str:
    """How many failed jobs the tables leave out (their records keep status and error)."""
    n = int(df.attrs.get("n_failed", 0))
    return f"; {n} failed job(s) left out (their result.json says why)" if n else ""


# -- Ray dispatch (harness.job.dispatch records) ---------------------------------------------
RAY_TIE = 0.10
"""Relative p50 difference below which the Ray section calls two modes even."""


def load_dispatch_records(root: Path | str) -> list[dict]:
    """Every dispatch record in the JSON lists directly under ``root`` (the ``dispatch.json``
    a ``bcastbench ray-dispatch`` or ``ray-emulated`` sweep writes), then those of a
    ``bcastbench run world=ray ray.dispatch=...`` sweep's result.json files, merged into one
    record per setting (``_merge_hydra_dispatch``)."""
    import json

    out = []
    for path in sorted(Path(root).glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, list):
            # A job whose first mode was refused timed nothing: it has no modes to show.
            out += [
                r for r in data
                if isinstance(r, dict) and r.get("scope") == DISPATCH_SCOPE
                and isinstance(r.get("modes"), dict)
            ]  # fmt: skip
    jobs = [json.loads(p.read_text()) for p in sorted(Path(root).rglob("result.json"))]
    return out + _merge_hydra_dispatch(
        [r for r in jobs if r.get("scope") == DISPATCH_SCOPE and r.get("status") == "ok"]
    )


DISPATCH_SCOPE = Scope.DISPATCH.value
_SAME_RUN = (
    "layout", "order", "world_size", "payload", "batch_size", "seq_len", "workload", "dp_split",
    "backend",
)  # fmt: skip
"""What one setting of a dispatch sweep shares (a varying workload is its own setting, never
merged with a constant one of the same largest shape)."""


def _hashable(value):
    """A record's value as a dict key part (a dp_split list becomes a tuple)."""
    return tuple(value) if isinstance(value, list) else value


def _merge_hydra_dispatch(jobs: list[dict]) -> list[dict]:
    """One dispatch job times its mode and that mode's raw floor; a sweep's jobs of one setting
    (layout, payload, size, backend, emulated links) become one record holding every mode, as
    the dispatch CLI writes it. A floor several jobs measured keeps its median-p50 row."""
    groups: dict[tuple, list[dict]] = {}
    for job in jobs:
        key = tuple(_hashable(job.get(k)) for k in _SAME_RUN) + tuple(
            job.get(k) for k in sorted(job) if k.startswith("emulate_")
        )
        groups.setdefault(key, []).append(job)
    merged = []
    for group in groups.values():
        rows: dict[str, list[dict]] = {}
        for job in group:
            for mode, row in job["modes"].items():
                rows.setdefault(mode, []).append(row)
        modes = {
            m: sorted(r, key=lambda x: x["p50_us"])[(len(r) - 1) // 2] for m, r in rows.items()
        }
        first = group[0]
        drop = ("modes", "mode", "dispatch", "strategy", "options", "status")
        merged.append({**{k: v for k, v in first.items() if k not in drop}, "modes": modes})
    return merged


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
            cross = "" if math.isnan(r.cross_mb) else f"{r.cross_mb:.2f}"
            rows.append([where, human_bytes(size), r.mode, f"{r.p50_ms:.1f}", cross,
                         f"{pred[0]:.1f}" if pred else "", f"{pred[1]:+.0%}" if pred else ""])  # fmt: skip
        wins.append([where, human_bytes(size), _ray_winner(dict(zip(g["mode"], g["p50_ms"])))])
    header = ["layout, cluster", "payload", "mode", "p50 ms", "MB crossed", "model ms", "error"]
    return (
        "### Where each wins\n\n"
        + _md_table(["layout, cluster", "payload per replica", "winner (p50)"], wins)
        + "\n\n### Measured, with the cost model's figure beside it\n\n"
        + _md_table(header, rows)
    )


def _ray_model(records: list[dict]) -> dict:
    """{(panel, payload, mode): (model ms, error)} from harness.model.dispatch_prices; {} when the
    Ray costs are not calibrated."""
    try:
        # Here, for Ray records only: pricing them builds payloads (torch); a report of
        # broadcast records imports neither.
        from harness.model.dispatch_prices import load_ray_costs
        from harness.report.dispatch_model import compare

        ray = load_ray_costs()
    except Exception:
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

{chr(10).join(f"```{chr(10)}{c}{chr(10)}```" for c in commands) or "(the records name no command)"}

{len(records)} job record(s), {records[0].get("iters", "?")} timed iterations per mode; a
2-core shared host: differences within {RAY_TIE:.0%} are noise.

![Ray to every rank vs leader + broadcast]({RAY_FIGURE})

{ray_dispatch_markdown(records)}
"""
    return write_atomic(root / "ray_report.md", text)
