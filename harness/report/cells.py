"""Two runs cell by cell (``bcastbench compare``): load each side's cells from a result
directory, a ``results.csv`` or a pytest-benchmark JSON, match them, and price each match as a
ratio new / old with its 95 % interval (``harness.job.stats``).

A *cell* is one strategy (with its options label) on one layout, payload and payload size:
``(strategy, layout, payload, payload_bytes)``. Two records of the same cell in one input (a
sweep that ran it twice) are pooled: their samples together, the median of their p50s, and the
widest of their p50 intervals.

Every problem with an input raises ``CellsError`` with one line naming the file and what is
wrong; the command prints it and exits 2.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from harness.job import stats
from harness.job.interval import Interval, interval_of, widest
from harness.job.samples import COLUMNS, SLOWEST

HL, P50, NONE = "hl", "p50ci", "none"
"""How a row's interval was found: the Hodges-Lehmann interval of both runs' samples, the
conservative ratio of the two records' p50 intervals, or not at all."""
METHODS = {
    HL: "Hodges-Lehmann shift of log times, exact Mann-Whitney 95 % interval (samples)",
    P50: "new p50 interval / old p50 interval, ends crossed (no samples: conservative)",
    NONE: "no interval (too few samples and no p50 interval)",
}


class CellsError(ValueError):
    """An input ``compare`` cannot read; the message is one line."""


@dataclass
class Cell:
    key: tuple[str, str, str, int]
    """(strategy with its options label, layout, payload, payload_bytes)."""
    p50_us: float
    p50_interval: Interval | None
    samples: np.ndarray | None
    """The slowest-rank wall times (µs) of every timed call, or None."""
    oversubscribed: bool = False
    """Its job ran more ranks on a node than the host had cores (a pytest-benchmark JSON
    does not say: False)."""


@dataclass(frozen=True)
class Row:
    key: tuple[str, str, str, int]
    old_p50_us: float
    new_p50_us: float
    ratio: float
    interval: tuple[float, float] | None
    method: str
    verdict: str
    oversubscribed: bool = False
    """Either run's job of this cell was oversubscribed: on such a host the two runs' loads,
    not the code, can decide the ratio, so ``--fail-above`` reports it without gating on it."""


def load_cells(path: Path | str, samples: bool = True) -> dict[tuple, Cell]:
    """Every cell of ``path`` (a result directory, a results.csv or a pytest-benchmark JSON),
    pooled per key; ``samples=False`` reads no samples file."""
    path = Path(path)
    if not path.exists():
        raise CellsError(f"{path}: no such file or directory")
    if path.is_dir():
        cells = _from_records(path, samples)
    elif path.suffix == ".csv":
        cells = _from_csv(path)
    else:
        cells = _from_benchmark_json(path, samples)
    if not cells:
        raise CellsError(f"{path}: no successful record of a timed strategy in it")
    return _pooled(cells)


def compare(old: dict, new: dict, noise: float = 0.05) -> list[Row]:
    """A ``Row`` for each cell the two sides share, in key order; CellsError when none."""
    shared = sorted(set(old) & set(new), key=lambda k: tuple(map(str, k)))
    if not shared:
        raise CellsError(
            f"no cell in common: OLD has {len(old)} cell(s), NEW has {len(new)} "
            "(a cell is strategy, layout, payload and payload size)"
        )
    return [_row(old[key], new[key], noise) for key in shared]


def _row(old: Cell, new: Cell, noise: float) -> Row:
    ratio, interval, method = new.p50_us / old.p50_us, None, NONE
    if old.samples is not None and new.samples is not None:
        found = stats.shift_ratio(old.samples, new.samples)
        if found is not None and found[1] is not None:
            (ratio, interval), method = found, HL
    if interval is None:
        interval = stats.p50_ratio_interval(old.p50_interval, new.p50_interval)
        method = NONE if interval is None else P50
    verdict = stats.verdict(interval, noise)
    crowded = old.oversubscribed or new.oversubscribed
    return Row(old.key, old.p50_us, new.p50_us, ratio, interval, method, verdict, crowded)


def label(strategy: str, options) -> str:
    """A strategy's name with its options (``pickled [serialization=dataclass]``)."""
    if isinstance(options, str):  # as a CSV holds it: the dict's repr
        try:
            options = ast.literal_eval(options) if options.strip() else {}
        except (ValueError, SyntaxError):
            return f"{strategy} [{options}]"
    if not isinstance(options, dict) or not options:
        return strategy
    return f"{strategy} [{','.join(f'{k}={options[k]}' for k in sorted(options))}]"


