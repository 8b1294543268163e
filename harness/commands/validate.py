"""Check the cost model against a measured sweep: ``bcastbench validate <sweep dir>``.

For every record of the sweep, the strategy's plan (and the floor's) is priced on a calibrated
cluster (default ``local``, what ``harness.commands.calibrate`` wrote where it ran) with the exact
spec of the record's batch, and compared with the measured p50. Writes, into the sweep dir:
``model_validation.csv`` (one row per record), ``model_validation.md`` (metrics, per-point
ranking agreement and why it fails where it does) and ``model_validation.png`` (predicted vs
measured, log-log).

Two figures of merit (targets ``TARGET_MEDIAN_ERR``, ``TARGET_AGREEMENT``): the median |predicted/measured − 1| (≤ 25 %), and
the share of (layout, payload size) points where the predicted fastest strategy is the measured
fastest (≥ 90 %). "Measured fastest" ranks strategies by ``vs_floor`` (p50 / floor p50 from the
same job: load common to both cancels), not by p50 across jobs.

Ties: with few iterations on a shared machine a strategy's p50 is only known to within its
p90/p50 spread. Where the model puts the predicted and the measured fastest closer together than
that spread (the wider of the two records'), the measurement cannot tell the model wrong: the
point counts as a tie. Both figures are reported, strict and tie-aware.

Oversubscription: calibration times collectives on a world of N ranks on C cores; a sweep world
of W > max(C, N) ranks time-slices them harder (a dp=2 world of twice the calibration world runs
two replicas at once on the same cores). ``pricing.price`` applies ``ClusterConf.oversubscription`` =
max(1, W / max(C, N)) on CPU clusters (C = ``cpu_cores``, N = ``calibrated_ranks``, fields the
calibration writes); the table also shows the model without it, for comparison.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import re
import sys
import warnings
from pathlib import Path

import pandas as pd

import strategies
from harness.errors import USAGE_EXIT, program
from harness.files import write_atomic, write_csv, write_figure
from harness.job.label import FLOOR, Label
from harness.payload import generated
from harness.report import collect
from harness.report.collect import records_dir_problem
from harness.report.pull_section import PULL
from strategies.core.cluster import ClusterError, load_cluster, preset_path
from strategies.core.layout import Layout
from strategies.core.plan import plan_of, plan_options, spec_of
from strategies.core.pricing import price

# Megatron's import-time warnings say nothing about a price (a strategy may import it).
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron.*")
logging.getLogger("megatron").setLevel(logging.WARNING)

TARGET_MEDIAN_ERR = 0.25
TARGET_AGREEMENT = 0.90
TARGET_PULL_ERR = 0.15  # issue 39: the stores' put/get/contention terms, on a pull sweep
BAND = 0.25  # ± band drawn around y = x
POINT = ["payload", "seq_len", "layout", "batch_size"]  # one ranking per (layout, size) point


def calibration_world(cluster_name: str) -> tuple[int | None, str]:
    """World size and header line of a calibrated preset (``# ... gloo world of N ...``)."""
    path = preset_path(cluster_name)
    try:
        text = path.read_text()
    except OSError:
        return None, ""
    m = re.search(r"^#.*gloo world of (\d+).*$", text, re.M)
    return (int(m.group(1)), m.group(0).lstrip("# ")) if m else (None, "")


def floor_plan(layout, spec, method):
    """The plan of the raw method that set a record's floor (``floor_method``), with the
    options ``Floor.variants`` gave it in the job, so the predicted floor is the measured
    one's; one broadcast for a record that names none of them."""
    floor = strategies.get_class("floor")
    return floor.plan(layout, spec, **floor.variants(layout).get(str(Label(FLOOR, method)), {}))


def price_records(df: pd.DataFrame, cluster_name: str) -> pd.DataFrame:
    """One row per measured, supported record with predicted and measured times (µs)."""
    cluster = load_cluster(cluster_name)
    specs: dict = {}
    rows = []
    for _, r in df.iterrows():
        if r.get("supported") is False or pd.isna(r.get("p50_us")):
            continue
        key = (r["payload"], int(r["batch_size"]), int(r["seq_len"]))
        if key not in specs:  # exact spec: the sweep's batches are small enough to build
            specs[key] = spec_of(generated.make(key[0], key[1], key[2], 0))
        spec = specs[key]
        layout = Layout(
            dp=int(r["dp"]), pp=int(r["pp"]), tp=int(r["tp"]), cp=int(r["cp"]), order=r["order"]
        )
        device = r.get("device") if isinstance(r.get("device"), str) else "cpu"
        cls = strategies.get_class(r["strategy"])
        plan = plan_of(cls, layout, spec, device, **plan_options(cls, r.get("options")))
        pred = price(plan, cluster, layout)
        floor = price(floor_plan(layout, spec, r.get("floor_method")), cluster, layout)
        rows.append(_priced_row(r, layout, pred, floor))
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    out["err"] = out.predicted_us / out.measured_p50_us - 1
    out["err_no_oversub"] = out.predicted_no_oversub_us / out.measured_p50_us - 1
    out["floor_err"] = out.predicted_floor_us / out.measured_floor_p50_us - 1
    out["floor_err_no_oversub"] = out.predicted_floor_no_oversub_us / out.measured_floor_p50_us - 1
    return out


def _priced_row(r, layout, pred, floor) -> dict:
    """One record beside its prediction and its floor's (µs); the oversubscription factor is
    already in ``pred.total_s`` (``pricing.price``), and divided out for comparison."""
    oversub = pred.oversubscription
    return dict(
        strategy=r["strategy"],
        layout=r["layout"],
        world_size=layout.world_size,
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        payload=r["payload"],
        batch_size=int(r["batch_size"]),
        seq_len=int(r["seq_len"]),
        payload_bytes=int(r["payload_bytes"]),
        measured_p50_us=float(r["p50_us"]),
        measured_p90_us=float(r["p90_us"]),
        predicted_us=pred.total_s * 1e6,
        oversub_factor=oversub,
        predicted_no_oversub_us=pred.total_s * 1e6 / oversub,
        measured_floor_p50_us=float(r["floor_p50_us"]),
        predicted_floor_us=floor.total_s * 1e6,
        predicted_floor_no_oversub_us=floor.total_s * 1e6 / oversub,
        measured_vs_floor=float(r["p50_us"]) / float(r["floor_p50_us"]),
        predicted_vs_floor=pred.total_s / floor.total_s,
        predicted_dominant=pred.dominant(),
        predicted_alpha_us=pred.alpha_s * 1e6,
        predicted_beta_us=pred.beta_s * 1e6,
        predicted_local_us=pred.local_s * 1e6,
    )


def rankings(v: pd.DataFrame) -> pd.DataFrame:
    """Per (layout, size) point: predicted vs measured fastest, and why they differ."""
    rows = []
    for key, g in v.groupby(POINT, sort=True):
        if len(g) < 2:
            continue
        g = g.set_index("strategy")
        pw = g.predicted_us.idxmin()
        mw = g.measured_vs_floor.idxmin()
        mw_p50 = g.measured_p50_us.idxmin()
        gap = g.measured_vs_floor[pw] / g.measured_vs_floor[mw] - 1
        # Noise: the wider p90/p50 spread of the two records compared.
        noise = max(g.measured_p90_us[s] / g.measured_p50_us[s] - 1 for s in {pw, mw})
        # How far apart the model put the two: a near-tie cannot be ranked reliably.
        model_gap = g.predicted_us[mw] / g.predicted_us[pw] - 1
        # Tie: the model puts the two closer together than the measurement can resolve.
        tie = pw != mw and model_gap <= noise
        rows.append(
            dict(
                zip(POINT, key),
                payload_bytes=int(g.payload_bytes.iloc[0]),
                predicted_fastest=pw,
                measured_fastest=mw,
                measured_fastest_by_p50=mw_p50,
                agree=pw == mw,
                tie=tie,
                measured_within_noise=pw != mw and gap <= noise,
                measured_gap=gap,
                model_gap=model_gap,
                noise=noise,
                why=_why_they_differ(g, pw, mw, gap, model_gap, noise),
            )
        )
    return pd.DataFrame(rows)


def _why_they_differ(
    g: pd.DataFrame, pw: str, mw: str, gap: float, model_gap: float, noise: float
) -> str:
    """Why the predicted fastest ``pw`` is not the measured fastest ``mw`` at one point (``g``,
    indexed by strategy): a tie the model cannot rank, a measured gap inside the noise, or the
    strategy the model misses more and what dominates its predicted time; "" when they agree."""
    if pw == mw:
        return ""
    if model_gap <= noise:
        return (
            f"tie: model puts {mw} only {model_gap:.1%} behind {pw}, inside the p90 spread "
            f"{noise:.0%}; measured gap {gap:.0%}"
        )
    if gap <= noise:
        return f"measured gap {gap:.0%} ≤ p90 spread {noise:.0%}, but model gap {model_gap:.0%}"
    ea, eb = g.err[pw], g.err[mw]
    worse = pw if abs(ea) >= abs(eb) else mw
    return (
        f"measured gap {gap:.0%} > p90 spread {noise:.0%}: model {ea:+.0%} on {pw} "
        f"vs {eb:+.0%} on {mw}; the larger miss is {worse}, whose predicted time is "
        f"{g.predicted_dominant[worse]}"
    )


def metrics(v: pd.DataFrame, r: pd.DataFrame) -> dict:
    # Floor: each record carries its own floor measurement; one floor row per record.
    nan = float("nan")
    return dict(
        records=len(v),
        points=len(r),
        median_abs_err=float(v.err.abs().median()),
        median_abs_err_no_oversub=float(v.err_no_oversub.abs().median()),
        within_band=float((v.err.abs() <= BAND).mean()),
        within_band_no_oversub=float((v.err_no_oversub.abs() <= BAND).mean()),
        floor_median_abs_err=float(v.floor_err.abs().median()),
        floor_median_abs_err_no_oversub=float(v.floor_err_no_oversub.abs().median()),
        # Side by side with the same job's floor: a machine-wide slowdown (load) cancels.
        median_abs_vs_floor_err=float(
            (v.predicted_vs_floor / v.measured_vs_floor - 1).abs().median()
        ),
        agreement=float(r.agree.mean()) if len(r) else nan,
        agreement_or_tie=float((r.agree | r.tie).mean()) if len(r) else nan,
        ties=int(r.tie.sum()) if len(r) else 0,
        agreement_or_measured_noise=float((r.agree | r.measured_within_noise).mean())
        if len(r)
        else nan,
        agreement_by_p50=float((r.predicted_fastest == r.measured_fastest_by_p50).mean())
        if len(r)
        else nan,
        pull_records=int(v.strategy.isin(PULL).sum()),
        pull_median_abs_err=float(v.err[v.strategy.isin(PULL)].abs().median()),
    )


def sweep_context(df: pd.DataFrame) -> dict:
    first = df.iloc[0]
    return dict(
        backend=f"{first.get('backend', '?')} ({first.get('device', '?')})",
        machine=str(first.get("hostname", "?")),
        date=str(first.get("timestamp", "?"))[:10],
        torch=str(first.get("torch_version", "?")),
    )


def plot(v: pd.DataFrame, path: Path, ctx: dict, cluster: str, m: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(13, 6), sharex=True, sharey=True)
    # Cycle the markers: a sweep may hold more strategies than there are distinct shapes.
    shapes = "osD^v<>ph*Xd"
    markers = {s: shapes[i % len(shapes)] for i, s in enumerate(sorted(v.strategy.unique()))}
    lo = min(v.measured_p50_us.min(), v.predicted_us.min(), v.measured_floor_p50_us.min()) / 2e3
    lo = min(lo, v.predicted_no_oversub_us.min() / 2e3)
    hi = max(v.measured_p50_us.max(), v.predicted_us.max()) * 2e-3
    xs = np.geomspace(lo, hi, 50)
    for ax, col, fcol, title, err in (
        (axes[0], "predicted_no_oversub_us", "predicted_floor_no_oversub_us",
         "model without the oversubscription factor", m["median_abs_err_no_oversub"]),
        (axes[1], "predicted_us", "predicted_floor_us",
         "model (× max(1, world / max(cores, calibration world)))", m["median_abs_err"]),
    ):  # fmt: skip
        ax.fill_between(xs, xs * (1 - BAND), xs * (1 + BAND), color="0.9", label="±25 %")
        ax.plot(xs, xs, "k-", lw=0.8, label="y = x")
        for s, g in v.groupby("strategy"):
            ax.scatter(g.measured_p50_us / 1e3, g[col] / 1e3, marker=markers[s], label=s, s=28)
        fl = v.drop_duplicates(subset=POINT)
        ax.scatter(fl.measured_floor_p50_us / 1e3, fl[fcol] / 1e3, marker="x", c="k",
                   label="floor", s=24)  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured p50 (ms)")
        ax.set_title(f"{title}: median |pred/meas − 1| = {err:.0%}", fontsize=10)
        ax.grid(True, which="both", lw=0.3)
    axes[0].set_ylabel(f"predicted (ms), cluster '{cluster}'")
    axes[1].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        f"Cost model vs measurement — backend {ctx['backend']}, machine {ctx['machine']}, "
        f"sweep of {ctx['date']} ({m['records']} records)"
    )
    fig.tight_layout()
    write_figure(path, fig, dpi=120)
    plt.close(fig)


