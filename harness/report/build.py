"""Turn a run or sweep directory into ``report.md`` and PNG figures written beside the records.

    python -m harness.report.build results/bench/<dir>

The report is made of ``tables`` (records → medians per setting), ``figures`` and ``markdown``;
``notebooks/analysis.ipynb`` calls the same functions through ``harness.report``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    from harness.errors import program
    from harness.report.figures import FIGURES
    from harness.report.markdown import write_report
    from harness.report.tables import load

    ap = argparse.ArgumentParser(
        prog="python -m harness.report.build", description=__doc__.splitlines()[0]
    )
    ap.add_argument("root", help="a run or sweep directory (every result.json below it)")
    args = ap.parse_args(argv)
    if not Path(args.root).is_dir():
        ap.error(f"root: no directory {args.root}")
    from harness.report.markdown import load_dispatch_records, write_ray_report

    if load_dispatch_records(args.root):  # Ray dispatch records: their own report and figure
        print(f"bcastbench Ray dispatch report: {write_ray_report(args.root)}")
    df = load(args.root)
    if df.empty:
        if load_dispatch_records(args.root):
            return 0
        failed = df.attrs.get("n_failed", 0)
        why = (
            f"all {failed} job(s) under {args.root} failed; their result.json say why "
            "(status, error)"
            if failed
            else f"no result.json under {args.root}"
        )
        print(f"{program('harness.report.build')}: {why}", file=sys.stderr)
        return 1
    path = write_report(args.root, df)
    print(f"bcastbench report: {path} (figures beside it: {', '.join(FIGURES.values())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
