"""Turn any run or sweep directory into one tidy table: one row per job's result.json.

    bcastbench report target=csv results/sweeps/<dir> [--out table.csv]

``records_dir_problem`` is the one check ``report`` (either target) and ``validate`` make of the
directory they are given, so a wrong one reads the same (one line, exit 2) in all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pandas as pd

from harness.errors import USAGE_EXIT, program
from harness.files import MODE, write_csv

COLUMNS = [
    "status", "scope", "strategy", "mode", "layout", "world_size", "dp", "pp", "tp", "cp", "payload", "workload", "batch_size",
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


RECORD_KEYS = ("strategy", "layout", "payload", "batch_size", "seq_len")
"""Keys every job record has, whether the job ran, was refused or failed, since the first
(``harness.job.records``; ``status`` came later): a JSON object without them is no record of
ours."""


def read_record(path: Path, quiet: bool = False) -> dict | None:
    """The record in ``path`` (a result.json); None, said on stderr naming the file and what
    is wrong (unless ``quiet``: a caller whose other reader says it), where it is not readable
    JSON, not an object, or lacks a key every record has. Never one of ours (records are
    written whole): a report leaves it out and goes on."""
    why = None
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        why = f"not a readable record ({exc})"
    else:
        missing = [k for k in RECORD_KEYS if k not in rec] if isinstance(rec, dict) else None
        if missing is None:
            why = "not a record (a JSON object)"
        elif missing:
            why = f"not a job record (no {', '.join(missing)}; every record has "
            why += f"{', '.join(RECORD_KEYS)})"
    if why is None:
        return rec
    if not quiet:
        print(f"bcastbench: skipped {path}: {why}", file=sys.stderr)
    return None


def load(root: Path | str) -> pd.DataFrame:
    """Every result.json under ``root`` (nested reference dicts flattened as ref_<name>_<field>);
    one that is no record is skipped, said (``read_record``), and counted in
    ``attrs["n_skipped"]``."""
    return Loader()(root)


class Loader:
    """``load``, for a caller that loads the same directory again as it grows (a sweep's table
    after every job): each call reads only the result.json files that are new or changed since
    the last (by size, times and inode: records are replaced whole, never edited),
    so a sweep's table costs a job's records, not the sweep's. An unreadable file is said once,
    where it first appears (and read again once its mode changes: a chmod is a change)."""

    def __init__(self) -> None:
        self._read: dict[Path, tuple[tuple[int, ...], dict | None]] = {}
        self.changed = True
        """Whether the last call found a file new, replaced or gone since the call before."""

    def __call__(self, root: Path | str) -> pd.DataFrame:
        rows, skipped, seen = [], 0, {}
        for path in sorted(Path(root).rglob("result.json")):
            try:
                st = path.stat()
            except OSError:
                continue  # gone since the listing: no record now
            key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
            known = self._read.get(path)
            row = known[1] if known is not None and known[0] == key else _row(path)
            seen[path] = (key, row)
            if row is None:
                skipped += 1
            else:
                rows.append(row)
        self.changed = seen.keys() != self._read.keys() or any(
            self._read[path][0] != key for path, (key, _) in seen.items()
        )
        self._read = seen
        df = pd.DataFrame(rows)
        df.attrs["n_skipped"] = skipped
        return df


def _row(path: Path) -> dict | None:
    """The record in ``path`` as a table row (``read_record``, its references flattened)."""
    rec = read_record(path)
    if rec is None:
        return None
    for name, ref in (rec.pop("references", None) or {}).items():
        for k, v in ref.items():
            rec[f"ref_{name}_{k}"] = v
    rec["job_dir"] = str(path.parent)
    return rec


def summary_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "(no results)"
    cols = [c for c in COLUMNS if c in df.columns]
    keys = [c for c in ("layout", "batch_size", "strategy") if c in cols]
    view = df[cols].sort_values(keys, na_position="last") if keys else df[cols]
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


MODULE = "harness.report.collect"
"""Where ``bcastbench report target=csv`` lives (its printed name: ``harness.errors.program``)."""


def unfinished_writes(root: Path | str) -> list[Path]:
    """Temporary files a writer killed mid-rename left (``.result.json.*.tmp``, see
    ``harness.files.write_atomic``) where no result.json stands beside them."""
    return sorted(
        tmp
        for tmp in Path(root).rglob(".result.json.*.tmp")
        if tmp.is_file() and not (tmp.parent / "result.json").exists()
    )


def recover(root: Path | str) -> tuple[list[Path], list[Path]]:
    """Each unfinished write that holds a whole record (it was flushed before the rename
    that did not happen) renamed into place and made readable; the rest left as they are.
    Returns (recovered records, temporaries left)."""
    recovered, left = [], []
    for tmp in unfinished_writes(root):
        if read_record(tmp, quiet=True) is None:  # the caller names what is left
            left.append(tmp)
            continue
        os.chmod(tmp, MODE)
        os.replace(tmp, tmp.parent / "result.json")
        recovered.append(tmp.parent / "result.json")
    return recovered, left


def main(argv: list[str] | None = None) -> int:
    prog = program(MODULE)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0].replace("``", ""))
    ap.add_argument("root", help="a run or sweep directory (every result.json below it)")
    ap.add_argument("--out", help="CSV path (default <root>/results.csv)")
    args = ap.parse_args(argv)
    # Before the check: a directory whose only record a killed writer left is not empty.
    recovered, left = recover(args.root) if Path(args.root).is_dir() else ([], [])
    for path in recovered:
        print(f"{prog}: recovered {path} (a whole record its killed writer had not renamed)")
    for path in left:
        print(f"{prog}: left {path}: an unfinished write, not a whole record", file=sys.stderr)
    problem = records_dir_problem(args.root)
    if problem:  # a wrong directory is the caller's mistake, like a bad option: exit 2
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return USAGE_EXIT
    df = load(args.root)
    if df.empty and df.attrs["n_skipped"]:  # each said above; no CSV of nothing
        print(f"{prog}: error: {args.root}: no job record in it can be read", file=sys.stderr)
        return USAGE_EXIT
    out = Path(args.out) if args.out else Path(args.root) / "results.csv"
    write_csv(out, df)
    print(summary_table(df))
    print(f"\n{len(df)} records -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
