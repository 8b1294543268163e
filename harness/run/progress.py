"""Progress of a sweep on the terminal (job i of N, elapsed, ETA) and a summary at the end."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback


def sweep_size(overrides: list[str]) -> int:
    """Number of jobs a BasicSweeper makes from these command-line overrides."""
    n = 1
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            n *= max(1, len(list(o.sweep_string_iterator())))
    return n


class Progress(Callback):
    def __init__(self) -> None:
        self.total = 0
        self.done = 0
        self.failed = 0
        self.t0 = time.monotonic()
        self.sweep_dir: str | None = None

    def on_multirun_start(self, config, **kwargs) -> None:
        self.t0 = time.monotonic()
        try:
            self.total = sweep_size(list(config.hydra.overrides.task))
        except Exception:
            self.total = 0
        self.sweep_dir = str(config.hydra.sweep.dir)
        print(f"bcastbench: sweep of {self.total or '?'} jobs -> {self.sweep_dir}", flush=True)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if self.sweep_dir is None:
            return  # a single run: the record speaks for itself
        self.done += 1
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.total else math.nan
        rec = getattr(job_return, "_return_value", None)
        status = getattr(job_return.status, "name", str(job_return.status))
        if status != "COMPLETED" or not isinstance(rec, dict):
            self.failed += 1
            line = f"FAILED: {getattr(job_return, '_return_value', '')}"
        elif rec.get("supported") is False:
            line = f"{rec['strategy']:<22} {rec['layout']:<10} UNSUPPORTED: {rec['error'][:120]}"
        else:
            line = (
                f"{rec['strategy']:<22} {rec['layout']:<10} {rec['payload_bytes'] / 1024:9.0f} KiB "
                f"p50 {rec['p50_us'] / 1000:8.2f} ms  vs_floor {rec['vs_floor'] or 0:5.2f}  "
                f"vs_baseline {rec['vs_baseline'] or 0:5.2f}"
            )
        print(
            f"[{self.done}/{self.total or '?'}] {elapsed:6.0f}s elapsed, ETA {eta:5.0f}s  {line}",
            flush=True,
        )

    def on_multirun_end(self, config, **kwargs) -> None:
        from harness.report.collect import load, summary_table

        root = Path(str(config.hydra.sweep.dir))
        df = load(root)
        if not df.empty:
            df.to_csv(root / "results.csv", index=False)
        print(
            f"\nbcastbench: {self.done} jobs, {self.failed} failed, "
            f"{time.monotonic() - self.t0:.0f} s",
            file=sys.stdout,
        )
        print(summary_table(df))
        print(f"records: {root}  table: {root / 'results.csv'}", flush=True)
