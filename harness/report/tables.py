"""The report's tables: every record as one row (``load``), medians per run setting, strategy
and payload size (``strategy_table``), the floor per setting and size, the recommendation, and
the labels every figure and table shares.

A *setting* is everything that makes two runs different besides the strategy and the payload
size: layout shape and order, world size, backend, device, payload kind and sequence length
(and the emulated cluster's links, when there is one). ``load`` writes it into the ``layout``
column (the layout's name, plus whatever else varies among the records), so runs that differ in
any of them are never merged into one median.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from harness.job.interval import interval_end, interval_keys
from harness.job.label import FLOOR, Label
from harness.job.verdict import without_servers
from harness.report import collect
from harness.report.sure import cell_verdict, host_text, oversubscribed_cells
from harness.units import human_bytes

BASELINE = "pickled"
"""Every job times this beside the strategy under test; speedups are over it."""
SINGLE = "one"
"""The floor method that is one raw broadcast (the only floor older records timed)."""
SETTING = (
    "backend", "device", "world_size", "dp", "pp", "tp", "cp", "order", "payload", "seq_len",
    "emulate_nodes", "emulate_links", "emulate_rate_mbit", "world", "workload",
)  # fmt: skip
"""Record fields that make two runs of one strategy at one payload size different runs (a
varying workload's rows never merge with a constant one's: ``workload`` is null there)."""
INTERVALS = tuple(key for field in ("p50_us", "vs_floor", "vs_baseline")
                  for key in interval_keys(field))  # fmt: skip
"""The keys of the 95 % intervals records carry (``harness.job.interval``); older records have
none (NaN)."""


# -- the table ------------------------------------------------------------------------------
def load(root: Path | str) -> pd.DataFrame:
    """Every record under ``root`` (``collect.load``), with the columns the report needs and
    ``layout`` naming the run setting (``_label_settings``)."""
    return of_records(collect.load(root))


def of_records(records: pd.DataFrame) -> pd.DataFrame:
    """``load``'s table from records already read (``collect.load``; not changed)."""
    df = _broadcast_jobs_that_ran(records.copy())
    if df.empty:
        return df
    df = _label_options(df)
    if "supported" not in df.columns:
        df["supported"] = True
    df["supported"] = df["supported"].fillna(True).astype(bool)
    if "error" not in df.columns:
        df["error"] = None
    # A refused job has no payload_bytes of its own; the same payload spec elsewhere has it.
    key = ["payload", "batch_size", "seq_len"]
    if "payload_bytes" not in df.columns:
        df["payload_bytes"] = np.nan
    known = df.dropna(subset=["payload_bytes"]).groupby(key)["payload_bytes"].max()
    missing = df["payload_bytes"].isna()
    if missing.any():
        df.loc[missing, "payload_bytes"] = [
            known.get(tuple(row), np.nan) for row in df.loc[missing, key].itertuples(index=False)
        ]
    for col in ("p50_us", "p90_us", "floor_p50_us", "vs_floor", "vs_baseline", "algbw_gbps",
                "busbw_gbps", *INTERVALS):  # fmt: skip
        # Refused rows (and jobs run without a reference) leave gaps: make them NaN, not None.
        df[col] = pd.to_numeric(df[col], errors="coerce") if col in df.columns else np.nan
    df["speedup_over_pickled"] = 1.0 / df["vs_baseline"]
    # The speedup is 1 / vs_baseline, so its interval is that one's turned round.
    low, high = interval_keys("speedup_over_pickled")
    base_low, base_high = interval_keys("vs_baseline")
    df[low], df[high] = 1.0 / df[base_high], 1.0 / df[base_low]
    return _label_settings(_honest_floor(_honest_rss_growth(df)))


RSS_GROWTH = "peak_rss_delta_bytes"
RSS_RELEASED = "peak_rss_heap_released"
"""Set (in the job's reference figures) by jobs that handed the free heap back to the kernel
before the memory call, so that call's RSS growth counts every page it allocated."""


