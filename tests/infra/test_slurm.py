"""The harness on a real (single-node) Slurm through hydra-submitit-launcher: in one sweep of two
2-rank jobs (one rank per Slurm task) the healthy job writes its record from rank 0 only, and the
job with a crashing rank fails the sweep promptly instead of hanging it.

The cluster (tests/infra/slurm.py) is the session's, shared with the infra smoke tests and
stopped by PID at session end. Skips when it cannot be (not root, no apt); BCB_REQUIRE_INFRA=1
turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.slurm import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
FAST = [
    "layout=tp2pp2",
    "layout.pp=1",
    "iters=2",
    "warmup=1",
    "payload.batch_size=2",
    "payload.seq_len=64",
]
RESOURCES = [
    "hydra.launcher.nodes=1",
    "hydra.launcher.tasks_per_node=2",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=1",
    "hydra.launcher.timeout_min=5",
]

FAST_FAILURE = {"BCASTBENCH_SLURM_POLL_S": "2", "BCASTBENCH_SLURM_RESULT_WAIT_S": "2"}
"""A one-node test cluster whose files are local: poll sacct often and do not wait out
submitit's shared-filesystem margin for a job that ended without a result."""

pytestmark = [pytest.mark.world, pytest.mark.slow]
# The launcher plugin is the optional "slurm" extra; without it there is nothing to test here.
pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher")


@pytest.fixture
def slurm(slurm_cluster):
    """The session's cluster (tests/conftest.py), idle between tests."""
    slurm_cluster.wait_idle(timeout=60)
    return slurm_cluster


def _sweep(slurm: SlurmCluster, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", "-m", *args, *RESOURCES,
         f"hydra.launcher.partition={slurm.partition}"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **slurm.env, **FAST_FAILURE, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_slurm_sweep_one_rank_per_task_and_crash(slurm, tmp_path):
    """One sweep of two jobs through the preset (``hydra/launcher=slurm``): the healthy job
    writes its record from rank 0 only; in the other rank 1 crashes, which fails that job
    promptly (the preset's SLURM_KILL_BAD_EXIT) and the sweep with it, instead of hanging it.
    """
    sweep = tmp_path / "sweep"
    t0 = time.monotonic()
    res = _sweep(
        slurm,
        "hydra/launcher=slurm",
        "strategy=header",
        "fault.rank=-1,1",
        "fault.kind=crash",
        *FAST,
        f"hydra.sweep.dir={sweep}",
    )
    sweep_s = time.monotonic() - t0
    out = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode != 0, out
    assert sweep_s < 240, f"the crashed job took {sweep_s:.0f} s to fail the sweep:\n{out}"
    records = sorted(sweep.rglob("result.json"))
    assert [p.parent.name for p in records] == ["0_header_tp2_b2"], res.stderr[-3000:]
    rec = json.loads(records[0].read_text())
    assert rec["world_size"] == 2 and rec["correct"] is True, rec
    # Each task of a job shares its directory; only rank 0 wrote there (no partial or extra
    # records, no per-rank files; the samples file is the job's, written by rank 0), and the
    # job's log holds rank 0's lines only.
    assert not list(sweep.rglob(".result.*"))
    assert sorted(p.name for p in records[0].parent.iterdir()) == [
        ".hydra",
        "bcastbench.log",
        "result.json",
        "samples.csv.gz",
    ]
    # Each job ran as 2 Slurm tasks (one rank each), not as a world forked by one task: one
    # submitit folder per job (array task), one log per task.
    task_logs = list((sweep / ".submitit").glob("*/*_log.out"))
    assert len({p.parent.name for p in task_logs}) == 2, task_logs
    assert len(task_logs) == 4, [p.name for p in task_logs]
    slurm.wait_idle(timeout=60)
    print(f"\nslurm sweep of 2 jobs, one crashing, failed in {sweep_s:.0f} s")


def test_plain_srun_tasks_are_the_ranks(slurm, tmp_path):
    """`srun -n 2 python -m harness ...` without submitit: each task joins as one rank from the
    step's Slurm variables, and rank 0 alone writes the record."""
    run_dir = tmp_path / "run"
    res = subprocess.run(
        ["srun", "-n", "2", "-t", "5", "--kill-on-bad-exit=1", "-J", "bcb-plain-srun",
         sys.executable, "-m", "harness", "strategy=flat", *FAST,
         f"hydra.run.dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, **slurm.env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rec = json.loads((run_dir / "result.json").read_text())
    assert rec["world_size"] == 2 and rec["correct"] is True and rec["strategy"] == "flat"
    slurm.wait_idle(timeout=60)
