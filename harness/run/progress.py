"""Progress of a sweep on the terminal (job i of N, elapsed, ETA), its table kept current, and a
summary at the end.

``results.csv`` is rewritten (atomically) after every job, so a sweep that fails part-way or is
interrupted still leaves the table of what it did, failed jobs included as rows with their
``status`` and ``error``. ``STATE`` is what the command line reads afterwards: how many jobs
failed, and where the records are.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hydra.experimental.callback import Callback

from harness import files


@dataclass
class SweepState:
    """The current command's jobs, shared by the sweeper, this callback and the CLI."""

    total: int = 0
    """Jobs in the sweep (set once every job's config has been validated); 0 if unknown."""
    done: int = 0
    failed: int = 0
    records: Path | None = None
    """The run or sweep directory the records go to."""


STATE = SweepState()


def write_table(root: Path) -> Path | None:
    """``root/results.csv`` from every record under ``root`` (None while there is none)."""
    from harness.report.collect import load

    df = load(root)
    if df.empty:
        return None
    return files.write_csv(root / "results.csv", df)


def _line(rec) -> str:
    # A dispatch job is named by its mode (leader:<strategy>, all_ranks): it has no baseline.
    who = (
        f"{rec.get('mode') or rec['strategy']:<22} {rec['layout']:<10} "
        if isinstance(rec, dict)
        else ""
    )
    if not isinstance(rec, dict) or rec.get("status") == "failed":
        error = rec.get("error") if isinstance(rec, dict) else rec
        return f"{who}FAILED: {str(error)[:160]}"
    if rec.get("supported") is False:
        return f"{who}UNSUPPORTED: {rec['error'][:120]}"
    return (
        f"{who}{rec['payload_bytes'] / 1024:9.0f} KiB "
        f"p50 {rec['p50_us'] / 1000:8.2f} ms  vs_floor {rec['vs_floor'] or 0:5.2f}"
        + (f"  vs_baseline {rec.get('vs_baseline') or 0:5.2f}" if "mode" not in rec else "")
    )


class Progress(Callback):
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.sweeping = False

    def on_job_start(self, config, **kwargs) -> None:
        # A single run's directory interpolates hydra:runtime, which resolves only once the
        # job has started (on_run_start would warn on every run); a sweep's is known earlier.
        if not self.sweeping:
            from hydra.core.hydra_config import HydraConfig

            STATE.records = Path(HydraConfig.get().runtime.output_dir)

    def on_multirun_start(self, config, **kwargs) -> None:
        self.t0 = time.monotonic()
        self.sweeping = True
        STATE.records = Path(str(config.hydra.sweep.dir))
        jobs = f"{STATE.total} jobs, every config valid" if STATE.total else "jobs"
        print(f"bcastbench: sweep of {jobs} -> {STATE.records}", flush=True)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if not self.sweeping:
            return  # a single run: the record speaks for itself
        STATE.done += 1
        elapsed = time.monotonic() - self.t0
        total = STATE.total
        eta = elapsed / STATE.done * (total - STATE.done) if total else math.nan
        rec = getattr(job_return, "_return_value", None)
        status = getattr(job_return.status, "name", str(job_return.status))
        if status != "COMPLETED" or not isinstance(rec, dict) or rec.get("status") == "failed":
            STATE.failed += 1
        print(
            f"[{STATE.done}/{total or '?'}] {elapsed:6.0f}s elapsed, ETA {eta:5.0f}s  {_line(rec)}",
            flush=True,
        )
        if STATE.records is not None:
            write_table(STATE.records)

    def on_multirun_end(self, config, **kwargs) -> None:
        from harness.report.collect import load, summary_table

        root = Path(str(config.hydra.sweep.dir))
        df = load(root)
        if not df.empty:
            files.write_csv(root / "results.csv", df)
        print(
            f"\nbcastbench: {STATE.done} jobs, {STATE.failed} failed, "
            f"{time.monotonic() - self.t0:.0f} s",
            file=sys.stdout,
        )
        print(summary_table(df))
        if "status" in df.columns:
            for _, row in df[df["status"] == "failed"].iterrows():
                print(
                    f"FAILED  {row['strategy']} {row['layout']} b{row['batch_size']}: {row['error']}"
                )
        print(f"records: {root}  table: {root / 'results.csv'}", flush=True)
