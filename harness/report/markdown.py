"""The broadcast report's text: ``report.md`` with its recommendation, per-setting results, the
costs section (``cost_section``), the commands that made the records and a caveat built from the
records' own machine fields (``write_report``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pandas as pd

from harness.files import write_atomic
from harness.job.interval import interval_of
from harness.job.verdict import interval_text
from harness.report import figures_memory, figures_pull, figures_sizes
from harness.report.cost_section import cost_markdown
from harness.report.drawing import draw_beside
from harness.report.figures import PLOTS, save_figure
from harness.report.md_format import fenced_commands, is_missing, md_table, ratio_range
from harness.report.memory_section import memory_markdown
from harness.report.pull_section import push_pull_markdown
from harness.report.sure import (
    MARK,
    check_samples,
    mark_legend,
    oversubscribed_cells,
    samples_markdown,
)
from harness.report.tables import (
    SINGLE,
    clean_reason,
    context_line,
    crossovers,
    floor_method_text,
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
)

SIZES_FIGURE = "time and busbw (nccl-tests)"
"""The link text of ``figures_sizes``' figure."""

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


def _answer_cell(r: dict) -> str:
    """The verdict in bold where it names strategies to use: ``**shm**``, ``**shm** ≈
    **auto** (tied)``, ``shm (no interval)``."""
    if r["kind"] == "tied":
        names = r["answer"].removesuffix(" (tied)").split(" ≈ ")
        return " ≈ ".join(f"**{n}**" for n in names) + " (tied)"
    return r["answer"] if r["kind"] == "no interval" else f"**{r['answer']}**"


TIE_NOTE = (
    "The fastest strategy at a size has the lowest `vs_floor` (its p50 over the floor p50 of "
    "the same job). It is named alone only where the 95 % interval of every other strategy's "
    "time over its own, paired round by round in the same job, lies above 1; where an interval "
    "holds 1 the strategies are tied and each of them is listed (`a ≈ b (tied)`: either is a "
    "fine choice there, and a crossover next to a tie is not a clear one). `no interval`: the "
    "records give no paired interval (older records, fewer than 6 rounds, or strategies timed "
    "in different jobs), so no winner is claimed."
)
"""What the recommendation table's verdicts mean (``harness.job.verdict``)."""


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
        paired = [interval_text(v / w if w else None, i) for v, w, i in
                  zip(r["runner_up_vs_floor"], r["winner_vs_floor"], r["runner_up_interval"])
                  if not is_missing(v)]  # fmt: skip
        over = MARK if any(isinstance(o, str) for o in r["oversubscribed"]) else ""
        rows.append(
            [
                f"{r['layout']}{over}",
                span,
                _answer_cell(r),
                ratio_range(r["winner_vs_floor"]),
                ratio_range(r["winner_speedup_over_pickled"]),
                ", ".join(runners) or "—",
                "; ".join(paired) or "—",
            ]
        )
    table = md_table(
        [
            "layout",
            "payload range (measured sizes)",
            "recommended (lowest vs_floor; ≈ tied)",
            "winner vs_floor (×, lower is better)",
            "winner speedup over pickled (×, higher is better)",
            "runner-up",
            "runner-up / winner (×, paired 95 % interval)",
        ],
        rows,
        align="lllrrlr",
    )
    legend = mark_legend(oversubscribed_cells(df))
    return (table + "\n\n" + TIE_NOTE + (f"\n\n{legend}" if legend else "") + "\n\n"
            + "\n".join(f"- {line}" for line in crossovers(rec)))  # fmt: skip


RESULT_TABLES = (
    ("p50_us", "p50 per call (ms, median over jobs; lower is better)", 1e-3, ""),
    (
        "vs_floor",
        "`vs_floor`: p50 / floor p50, both timed in the same job (×; lower is better, 1× is the "
        "floor, below 1× beats it)",
        1.0,
        "×",
    ),
    (
        "speedup_over_pickled",
        "Speedup over `pickled`: pickled's p50 / the strategy's p50, both timed in the same job "
        "(×; higher is better, above 1× is faster than pickled)",
        1.0,
        "×",
    ),
)
"""The per-layout tables: (column, caption saying its unit and which way is better, the scale
of its cells, their unit). A cell is the figure and, where the records carry one, its 95 %
interval in brackets (``lo``/``hi`` columns of ``strategy_table``)."""


def _with_interval(column: str, scale: float, unit: str):
    """The cell of ``column``: ``1.23× [1.10–1.40]``, the figure alone without an interval."""

    def cell(row) -> str:
        interval = interval_of(row, column)
        bounds = None if interval is None else interval.scaled(scale)
        return interval_text(row[column] * scale, bounds, unit)

    return cell


