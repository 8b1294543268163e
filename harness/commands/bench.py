"""``make bench`` / ``bcastbench bench``: run the bench sweep (``conf/sweep/bench.yaml``: every
selectable strategy × three layouts × four sizes on gloo CPU), then write its report and
figures, and say where they are.

    bcastbench bench [--quick] [--out DIR] [extra Hydra overrides...]

The sweep is config, not code: this only names it, picks the directory and runs the report.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

from harness import paths
from harness.commands import report
from harness.commands.run import run
from harness.errors import USAGE_EXIT
from harness.job.verdict import ALONE, NO_INTERVAL, TIED, WINNER
from harness.report.sweep_state import STATE
from harness.report.tables import load, recommendation


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bcastbench bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="conf/sweep/bench_quick.yaml instead")
    ap.add_argument("--out", help="sweep directory (default results/bench/<timestamp>)")
    args, extra = ap.parse_known_args(argv)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(args.out) if args.out else paths.REPO / "results" / "bench" / stamp
    sweep = "bench_quick" if args.quick else "bench"
    overrides = ["-m", f"sweep={sweep}", *extra, f"hydra.sweep.dir={out}"]
    print("bcastbench bench: bcastbench run", " ".join(overrides), flush=True)

    t0 = time.monotonic()
    rc = run(overrides)
    sweep_s = time.monotonic() - t0
    if rc == USAGE_EXIT or not out.is_dir():  # refused before any job (its line said why)
        return rc

    if STATE.done > STATE.failed:
        report.main([str(out)])
        print(f"bcastbench bench: {_verdicts(out)}", flush=True)
    else:
        print(f"bcastbench bench: every job failed; no report (see {out / 'results.csv'})")
    done = "took" if rc == 0 else f"ended with exit {rc} (failed jobs are in the table) after"
    print(f"\nbcastbench bench: the sweep {done} {sweep_s:.0f} s; results in {out}", flush=True)
    return rc


def _verdicts(out: Path) -> str:
    """How many cells name a winner, how many are ties and how many have no interval: the
    sweep's answer in one line, before anyone opens report.md."""
    rec = recommendation(load(out))
    if rec.empty:
        return "no cell to recommend for"
    counts = rec["kind"].value_counts()
    kinds = ", ".join(
        f"{int(counts[k])} {k}" for k in (WINNER, TIED, NO_INTERVAL, ALONE) if k in counts
    )
    return f"{len(rec)} cells: {kinds} (report.md names them)"


if __name__ == "__main__":
    sys.exit(main())