def _honest_rss_growth(df: pd.DataFrame) -> pd.DataFrame:
    """``rss_growth_measured`` per row, and every peak-RSS growth figure of a job that did not
    release the free heap first made NaN: such a call reused pages earlier rounds had freed, so
    its growth read 0 whatever it allocated. The whole-process peak stays as recorded."""
    flags = [c for c in df.columns if c == RSS_RELEASED or c.endswith(f"_{RSS_RELEASED}")]
    measured = pd.Series(False, index=df.index)
    for col in flags:
        measured |= df[col].eq(True)
    df["rss_growth_measured"] = measured
    for col in [c for c in df.columns if c == RSS_GROWTH or c.endswith(f"_{RSS_GROWTH}")]:
        df[col] = pd.to_numeric(df[col], errors="coerce").where(measured)
    return df


def floor_reference(method: str) -> str:
    """The reference name a floor method's figures are recorded under (``floor`` for the
    single broadcast, ``floor:<method>`` for the others)."""
    return FLOOR if method in (None, "", SINGLE) else str(Label(FLOOR, method))


def winning_floor(df: pd.DataFrame, field: str) -> pd.Series:
    """Per row, ``field`` of the floor method that won in that job (``ref_<name>_<field>``);
    NaN where the job recorded no such reference."""
    out = pd.Series(np.nan, index=df.index, dtype=float)
    for method, rows in df.groupby("floor_method").groups.items():
        col = f"ref_{floor_reference(method)}_{field}"
        if col in df.columns:
            out.loc[rows] = pd.to_numeric(df.loc[rows, col], errors="coerce")
    return out


def _honest_floor(df: pd.DataFrame) -> pd.DataFrame:
    """Every row gets ``floor_method`` and ``floor_single_p50_us``. Records written before the
    floor became a family timed the single broadcast only: their floor *is* that broadcast."""
    if "floor_method" not in df.columns:
        df["floor_method"] = None
    timed = df["floor_p50_us"].notna()
    df.loc[timed & df["floor_method"].isna(), "floor_method"] = SINGLE
    single = pd.Series(np.nan, index=df.index, dtype=float)
    for col in ("floor_single_p50_us", f"ref_{FLOOR}_p50_us", "floor_p50_us"):
        if col in df.columns:
            single = single.fillna(pd.to_numeric(df[col], errors="coerce"))
    df["floor_single_p50_us"] = single.where(timed)
    df["vs_floor_single"] = df["p50_us"] / df["floor_single_p50_us"]
    return df


def _broadcast_jobs_that_ran(df: pd.DataFrame) -> pd.DataFrame:
    """The rows this report is about: broadcast-scope jobs (Ray dispatch records have their
    own report) that did not fail. How many failed goes to ``df.attrs["n_failed"]``."""
    if df.empty:
        df.attrs["n_failed"] = 0
        return df
    failed = df["status"] == "failed" if "status" in df.columns else pd.Series(False, df.index)
    keep = ~failed
    if "scope" in df.columns:
        keep &= df["scope"].fillna("broadcast") == "broadcast"
    out = df[keep].reset_index(drop=True)
    out.attrs["n_failed"] = int(failed.sum())
    return out


def options_text(options) -> str:
    """A strategy's options as one stable string (``serialization=dataclass``); '' for none."""
    if not isinstance(options, dict) or not options:
        return ""
    return ",".join(f"{k}={options[k]}" for k in sorted(options))


def _label_options(df: pd.DataFrame) -> pd.DataFrame:
    """A strategy run with more than one set of options becomes one strategy per set
    (``pickled [serialization=dataclass]``), so no table or figure merges them; the name
    alone stays where a strategy ran with one set. ``strategy_name`` keeps the bare name."""
    opts = df["options"] if "options" in df.columns else pd.Series([None] * len(df), df.index)
    df["options"] = [options_text(o) for o in opts]
    df["strategy_name"] = df["strategy"]
    several = df.groupby("strategy")["options"].nunique()
    split = df["strategy"].isin(several[several > 1].index) & (df["options"] != "")
    df.loc[split, "strategy"] = df.loc[split, "strategy"] + " [" + df.loc[split, "options"] + "]"
    return df