def _number(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _cell(fields: dict, samples: np.ndarray | None = None) -> Cell | None:
    """A cell of a record-shaped dict, None unless it timed a strategy."""
    p50 = _number(fields.get("p50_us"))
    size = _number(fields.get("payload_bytes"))
    if fields.get("status", "ok") != "ok" or p50 is None or p50 <= 0 or size is None:
        return None
    key = (
        label(str(fields["strategy"]), fields.get("options")),
        str(fields.get("layout")),
        str(fields.get("payload")),
        int(size),
    )
    interval = interval_of(fields, "p50_us")
    crowded = fields.get("oversubscribed") in (True, "True", "true", 1, "1")
    return Cell(key, p50, interval, samples, crowded)


def _from_records(root: Path, samples: bool) -> list[Cell]:
    cells, read = [], {}
    for path in sorted(root.rglob("result.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CellsError(f"{path}: not a readable JSON record ({exc})") from None
        if not isinstance(record, dict):
            raise CellsError(f"{path}: not a record (a JSON object)")
        cell = _cell(record)
        if cell is None:
            continue
        # A record that names no samples file predates them: its p50 interval is all there is.
        # One that names a file it does not have is broken, and said so.
        if samples and record.get("samples_file"):
            cell.samples = _samples_of(path.parent / record["samples_file"], record, read)
        cells.append(cell)
    return cells


def _samples_of(path: Path, record: dict, read: dict) -> np.ndarray:
    """The slowest-rank wall times of ``record``'s strategy in its samples file."""
    path = path.resolve()
    if path not in read:
        read[path] = _read_samples(path)
    table = read[path]
    mine = table[(table["strategy"] == record["strategy"]) & (table["rank"] == SLOWEST)]
    times = mine["wall_us"].to_numpy(dtype=float)
    if len(times) == 0:
        raise CellsError(f"{path}: no slowest-rank (rank -1) rows of {record['strategy']!r}")
    if not (np.isfinite(times) & (times > 0)).all():
        raise CellsError(f"{path}: a wall_us of {record['strategy']!r} is not a positive time")
    return times


def _read_samples(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise CellsError(f"{path}: samples file missing (use --no-samples to compare p50s)")
    try:
        table = pd.read_csv(path, compression="gzip")
    except Exception as exc:  # gzip, CSV and encoding errors all mean the same to a user
        raise CellsError(f"{path}: not a readable gzipped CSV ({type(exc).__name__})") from None
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise CellsError(f"{path}: malformed samples file, no column {', '.join(missing)}")
    table["rank"] = pd.to_numeric(table["rank"], errors="coerce")
    table["wall_us"] = pd.to_numeric(table["wall_us"], errors="coerce")
    return table


def _from_csv(path: Path) -> list[Cell]:
    try:
        table = pd.read_csv(path)
    except Exception as exc:
        raise CellsError(f"{path}: not a readable CSV ({type(exc).__name__})") from None
    need = ["strategy", "layout", "payload", "payload_bytes", "p50_us"]
    missing = [c for c in need if c not in table.columns]
    if missing:
        raise CellsError(f"{path}: not a results.csv, no column {', '.join(missing)}")
    rows = table.astype(object).where(table.notna(), None).to_dict("records")
    return [c for c in map(_cell, rows) if c is not None]


def _from_benchmark_json(path: Path, samples: bool) -> list[Cell]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CellsError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise CellsError(f"{path}: not a pytest-benchmark JSON (no benchmarks list)")
    cells = []
    for bench in data["benchmarks"]:
        info = bench.get("extra_info") or {} if isinstance(bench, dict) else {}
        if "strategy" not in info:
            continue
        cell = _cell(info)
        data_s = (bench.get("stats") or {}).get("data")
        if cell is not None and samples and data_s:
            # One value per round: that round's p50 per call (the plugin's clock), in seconds.
            times = np.asarray(data_s, dtype=float)
            if not (np.isfinite(times) & (times > 0) & (times < 1e6)).all():
                raise CellsError(
                    f"{path}: a round's time of {info['strategy']!r} is not a positive number "
                    "of seconds (under 1e6)"
                )
            cell.samples = times * 1e6
        cells += [cell] if cell is not None else []
    return cells


def _pooled(cells: list[Cell]) -> dict[tuple, Cell]:
    by_key: dict[tuple, list[Cell]] = {}
    for cell in cells:
        by_key.setdefault(cell.key, []).append(cell)
    out = {}
    for key, group in by_key.items():
        if len(group) == 1:
            out[key] = group[0]
            continue
        intervals = [c.p50_interval for c in group]
        known = None not in intervals
        out[key] = Cell(
            key,
            float(np.median([c.p50_us for c in group])),
            widest(intervals) if known else None,
            None if any(c.samples is None for c in group) else np.concatenate(
                [c.samples for c in group]
            ),
            any(c.oversubscribed for c in group),
        )  # fmt: skip
    return out