def oversub_check(v: pd.DataFrame) -> pd.DataFrame:
    """Measured p50 of each record in an oversubscribed world (factor > 1) over the same
    strategy, batch and replica shape at dp=1 (factor 1): what the factor should reproduce."""
    shape = ["strategy", "batch_size", "tp", "pp", "cp"]
    base = v[v.oversub_factor == 1].set_index(shape)
    rows = []
    for _, x in v[v.oversub_factor > 1].iterrows():
        key = tuple(x[k] for k in shape)
        if key not in base.index:
            continue
        b = base.loc[[key]].iloc[0]
        rows.append(
            dict(
                zip(shape, key),
                layout=x.layout,
                base_layout=b.layout,
                factor=x.oversub_factor,
                measured_ratio=x.measured_p50_us / b.measured_p50_us,
                floor_ratio=x.measured_floor_p50_us / b.measured_floor_p50_us,
            )
        )
    return pd.DataFrame(rows)


TIES_NOTE = (
    "**Ties.** Each record's p50 is known only to within its spread: a sweep of few iterations "
    "on a shared machine leaves p90/p50 − 1 well above zero. At a point where the "
    "model's fastest and the measured fastest differ, the model's own gap between them "
    "(predicted time of the measured fastest over that of the predicted fastest, − 1) is "
    "compared with the wider p90/p50 spread of the two records: a model gap inside the "
    "spread is a *tie* — the model says the two cost the same to within what this "
    "measurement resolves, so the measurement cannot show the model wrong. A tie-aware "
    "agreement counts those points; the strict figure does not. A model gap beyond the "
    "spread is a real miss even when the measured gap is small."
)