def _label_settings(df: pd.DataFrame) -> pd.DataFrame:
    """``layout`` := the layout's name plus every setting field that varies among the records
    (the name alone stays when nothing else varies); the name itself goes to ``layout_name``."""
    df["layout_name"] = df["layout"]
    cols = [c for c in SETTING if c in df.columns]
    varying = [c for c in cols if df[c].astype(str).nunique(dropna=False) > 1]
    # A field that only follows the layout name (dp, pp, tp, cp, world size of presets) adds
    # nothing: keep it out of the label unless it varies within one layout name.
    varying = [
        c for c in varying
        if df.groupby("layout_name")[c].agg(lambda s: s.astype(str).nunique(dropna=False)).max() > 1
    ]  # fmt: skip
    if not varying:
        return df

    def label(row) -> str:
        parts = [f"{c}={_plain(row[c])}" for c in varying if not _missing(row[c])]
        return f"{row['layout_name']} ({', '.join(parts)})" if parts else row["layout_name"]

    df["layout"] = df.apply(label, axis=1)
    return df


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _plain(value) -> str:
    # NaN in refused rows turns integer columns into floats: print 8, not 8.0.
    return f"{value:g}" if isinstance(value, float) else str(value)


def layouts_of(df: pd.DataFrame) -> list[str]:
    """Layouts in a stable order: smaller worlds first, then by name."""
    return list(df.sort_values(["world_size", "layout"])["layout"].drop_duplicates())


def strategies_of(df: pd.DataFrame) -> list[str]:
    return sorted(df["strategy"].unique())


