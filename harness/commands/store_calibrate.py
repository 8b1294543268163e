"""Fit the pull stores' put/get α, β and fetch contention to a pull sweep's records and write
them into a cluster preset: ``bcastbench calibrate target=store <sweep dir> [--cluster local]``.

Each record of ``independent_fetch``, ``ray_object_store`` or ``transferqueue`` (``sweep=
pull_calibrate`` on ``world=ray``) is priced with its store free; what it measured beyond that
is its store's put and contended gets (``harness.model.store_fit``). The fit replaces the
preset's entries of the stores it fitted (a store with no record keeps its entry; the other
fields, and the header ``bcastbench calibrate`` wrote, stay);
``--dry-run`` prints it and writes nothing. Check it out of sample with ``bcastbench validate``
on ``sweep=pull``, whose sizes the calibration sweep does not hold.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd

import strategies
from harness.errors import USAGE_EXIT, program
from harness.model.calibration_fit import write_cluster_yaml
from harness.model.store_fit import STORE_OF, StoreSample, fit_all, format_fits, sample_of
from harness.payload import generated
from harness.report import collect
from harness.report.collect import records_dir_problem
from strategies.core.cluster import ClusterConf, ClusterError, StoreConf, load_cluster, preset_path
from strategies.core.layout import Layout
from strategies.core.plan import plan_of, plan_options, spec_of

MODULE = "harness.commands.store_calibrate"
"""Where ``bcastbench calibrate target=store`` lives (its printed name:
``harness.errors.program``)."""
FIT_MARK = "store fits"
"""The header line the store fit's report starts at (a rerun replaces it and what follows)."""


def samples_from(df: pd.DataFrame, cluster: ClusterConf) -> list[StoreSample]:
    """Every measured, supported pull record of ``df`` as a store sample."""
    specs: dict = {}
    out = []
    for _, r in df.iterrows():
        if r["strategy"] not in STORE_OF or r.get("supported") is False or pd.isna(r["p50_us"]):
            continue
        key = (r["payload"], int(r["batch_size"]), int(r["seq_len"]))
        if key not in specs:  # exact spec: a calibration sweep's batches are small
            specs[key] = spec_of(generated.make(*key, 0))
        layout = Layout(
            dp=int(r["dp"]), pp=int(r["pp"]), tp=int(r["tp"]), cp=int(r["cp"]), order=r["order"]
        )
        cls = strategies.get_class(r["strategy"])
        plan = plan_of(cls, layout, specs[key], **plan_options(cls, r.get("options")))
        sample = sample_of(plan, layout, cluster, float(r["p50_us"]) / 1e6)
        if sample is not None:
            out.append(sample)
    return out


def _header_of(path: Path, sweep: Path, report: str) -> str:
    """The preset's own header (its comment lines) up to any earlier store fit, then this one's."""
    kept = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[2:] if line.startswith("# ") else line[1:]
        if text.startswith(FIT_MARK) or text.startswith("Store costs fitted"):
            break
        kept.append(text)
    return "\n".join(
        [*kept, f"Store costs fitted by `bcastbench calibrate target=store {sweep}`:", report]
    )


def kept_share(conf: StoreConf, old: StoreConf | None) -> StoreConf:
    """A store's new fit, keeping the put share an earlier fit found where this sweep had no
    reader of some fields to find it again."""
    if conf.put_share is None and old is not None:
        return replace(conf, put_share=old.put_share)
    return conf


def store_calibrate(sweep: Path, cluster_name: str = "local", dry_run: bool = False) -> str:
    """Fit, print and (unless ``dry_run``) write the stores into ``cluster_name``'s preset."""
    cluster = load_cluster(cluster_name)
    samples = samples_from(collect.load(sweep), cluster)
    if not samples:
        raise SystemExit(
            f"no measured pull record ({', '.join(STORE_OF)}) under {sweep}; record some with "
            f"`bcastbench run -m sweep=pull_calibrate hydra.sweep.dir={sweep}` (world=ray)"
        )
    fits = fit_all(samples)
    report = format_fits(fits)
    print(report)
    if not dry_run:
        path = preset_path(cluster_name)
        fitted = replace(
            cluster,
            stores={
                **cluster.stores,
                **{k: kept_share(f.conf, cluster.stores.get(k)) for k, f in fits.items()},
            },
        )
        write_cluster_yaml(fitted, path, _header_of(path, sweep, report))
        load_cluster(path)  # what was written must load and validate
        print(f"wrote {path}")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=program(MODULE), description=__doc__)
    ap.add_argument("sweep", help="a pull sweep directory with result.json records")
    ap.add_argument("--cluster", default="local", help="cluster preset or YAML (default local)")
    ap.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    args = ap.parse_args(argv)
    problem = records_dir_problem(args.sweep)
    if problem:
        print(f"{ap.prog}: error: {problem}", file=sys.stderr)
        return USAGE_EXIT
    try:
        store_calibrate(Path(args.sweep), args.cluster, args.dry_run)
    except ClusterError as exc:
        ap.error(str(exc))  # one line, exit 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