def _met(good: bool) -> str:
    return "met" if good else "**missed**"


def _metric_rows(m: dict) -> list[str]:
    """The figures of merit, with and without the oversubscription factor, against targets."""
    return [
        "| metric | model | model without oversubscription factor | target |",
        "|---|---|---|---|",
        f"| median \\|pred/meas − 1\\|, strategies ({m['records']} records) | "
        f"{m['median_abs_err']:.1%} ({_met(m['median_abs_err'] <= TARGET_MEDIAN_ERR)}) | "
        f"{m['median_abs_err_no_oversub']:.1%} | ≤ 25 % |",
        f"| records within ±25 % | {m['within_band']:.0%} | {m['within_band_no_oversub']:.0%} | |",
        f"| median \\|pred/meas − 1\\|, floor | {m['floor_median_abs_err']:.1%} | "
        f"{m['floor_median_abs_err_no_oversub']:.1%} | ≤ 25 % |",
        f"| median \\|pred vs_floor / meas vs_floor − 1\\| (each record over its own job's floor:"
        f" load common to both cancels) | {m['median_abs_vs_floor_err']:.1%} | same | |",
        f"| predicted fastest = measured fastest (by vs_floor), strict, {m['points']} points | "
        f"{m['agreement']:.0%} ({_met(m['agreement'] >= TARGET_AGREEMENT)}) | same (one factor "
        f"per point cannot reorder) | ≥ 90 % |",
        f"| … tie-aware: a disagreement whose two predictions are closer than the measured "
        f"p90/p50 spread counts as a tie ({m['ties']} such points) | "
        f"{m['agreement_or_tie']:.0%} ({_met(m['agreement_or_tie'] >= TARGET_AGREEMENT)}) | same "
        f"| ≥ 90 % |",
        f"| … (for reference) counting a disagreement whose measured gap is inside that spread | "
        f"{m['agreement_or_measured_noise']:.0%} | | |",
        f"| … by raw p50 across jobs | {m['agreement_by_p50']:.0%} | | |",
    ] + _pull_row(m)


