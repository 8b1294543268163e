"""Compare two runs cell by cell: how many times slower or faster each strategy got, how sure.

    bcastbench compare OLD NEW [--noise 0.05] [--fail-above X] [--csv] [--no-samples]

OLD and NEW are each a result directory (a sweep root or a job directory; every result.json
below it), a ``results.csv``, or a pytest-benchmark JSON of the plugin's gates. One row per
cell both hold (strategy with its options, layout, payload, payload size): the two p50s, the
ratio new / old with its 95 % interval, which method found it, and the verdict
(``harness.report.cells``, ``harness.job.stats``).

Exit 0; 1 with ``--fail-above X`` when some cell's interval lies wholly above X (each such cell
named on a line); 2 on an input it cannot read (one line on stderr, no traceback). A cell whose
job ran oversubscribed in either run (more ranks than cores: † in the table) is reported but
not gated unless ``--gate-oversubscribed``: on such a host the same sweep run twice moved a
cell's p50 by up to 1.7x with confidence (the loads of the two runs, not the code).
"""

from __future__ import annotations

import argparse
import csv
import sys

from harness.errors import USAGE_EXIT
from harness.job.interval import interval_keys
from harness.report.cells import METHODS, CellsError, Row, compare, load_cells
from harness.units import human_bytes

PROG = "bcastbench compare"
SLOWED_EXIT = 1
"""``--fail-above``: a cell's whole interval is above the threshold."""
HEADER = ["strategy", "layout", "payload", "bytes", "old_p50_us", "new_p50_us", "ratio",
          *interval_keys("ratio"), "method", "verdict", "oversubscribed"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("old", help="result directory, results.csv or pytest-benchmark JSON")
    ap.add_argument("new", help="the same kinds; compared with OLD cell by cell")
    ap.add_argument("--noise", type=float, default=0.05,
                    help="a change within this fraction is 'same' (default 0.05)")  # fmt: skip
    ap.add_argument("--fail-above", type=float, metavar="X",
                    help="exit 1 when a cell's ratio interval lies wholly above X")  # fmt: skip
    ap.add_argument("--gate-oversubscribed", action="store_true",
                    help="--fail-above gates oversubscribed cells (†) too")  # fmt: skip
    ap.add_argument("--csv", action="store_true", help="the table as CSV on stdout")
    ap.add_argument("--no-samples", action="store_true",
                    help="compare the records' p50 intervals only; read no samples file")  # fmt: skip
    args = ap.parse_args(argv)
    if args.noise < 0:
        ap.error("--noise must be at least 0")
    try:
        old = load_cells(args.old, samples=not args.no_samples)
        new = load_cells(args.new, samples=not args.no_samples)
        rows = compare(old, new, args.noise)
    except CellsError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return USAGE_EXIT
    if args.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(HEADER)
        writer.writerows(_fields(r) for r in rows)
    else:
        print("\n".join(table(rows, args.noise)))
    return _gate(rows, args.fail_above, args.gate_oversubscribed)


def _fields(row: Row) -> list:
    lo, hi = row.interval or (None, None)
    return [*row.key, f"{row.old_p50_us:.1f}", f"{row.new_p50_us:.1f}", f"{row.ratio:.4f}",
            "" if lo is None else f"{lo:.4f}", "" if hi is None else f"{hi:.4f}",
            row.method, row.verdict, row.oversubscribed]  # fmt: skip


def table(rows: list[Row], noise: float) -> list[str]:
    """The aligned table and its legend."""
    header = ["strategy", "layout", "payload", "size", "old p50 ms", "new p50 ms",
              "new/old [95 % interval]", "method", "verdict"]  # fmt: skip
    body = []
    for r in rows:
        shown = f"{r.ratio:.2f}x" + (f" [{r.interval[0]:.2f}, {r.interval[1]:.2f}]"
                                     if r.interval else " [—]")  # fmt: skip
        layout = f"{r.key[1]} †" if r.oversubscribed else r.key[1]
        body.append([r.key[0], layout, r.key[2], human_bytes(r.key[3]),
                     f"{r.old_p50_us / 1e3:.3f}", f"{r.new_p50_us / 1e3:.3f}", shown,
                     r.method, r.verdict])  # fmt: skip
    widths = [max(len(c[i]) for c in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
             for cells in [header, *body]]  # fmt: skip
    used = sorted({r.method for r in rows})
    lines.append(
        "method: " + "; ".join(f"{m} = {METHODS[m]}" for m in used)
        + f". verdict: slower if the interval's low end > {1 + noise:.2f}, faster if its high "
        f"end < 1/{1 + noise:.2f}, else same"
    )  # fmt: skip
    if any(r.oversubscribed for r in rows):
        lines.append(
            "†: oversubscribed in either run (more ranks on a node than cores): the two runs' "
            "host loads can decide its ratio; --fail-above reports it without gating on it "
            "unless --gate-oversubscribed"
        )
    return lines


def _gate(rows: list[Row], fail_above: float | None, crowded_too: bool = False) -> int:
    """``--fail-above``: one line per cell whose whole interval is above it; 1 if any gated
    one is (an oversubscribed cell only with ``crowded_too``: named, as not gated, otherwise)."""
    if fail_above is None:
        return 0
    slowed = [r for r in rows if r.interval is not None and r.interval[0] > fail_above]
    gated = [r for r in slowed if crowded_too or not r.oversubscribed]
    for r in slowed:
        strategy, layout, payload, size = r.key
        what = "slower than" if r in gated else "not gated (oversubscribed), slower than"
        print(
            f"{PROG}: {what} {fail_above:g}x: {strategy} on {layout}, {payload} "
            f"{human_bytes(size)} ({size} B): {r.ratio:.2f}x "
            f"[{r.interval[0]:.2f}, {r.interval[1]:.2f}]",
            file=sys.stderr,
        )
    return SLOWED_EXIT if gated else 0


if __name__ == "__main__":
    sys.exit(main())