def strategy_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (setting, strategy, payload_bytes): medians over the jobs that measured it.
    The setting is ``layout`` (see ``load``) and every ``SETTING`` field, so jobs that differ
    in any of them are separate rows. Unsupported combinations keep a row with ``supported``
    False and their ``error``."""
    cols = [
        "p50_us", "p90_us", "vs_floor", "vs_floor_single", "vs_baseline", "algbw_gbps",
        "speedup_over_pickled",
    ]  # fmt: skip
    key = ["layout", *[c for c in SETTING if c in df.columns], "strategy", "payload_bytes"]
    ok = df[df["supported"]]
    # Several jobs of one cell: the median of their figures, and the widest of their intervals
    # (each job's is honest on its own; together they cover every job's answer).
    bounds = {c: (c, "min" if interval_end(c) == "lo" else "max")
              for c in ok.columns if interval_end(c) and not c.startswith("ref_")}  # fmt: skip
    measured = ok.groupby(key, as_index=False, dropna=False).agg(
        **{c: (c, "median") for c in [*cols, "busbw_gbps"] if c in ok.columns},
        **bounds,
        n_jobs=("strategy", "size"),
    )
    measured["supported"] = True
    measured["error"] = None
    refused = df[~df["supported"]].drop_duplicates(key)[[*key, "error"]].copy()
    refused["supported"] = False
    refused["n_jobs"] = 0
    out = pd.concat([measured, refused], ignore_index=True)
    return out.sort_values(["layout", "strategy", "payload_bytes"]).reset_index(drop=True)


def floor_table(df: pd.DataFrame) -> pd.DataFrame:
    """The honest floor per (layout, payload_bytes): every job times it (the fastest raw method
    of that job), so take the median over the jobs and keep how many there were (``n_jobs``),
    the method that won most often (``floor_method``, in ``method_jobs`` of them) and the
    single broadcast beside it (``floor_single_p50_us``)."""
    ok = df[df["supported"] & df["floor_p50_us"].notna()].copy()
    if "samples_file" in ok.columns:  # a record_each job's records share one floor: count it once
        ok = ok[~ok.apply(_job_key, axis=1).duplicated()]
    ok["winner_p90_us"] = winning_floor(ok, "p90_us")
    out = ok.groupby(["layout", "payload_bytes"], as_index=False).agg(
        floor_p50_us=("floor_p50_us", "median"),
        n_jobs=("floor_p50_us", "size"),
        floor_p90_us=("winner_p90_us", "median"),
        floor_single_p50_us=("floor_single_p50_us", "median"),
        floor_method=("floor_method", _most_often),
        method_jobs=("floor_method", lambda s: int(s.value_counts().iloc[0])),
        method_counts=("floor_method", _counts),
    )
    out["floor_algbw_gbps"] = out["payload_bytes"] / (out["floor_p50_us"] / 1e6) / 1e9
    return out


def _job_key(row) -> str:
    """The job a record came from: its samples file, which every record a ``record_each`` job
    writes names (one directory up for the others); its own directory where it names none."""
    name = row.get("samples_file")
    if isinstance(name, str) and name and isinstance(row.get("job_dir"), str):
        return str((Path(row["job_dir"]) / name).resolve())
    return str(row.get("job_dir"))


def _most_often(values: pd.Series) -> str:
    """The value seen most often (the first in sorted order on a tie, so reports are stable)."""
    counts = values.value_counts()
    return sorted(counts[counts == counts.iloc[0]].index)[0]


def _counts(values: pd.Series) -> tuple[tuple[str, int], ...]:
    """(value, how many) from the most seen to the least, ties in sorted order (stable)."""
    counts = values.value_counts()
    return tuple(
        sorted(((str(k), int(n)) for k, n in counts.items()), key=lambda kn: (-kn[1], kn[0]))
    )


def floor_method_words(method: str | None) -> str:
    """A floor method in words: 'one broadcast', 'chunked into 2', 'PP first then TP×CP'."""
    if method in (None, "", SINGLE):
        return "one broadcast"
    if method.startswith("chunks") and method[len("chunks") :].isdigit():
        return f"chunked into {method[len('chunks') :]}"
    return {
        "seed_hops": "the seed's hop order (TP×CP then PP)",
        "pp_first": "PP first then TP×CP",
        "shm": "shared memory on the node",
    }.get(method, method)


def jobs_text(n: int) -> str:
    """'1 job', '2 jobs'."""
    return f"{n} job" if n == 1 else f"{n} jobs"


def floor_method_text(row) -> str:
    """Which raw method was the floor, in words, and in how many of the jobs it won:
    'one broadcast (the only job)', 'chunked into 2 (all 3 jobs)',
    'one broadcast (in 1 of 2 jobs), chunked into 2 (1 of 2)'."""
    jobs = int(row["n_jobs"])
    counts = row.get("method_counts") if hasattr(row, "get") else None
    if not counts:  # a table made without the per-method counts
        counts = ((row["floor_method"], int(row["method_jobs"])),)
    if len(counts) == 1 and counts[0][1] == jobs:
        whose = "the only job" if jobs == 1 else f"all {jobs} jobs"
        return f"{floor_method_words(counts[0][0])} ({whose})"
    first, *rest = counts
    parts = [f"{floor_method_words(first[0])} (in {first[1]} of {jobs_text(jobs)})"]
    parts += [f"{floor_method_words(m)} ({n} of {jobs})" for m, n in rest]
    return ", ".join(parts)


def unique_values(df: pd.DataFrame, col: str) -> str:
    """The distinct values of ``col``, comma-separated ('?' when none is recorded)."""
    if col not in df.columns:
        return "?"
    values = sorted({_plain(v) for v in df[col].dropna()})
    return ", ".join(values) if values else "?"


def run_dates(df: pd.DataFrame) -> str:
    if "timestamp" not in df.columns:
        return "?"
    days = sorted({str(t)[:10] for t in df["timestamp"].dropna()})
    if not days:
        return "?"
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def context_line(df: pd.DataFrame) -> str:
    """Backend, device, machine and date: the line under every figure's title."""
    payload = unique_values(df, "payload")
    seq = unique_values(df, "seq_len")
    iters = unique_values(df, "iters")
    host = host_text(df)
    return (
        f"backend {unique_values(df, 'backend')}, device {unique_values(df, 'device')}, "
        f"machine {unique_values(df, 'hostname')}{f' ({host})' if host else ''}, "
        f"{run_dates(df)}; payload {payload} (seq_len {seq}), {iters} timed iterations per job"
    )