def _pull_row(m: dict) -> list[str]:
    """The pull strategies' median error (their stores' terms), where the sweep holds any."""
    if not m.get("pull_records"):
        return []
    err = m["pull_median_abs_err"]
    return [
        f"| median \\|pred/meas − 1\\|, pull strategies ({m['pull_records']} records) | "
        f"{err:.1%} ({_met(err <= TARGET_PULL_ERR)}) | | ≤ 15 % |"
    ]


def _point_rows(r: pd.DataFrame) -> list[str]:
    lines = [
        "| layout | B | payload bytes | predicted fastest | measured fastest | measured gap | why |",
        "|---|---|---|---|---|---|---|",
    ]
    for _, x in r.iterrows():
        lines.append(
            f"| {x.layout} | {x.batch_size} | {x.payload_bytes} | {x.predicted_fastest} | "
            f"{x.measured_fastest} | {x.measured_gap:.0%} | {x.why or 'agree'} |"
        )
    return lines


def _error_rows(v: pd.DataFrame) -> list[str]:
    """Error by strategy, then by payload size."""
    lines = ["## Error by strategy (model / without oversubscription factor)", ""]
    lines += ["| strategy | median pred/meas − 1 | without factor | worst |", "|---|---|---|---|"]
    for s, g in v.groupby("strategy"):
        worst = g.loc[g.err.abs().idxmax()]
        lines.append(
            f"| {s} | {g.err.median():+.0%} | {g.err_no_oversub.median():+.0%} | "
            f"{worst.err:+.0%} ({worst.layout} B={worst.batch_size}) |"
        )
    lines += ["", "## Error by payload size", ""]
    lines += ["| B | payload bytes | median pred/meas − 1 | without factor |", "|---|---|---|---|"]
    for b, g in v.groupby("batch_size"):
        lines.append(
            f"| {b} | {int(g.payload_bytes.iloc[0])} | {g.err.median():+.0%} | "
            f"{g.err_no_oversub.median():+.0%} |"
        )
    return lines