def results_markdown(df: pd.DataFrame) -> str:
    """Per layout, three tables of every strategy at every size: p50 per call, ``vs_floor`` and
    the speedup over ``pickled`` (each caption says which way is better), the floor in words."""
    table, floors = strategy_table(df), floor_table(df)
    over = oversubscribed_cells(df)
    parts = []
    for layout in layouts_of(df):
        tab = table[table["layout"] == layout]
        fl = floors[floors["layout"] == layout].set_index("payload_bytes")
        sizes = sorted(tab["payload_bytes"].dropna().unique())
        # A cell is a layout and a size: its column carries the mark for every strategy in it.
        marks = {s: MARK if (layout, s) in over else "" for s in sizes}
        header = ["strategy", *[human_bytes(s) + marks[s] for s in sizes]]
        parts.append(f"### {layout_label(df, layout)}\n")
        legend = mark_legend({k: v for k, v in over.items() if k[0] == layout})
        if legend:
            parts.append(f"{legend}\n")
        reasons: dict[str, str] = {}
        for column, caption, scale, unit in RESULT_TABLES:
            fmt = _with_interval(column, scale, unit)
            rows = [
                [name, *[_result_cell(tab, name, s, column, fmt, reasons) for s in sizes]]
                for name in strategies_of(df)
            ]
            rows += _floor_rows(fl, sizes, column)
            parts.append(f"**{caption}**\n")
            parts.append(md_table(header, rows))
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
    return "—" if value is None or math.isnan(value) else fmt(row)


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


def commands_markdown(df: pd.DataFrame) -> str:
    """The command(s) recorded in the records, runnable form first."""
    commands = sorted({str(c) for c in df.get("command", pd.Series(dtype=str)).dropna()})
    # Hydra records argv[0] as the module's file; the runnable form is `python -m harness`.
    return fenced_commands(re.sub(r"^__main__\.py\b", "python -m harness", c) for c in commands)


def _ms(value) -> str:
    return "—" if is_missing(value) else f"{value / 1e3:.2f}"


def _x(value) -> str:
    return "—" if is_missing(value) else f"{value:.2f}×"


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
        parts += [f"**{strategy}**, {layout}, `{workload}`\n", md_table(header, rows), ""]
    return "\n".join(parts)


@dataclass(frozen=True)
class Written:
    """What ``write_report`` wrote: report.md and the figures beside it."""

    path: Path
    figures: tuple[Path, ...]


def write_report(root: Path | str, df: pd.DataFrame | None = None) -> Written:
    """Write report.md and the PNG figures into ``root``. The figures are drawn beside the
    text (``drawing.draw_beside``: on a second core where there is one)."""
    root = Path(root)
    df = load(root) if df is None else df
    push_pull, memory = push_pull_markdown(df), memory_markdown(df)
    # Most expensive first, so that the last figures taken are the short ones.
    draws = {
        "speedup": partial(save_figure, df, root, "speedup"),
        SIZES_FIGURE: partial(figures_sizes.save, df, root),
        "push vs pull": partial(figures_pull.save, df, root) if push_pull else None,
        "latency": partial(save_figure, df, root, "latency"),
        "overhead": partial(save_figure, df, root, "overhead"),
        "algbw": partial(save_figure, df, root, "algbw"),
        "copies per node": partial(figures_memory.save, df, root) if memory else None,
    }
    draws = {name: draw for name, draw in draws.items() if draw is not None}
    paths, parts = draw_beside(list(draws.values()), lambda: _text_parts(df))
    drawn = dict(zip(draws, paths))
    text = _report_text(root, df, parts, push_pull, memory, drawn)
    return Written(write_atomic(root / "report.md", text), tuple(p for p in paths if p))


def _text_parts(df: pd.DataFrame) -> dict[str, str]:
    """The report's sections that take time and no figure, by name."""
    return {
        "recommendation": recommendation_markdown(df),
        "checked": samples_markdown(check_samples(df)),
        "results": results_markdown(df),
        "shapes": shapes_markdown(df),
        "cost": cost_markdown(df),
    }


def _with_figure(section: str, name: str, path: Path | None) -> str:
    """A section with its figure linked below it (the section alone where none was drawn)."""
    return f"{section}\n\n![{name}]({path.name})" if path is not None else section


def _report_text(root: Path, df: pd.DataFrame, parts: dict[str, str], push_pull: str,
                 memory: str, drawn: dict[str, Path | None]) -> str:  # fmt: skip
    n_refused = int((~df["supported"]).sum())
    links = "\n\n".join(
        f"![{name}]({drawn[name].name})" for name in (*PLOTS, SIZES_FIGURE) if drawn.get(name)
    )
    return f"""# bcastbench report: {root.name}

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

{parts["recommendation"]}

{_with_figure(push_pull, "push vs pull", drawn.get("push vs pull"))}

{_with_figure(memory, "copies per node", drawn.get("copies per node"))}

## Figures

{links}

## Checked against the samples

{parts["checked"]}

## Results per layout

Three tables per layout: p50 per call (lower is better), `vs_floor` (lower is better) and the
speedup over `pickled` (1 / `vs_baseline`; higher is better). Both ratios are taken inside each
job, then the median over jobs; in brackets each figure's 95 % interval (paired by round for a
ratio; the widest of the jobs' where several measured it), where the records carry one. {MARK}
on a size: its jobs ran more ranks on a node than the host had cores. n/a: the strategy refuses the layout (reason below the
tables); not run: no job measured it.

{parts["results"]}

{parts["shapes"]}

## Why each costs what it costs

{parts["cost"]}
"""


def _failed_note(df: pd.DataFrame) -> str:
    """How many failed jobs the tables leave out (their records keep status and error)."""
    n = int(df.attrs.get("n_failed", 0))
    return f"; {n} failed job(s) left out (their result.json says why)" if n else ""