def layout_label(df: pd.DataFrame, layout: str) -> str:
    row = df[df["layout"] == layout].iloc[0]
    dims = " × ".join(f"{a}{int(row[a])}" for a in ("dp", "pp", "tp", "cp") if int(row[a]) > 1)
    return f"{layout}: {int(row['world_size'])} ranks ({dims or 'one rank'})"


def clean_reason(error: str | None) -> str:
    """A refusal without the repeated 'name: rank k: name:' prefix the runner adds."""
    return re.sub(r"^(\w+: )?(rank \d+: )?(\w+: )?", "", str(error or "refused")).strip()


# -- tables ---------------------------------------------------------------------------------
def recommendation(df: pd.DataFrame) -> pd.DataFrame:
    """Per layout and payload: the strategy with the lowest vs_floor (a same-job ratio, so jobs
    measured at different moments compare fairly), the runner-up, and the verdict
    (``harness.report.sure.cell_verdict``): a winner only where the paired interval of every
    other strategy's time over its own excludes 1, else the strategies tied with it (``tie``),
    and ``no interval`` where the records give none. ``answer`` is the verdict in words."""
    table = strategy_table(df)
    over = oversubscribed_cells(df)
    rows = []
    for layout in layouts_of(df):
        tab = table[(table["layout"] == layout) & table["supported"]]
        for size in sorted(tab["payload_bytes"].unique()):
            # Jobs timed without a floor rank by p50 (their only figure) instead.
            metric = "vs_floor" if tab["vs_floor"].notna().any() else "p50_us"
            ranked = tab[tab["payload_bytes"] == size].sort_values(metric)
            times = {n: t for n, t in zip(ranked["strategy"], ranked[metric]) if not math.isnan(t)}
            times = without_servers(times, choices(df, layout, size))
            ranked = ranked[ranked["strategy"].isin(times)]
            if not times:
                continue
            verdict = cell_verdict(df, layout, size, times)
            best = ranked.iloc[0]
            second = ranked.iloc[1] if len(ranked) > 1 else None
            rows.append(
                {
                    "layout": layout,
                    "payload_bytes": int(size),
                    "winner": verdict.best,
                    "answer": verdict.text(),
                    "tied_with": list(verdict.tied),
                    "kind": verdict.kind,
                    "winner_vs_floor": best["vs_floor"],
                    "winner_speedup_over_pickled": best["speedup_over_pickled"],
                    "runner_up": None if second is None else second["strategy"],
                    "runner_up_vs_floor": np.nan if second is None else second["vs_floor"],
                    "runner_up_interval": verdict.runner_up_interval,
                    "tie": verdict.is_tie,
                    "oversubscribed": over.get((layout, size)),
                }
            )
    return pd.DataFrame(rows)


def choices(df: pd.DataFrame, layout: str, size: float) -> dict[str, str]:
    """Per strategy that serves its calls with another (``auto``), the one it served in this
    cell's jobs (the first recorded, where jobs differ)."""
    if "auto_choice" not in df.columns:
        return {}
    cell = df[(df["layout"] == layout) & (df["payload_bytes"] == size) & df["auto_choice"].notna()]
    out: dict[str, str] = {}
    for name, choice in zip(cell["strategy"], cell["auto_choice"]):
        out.setdefault(str(name), str(choice))
    return out


