"""Every timed call a job made, kept beside its record (``samples.csv.gz``): any statistic can
be recomputed later, and ``bcastbench report`` and ``bcastbench compare`` read them.

One row per strategy, timed round and rank: ``strategy, block, round, rank, wall_us, cpu_us``.
``rank`` -1 is the call as the record counts it, its slowest rank (the max over ranks); a
dispatch job, timed on its driver, has only those rows. ``cpu_us`` is empty where no CPU was
measured. Gzipped CSV, which pandas reads directly (``pandas.read_csv``).
"""

from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path

import numpy as np

from harness.files import write_atomic

SAMPLES_FILE = "samples.csv.gz"
COLUMNS = ("strategy", "block", "round", "rank", "wall_us", "cpu_us")
SLOWEST = -1
"""The rank a row names when it is the call's slowest rank (the figure the record counts)."""


def rows(results, blocks: list[int]) -> list[tuple]:
    """The rows of every rank's result (``RankResult``, rank order) and of their max."""
    out = []
    per_rank = len(results) > 1 or results[0].cpu_s is not None
    for name in results[0].times_s:
        times = np.array([r.times_s[name] for r in results]) * 1e6
        cpus = [(r.cpu_s or {}).get(name) or [None] * times.shape[1] for r in results]
        for it, block in enumerate(blocks[: times.shape[1]]):  # its rounds may stop short
            if per_rank:
                for k, result in enumerate(results):
                    cpu = cpus[k][it]
                    out.append((name, block, it, result.rank, float(times[k, it]),
                                None if cpu is None else cpu * 1e6))  # fmt: skip
            out.append((name, block, it, SLOWEST, float(times[:, it].max()), None))
    return out


def write_samples(directory: Path, results, blocks: list[int]) -> Path:
    """``samples.csv.gz`` in ``directory``, atomically; its path."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows(results, blocks):
        writer.writerow(["" if v is None else v for v in row])
    return write_atomic(Path(directory) / SAMPLES_FILE, gzip.compress(text.getvalue().encode()))