def _oversub_rows(v: pd.DataFrame) -> list[str]:
    o = oversub_check(v)
    if not len(o):
        return []
    lines = [
        "",
        "## Oversubscription factor vs the sweep",
        "",
        "Measured p50 of each oversubscribed record over the same strategy, batch and "
        "replica shape at dp = 1 (different jobs, so each ratio carries both jobs' noise):",
        "",
        "| layouts | factor | records | median measured ratio (range) | median floor ratio |",
        "|---|---|---|---|---|",
    ]
    for (lay, base, f), g in o.groupby(["layout", "base_layout", "factor"]):
        lines.append(
            f"| {lay} / {base} | {f:.3g} | {len(g)} | {g.measured_ratio.median():.2f} "
            f"({g.measured_ratio.min():.2f}–{g.measured_ratio.max():.2f}) | "
            f"{g.floor_ratio.median():.2f} |"
        )
    return lines


def markdown(v: pd.DataFrame, r: pd.DataFrame, m: dict, ctx: dict, sweep: Path, cluster: str):

    _, calib = calibration_world(cluster)
    c = load_cluster(cluster)
    basis = (
        f"oversubscription factor max(1, world / max({c.cpu_cores} cores, "
        f"{c.calibrated_ranks} calibrated ranks))"
        if c.cpu_cores
        else "no oversubscription factor (not a CPU cluster)"
    )
    lines = [
        f"# Cost model vs measurement: {sweep.name}",
        "",
        f"Backend {ctx['backend']}, machine {ctx['machine']}, sweep of {ctx['date']}, torch "
        f"{ctx['torch']}; cluster `{cluster}` ({calib or 'no calibration header'}; {basis}). "
        f"Validated {datetime.date.today().isoformat()} by `python -m harness.commands.validate`.",
        "",
        *_metric_rows(m),
        "",
        TIES_NOTE,
        "",
        "## Fastest strategy per point",
        "",
        *_point_rows(r),
        "",
        *_error_rows(v),
        *_oversub_rows(v),
    ]
    return "\n".join(lines) + "\n"


