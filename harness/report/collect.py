"""Turn any run or sweep directory into one tidy table: one row per job's result.json.

    bcastbench collect results/sweeps/<dir> [--out table.csv]

``records_dir_problem`` is the one check ``report``, ``collect`` and ``validate`` make of the
directory they are given, so a wrong one reads the same (one line, exit 2) in all three.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from harness.files import write_csv

COLUMNS = [
    "status", "scope", "strategy", "mode", "layout", "world_size", "dp", "pp", "tp", "cp", "payload", "batch_size",
    "payload_bytes", "p50_us", "p90_us", "floor_p50_us", "baseline_p50_us", "vs_floor",
    "vs_baseline", "algbw_gbps", "collectives_per_call", "peak_rss_bytes", "error",
]  # fmt: skip


EXPECTED = "expected a run or sweep directory with result.json files below it"


def records_dir_problem(root: Path | str, also: str = "") -> str | None:
    """What is wrong with ``root`` as a directory of job records (None: nothing): it is not a
    directory, or no result.json lies below it. ``also`` names other files a command accepts
    in place of result.json (the report's Ray dispatch JSON lists)."""
    root = Path(root)
    if not root.is_dir():
        what = "no such file or directory" if not root.exists() else "not a directory"
        return f"{root}: {what}; {EXPECTED}{also}"
    if next(root.rglob("result.json"), None) is None:
        return f"{root}: no result.json below it; {EXPECTED}{also}"
    return None


def load(root: Path | str) -> pd.DataFrame:
    """Every result.json under ``root`` (nested reference dicts flattened as ref_<name>_<field>)."""
    rows = []
    for path in sorted(Path(root).rglob("result.json")):
        rec = json.loads(path.read_text())
        for name, ref in (rec.pop("references", None) or {}).items():
            for k, v in ref.items():
                rec[f"ref_{name}_{k}"] = v
        rec["job_dir"] = str(path.parent)
        rows.append(rec)
    return pd.DataFrame(rows)


def summary_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "(no results)"
    cols = [c for c in COLUMNS if c in df.columns]
    view = df[cols].sort_values(["layout", "batch_size", "strategy"], na_position="last")
    fmt = {
        "p50_us": "{:.0f}".format,
        "p90_us": "{:.0f}".format,
        "floor_p50_us": "{:.0f}".format,
        "baseline_p50_us": "{:.0f}".format,
        "vs_floor": "{:.2f}".format,
        "vs_baseline": "{:.2f}".format,
        "algbw_gbps": "{:.3f}".format,
    }
    return view.to_string(index=False, formatters={k: v for k, v in fmt.items() if k in cols})


PROG = "bcastbench collect"


def main(argv: list[str] | None = None) -> int:
    from harness.errors import USAGE_EXIT

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].replace("``", ""))
    ap.add_argument("root", help="a run or sweep directory (every result.json below it)")
    ap.add_argument("--out", help="CSV path (default <root>/results.csv)")
    args = ap.parse_args(argv)
    problem = records_dir_problem(args.root)
    if problem:  # a wrong directory is the caller's mistake, like a bad option: exit 2
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return USAGE_EXIT
    df = load(args.root)
    out = Path(args.out) if args.out else Path(args.root) / "results.csv"
    write_csv(out, df)
    print(summary_table(df))
    print(f"\n{len(df)} records -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
