"""Progress of a sweep on the terminal (job i of N, elapsed, ETA), its table kept current, and a
summary at the end.

``results.csv`` is rewritten (atomically) after every job, so a sweep that fails part-way or is
interrupted still leaves the table of what it did, failed jobs included as rows with their
``status`` and ``error``. ``STATE`` is what the command line reads afterwards: how many jobs
failed, and where the records are.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pandas as pd
from hydra.experimental.callback import Callback

from harness import files
from harness.job.records import job_line
from harness.job.verdict import records_beside
from harness.report.collect import Loader
from harness.report.sweep_state import STATE, eta_s
from harness.report.terminal import sweep_summary


class SweepTable:
    """A sweep's ``results.csv``, rewritten from every record under its directory whenever a
    record is new, replaced or gone since the table was last written (``collect.Loader``: each
    record read once), left alone otherwise."""

    def __init__(self) -> None:
        self.load = Loader()
        self._stale = True
        """Whether records changed since the table was last written (a write that failed
        leaves it so: the next one writes)."""

    def write(self, root: Path) -> pd.DataFrame:
        """The table under ``root`` brought up to date (not while there is no record); the
        records' table."""
        df = self.load(root)
        self._stale = self._stale or self.load.changed
        table = root / "results.csv"
        if not df.empty and (self._stale or not table.is_file()):
            files.write_csv(table, df)
            self._stale = False
        return df


class Progress(Callback):
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.sweeping = False
        self.table = SweepTable()

    def on_job_start(self, config, **kwargs) -> None:
        # A single run's directory interpolates hydra:runtime, which resolves only once the
        # job has started (on_run_start would warn on every run); a sweep's is known earlier.
        if not self.sweeping:
            from hydra.core.hydra_config import HydraConfig

            STATE.records = Path(HydraConfig.get().runtime.output_dir)
            _share_parents(STATE.records)

    def on_multirun_start(self, config, **kwargs) -> None:
        self.t0 = time.monotonic()
        self.sweeping = True
        # bcastbench run claimed it already (harness.job.sweep_lock); a sweep started another
        # way (a test's compose) just writes there.
        STATE.records = Path(str(config.hydra.sweep.dir))
        jobs = f"{STATE.total} jobs, every config valid" if STATE.total else "jobs"
        line = f"bcastbench: sweep of {jobs} -> {STATE.records}"
        print(line, flush=True)
        _append_log(STATE.records, line)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig

        # Hydra's own files (.hydra/, the log) follow the umask; records are for the team. Not
        # the whole run directory: a torchrun rank that writes nothing runs in the temporary
        # directory itself, and walking it made every file under /tmp 0644.
        files.share_hydra_files(HydraConfig.get().runtime.output_dir)
        if not self.sweeping:
            return  # a single run: its line was printed by the job
        STATE.done += 1
        elapsed = time.monotonic() - self.t0
        total = STATE.total
        eta = eta_s(elapsed, STATE.done, total, STATE.weights)
        rec = getattr(job_return, "_return_value", None)
        status = getattr(job_return.status, "name", str(job_return.status))
        if status != "COMPLETED" or not isinstance(rec, dict) or rec.get("status") == "failed":
            STATE.failed += 1

        line = f"[{STATE.done}/{total or '?'}] {elapsed:6.0f}s elapsed, ETA {eta:5.0f}s  "
        # A record_each job's other records hold the intervals against its fastest strategy.
        line += job_line(rec, records_beside(HydraConfig.get().runtime.output_dir))
        print(line, flush=True)
        if STATE.records is not None:
            _append_log(STATE.records, line)
            self.table.write(STATE.records)

    def on_multirun_end(self, config, **kwargs) -> None:
        root = Path(str(config.hydra.sweep.dir))
        df = self.table.write(root)
        if not STATE.done and not df.empty:
            # The launcher ran every job in processes of its own (Slurm tasks), so no job
            # ended here: the records are the count, and a failed one fails the command.
            STATE.done = len(df)
            STATE.failed = int((df["status"] == "failed").sum()) if "status" in df else 0
        lines = [
            f"\nbcastbench: {STATE.done} jobs, {STATE.failed} failed, "
            f"{time.monotonic() - self.t0:.0f} s",
            *(sweep_summary(root, df) if not df.empty else ["(no results)"]),
            f"records: {root}",
            f"table:   {root / 'results.csv'}",
        ]
        print("\n".join(lines), flush=True)
        _append_log(root, "\n".join(lines))
        files.share_tree(root)


SWEEP_LOG = "bcastbench.log"
"""A sweep directory's log: every line the sweep printed (each job's own log is in its folder)."""


def _share_parents(out: Path) -> None:
    """A single run's folder and those Hydra made above it inside the working directory
    (``results/runs``), readable as records are, whatever the umask."""
    out = out.resolve()
    cwd = Path.cwd().resolve()
    chain = [out, *out.parents]
    for path in chain[: chain.index(cwd)] if cwd in chain else [out]:
        if path.stat().st_mode & 0o777 == 0o700:
            files.share_tree(path) if path == out else os.chmod(path, files.DIR_MODE)


def _append_log(root: Path, text: str) -> None:
    # Appended line by line, not rewritten: a log is read while it grows, and a crash keeps
    # every line written before it.
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / SWEEP_LOG, "a") as f:
            f.write(text.rstrip("\n") + "\n")
    except OSError:
        pass  # the terminal still has the line; a log that cannot be written is no failure