def validate(sweep: Path | str, cluster: str = "local", quiet: bool = False) -> dict:
    """Price every record of ``sweep``; write csv, md and png into it; return the metrics."""
    sweep = Path(sweep)
    df = collect.load(sweep)
    if df.empty:
        skipped = df.attrs.get("n_skipped", 0)
        raise SystemExit(
            f"{sweep}: no job record in it can be read ({skipped} skipped, each said above)"
            if skipped
            else f"no result.json under {sweep}"
        )
    v = price_records(df, cluster)
    if v.empty:
        raise SystemExit(f"no measured, supported record under {sweep}")
    v = v.sort_values(POINT + ["strategy"]).reset_index(drop=True)
    r = rankings(v)
    m = metrics(v, r)
    ctx = sweep_context(df)
    write_csv(sweep / "model_validation.csv", v)
    md = markdown(v, r, m, ctx, sweep, cluster)
    write_atomic(sweep / "model_validation.md", md)
    plot(v, sweep / "model_validation.png", ctx, cluster, m)
    if not quiet:
        print(md)
        print(f"-> {sweep}/model_validation.{{csv,md,png}}")
    return dict(metrics=m, table=v, rankings=r)


def main(argv: list[str] | None = None) -> int:

    ap = argparse.ArgumentParser(prog=program("harness.commands.validate"), description=__doc__)
    ap.add_argument("sweep", help="a sweep directory with result.json records")
    ap.add_argument("--cluster", default="local", help="cluster preset or YAML (default local)")
    args = ap.parse_args(argv)

    problem = records_dir_problem(args.sweep)
    if problem:  # a wrong directory is the caller's mistake, as in report and collect: exit 2
        print(f"{ap.prog}: error: {problem}", file=sys.stderr)
        return USAGE_EXIT
    try:
        validate(args.sweep, args.cluster)
    except ClusterError as exc:
        ap.error(str(exc))  # one line, exit 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
