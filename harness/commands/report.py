"""Turn a run or sweep directory into ``report.md`` and PNG figures written beside the records.

    bcastbench report results/bench/<dir>

The report is made of ``tables`` (records → medians per setting), ``figures`` and ``markdown``;
``notebooks/analysis.ipynb`` calls the same functions through ``harness.report``. A directory
that is missing or holds no record exits 2 (the caller's mistake); one whose every job failed
exits 1 (the jobs' own failure, named in their result.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.errors import USAGE_EXIT
from harness.report.collect import records_dir_problem, unfinished_writes
from harness.report.dispatch_records import load_dispatch_records
from harness.report.markdown import write_report
from harness.report.ray_report import write_ray_report
from harness.report.tables import load

PROG = "bcastbench report"
FAILED_EXIT = 1
"""Every job under the directory failed: nothing to report, and not the caller's mistake."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].replace("``", ""))
    ap.add_argument("root", help="a run or sweep directory (every result.json below it)")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window

    for tmp in unfinished_writes(args.root) if Path(args.root).is_dir() else []:
        print(
            f"{PROG}: warning: {tmp} is a record whose writer was killed before it was "
            "renamed into place; `bcastbench report target=csv` recovers it",
            file=sys.stderr,
        )
    dispatch = load_dispatch_records(args.root) if Path(args.root).is_dir() else []
    problem = records_dir_problem(args.root, also=" (or Ray dispatch JSON lists in it)")
    if problem and not dispatch:  # a wrong directory is the caller's mistake: exit 2
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return USAGE_EXIT
    if dispatch:  # Ray dispatch records: their own report and figure
        print(f"bcastbench Ray dispatch report: {write_ray_report(args.root)}")
    df = load(args.root)
    if df.empty:
        if dispatch:
            return 0
        failed = df.attrs.get("n_failed", 0)
        if df.attrs.get("n_skipped") and not failed:  # every one was skipped, each said above
            print(f"{PROG}: error: {args.root}: no job record in it can be read", file=sys.stderr)
            return USAGE_EXIT
        print(
            f"{PROG}: all {failed} job(s) under {args.root} failed; their result.json say why "
            "(status, error)",
            file=sys.stderr,
        )
        return FAILED_EXIT
    written = write_report(args.root, df)
    # The figures by count: their names (in report.md) made the line 225 columns wide.
    print(f"bcastbench report: {written.path} (and {len(written.figures)} figures beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