def recommendation_ranges(rec: pd.DataFrame) -> pd.DataFrame:
    """Consecutive payload sizes with the same winner merged into one range per layout."""
    out = []
    for layout, group in rec.groupby("layout", sort=False):
        group = group.sort_values("payload_bytes")
        start = 0
        records = group.to_dict("records")
        for i in range(1, len(records) + 1):
            if i == len(records) or records[i]["answer"] != records[start]["answer"]:
                span = records[start:i]
                out.append(
                    {
                        "layout": layout,
                        "from_bytes": span[0]["payload_bytes"],
                        "to_bytes": span[-1]["payload_bytes"],
                        "winner": span[0]["winner"],
                        "answer": span[0]["answer"],
                        "kind": span[0]["kind"],
                        "runner_up_interval": [r["runner_up_interval"] for r in span],
                        "oversubscribed": [r["oversubscribed"] for r in span],
                        "winner_vs_floor": [r["winner_vs_floor"] for r in span],
                        "winner_speedup_over_pickled": [
                            r["winner_speedup_over_pickled"] for r in span
                        ],
                        "runner_up": [r["runner_up"] for r in span],
                        "runner_up_vs_floor": [r["runner_up_vs_floor"] for r in span],
                        "ties": [r["tie"] for r in span],
                        "sizes": [r["payload_bytes"] for r in span],
                    }
                )
                start = i
    return pd.DataFrame(out)


def _within_a_tie(a: dict, b: dict) -> bool:
    """Whether one size's winner is among the other's tied strategies (``shm ≈ auto`` next to
    ``auto ≈ shm``: the same answer, not a crossover)."""
    return a["winner"] in (b.get("tied_with") or ()) or b["winner"] in (a.get("tied_with") or ())


def crossovers(rec: pd.DataFrame) -> list[str]:
    """Sentences naming where the winner changes, between which two measured sizes (a winner
    tied with the other size's is no change)."""
    lines = []
    for layout, group in rec.groupby("layout", sort=False):
        group = group.sort_values("payload_bytes").to_dict("records")
        changes = [
            f"{a['winner']} → {b['winner']} between {human_bytes(a['payload_bytes'])} and "
            f"{human_bytes(b['payload_bytes'])}"
            + (
                " (not clear: a tie on one side)"
                if a["kind"] != "winner" or b["kind"] != "winner"
                else ""
            )
            for a, b in zip(group, group[1:])
            if a["winner"] != b["winner"] and not _within_a_tie(a, b)
        ]
        lines.append(
            f"**{layout}**: " + ("; ".join(changes) if changes else _no_crossover(group)) + "."
        )
    return lines


def _no_crossover(group: list[dict]) -> str:
    """The sentence for a layout whose answer never changes: one winner, or a tie."""
    winners = list(dict.fromkeys(r["winner"] for r in group))
    if len(winners) == 1 and all(r["kind"] == "winner" for r in group):
        return f"no crossover: {winners[0]} is fastest at every measured size"
    if len(winners) == 1:
        return f"no crossover: {winners[0]} leads at every measured size, tied at some"
    names = ", ".join(winners[:-1]) + f" and {winners[-1]}"
    return f"no crossover: the lead passes between {names}, each tied with the next size's leader"


SHAPE_COLUMNS = (
    "batch_size", "seq_len", "dp_rows", "calls", "payload_bytes", "p50_us", "floor_p50_us",
    "vs_floor", "baseline_p50_us", "vs_baseline", "steady_p50_us", "vs_steady",
)  # fmt: skip
"""A ``shapes`` entry's figures the per-shape table keeps."""


def shapes_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per shape of every varying-workload record (its ``shapes``), beside the job's
    setting (``layout``), workload and strategy; empty when no record varies."""
    rows = []
    if "shapes" not in df.columns:
        return pd.DataFrame(rows)
    for _, rec in df[df["shapes"].map(lambda v: isinstance(v, list) and bool(v))].iterrows():
        for k, shape in enumerate(rec["shapes"]):
            row = {"layout": rec["layout"], "workload": rec.get("workload"), "shape": k}
            row["strategy"] = rec["strategy"]
            rows.append(row | {c: shape.get(c) for c in SHAPE_COLUMNS})
    return pd.DataFrame(rows)
