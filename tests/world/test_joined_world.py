"""The joined world under a launcher: a rank that stops responding names itself in the forked
world's terms (rank, limit, phase, outside any collective) and ends, so the launcher ends the
run well before gloo's own timeout would; a rank whose job raises ends non-zero at once, so
its launcher ends the others."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_support import REPO

FAST = ["iters=2", "warmup=0", "payload.batch_size=2", "payload.seq_len=64", "references=[]"]


@pytest.mark.world
def test_a_silent_joined_rank_names_itself_and_ends_the_run(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    scratch = tmp_path / "tmp"  # the ranks' temporary directory: nothing of ours may stay
    scratch.mkdir()
    t0 = time.monotonic()
    res = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "harness",
         "layout=tp2pp2", "layout.pp=1", *FAST, "fault.rank=1", "fault.at_iter=0", "fault.kind=hang",
         "timeout_s=4", f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TMPDIR": str(scratch)},
    )  # fmt: skip
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "rank 1 stopped responding for 4 s while 'timed iteration 0 of header'" in out, out[
        -3000:
    ]
    assert "outside any collective" in out, out[-3000:]
    assert not (tmp_path / "result.json").exists()
    assert took < 120, f"the silent rank took {took:.0f} s to end the run"
    # Rank 1 ended by its own watchdog, without its exit handlers: it had written nothing.
    left = [p.name for p in scratch.iterdir() if p.name.startswith("bcastbench")]
    assert left == [], left


@pytest.mark.world
def test_an_exception_on_one_rank_under_a_submitit_sweep_fails_the_job_at_once(tmp_path):
    """A rank of a launcher's world whose job raises ends its process non-zero (Hydra's sweep
    runner had turned the exception into a return value, the task ended 0 and the other rank
    waited in its collective): the other rank's collective fails at once, so it ends by its
    peer's exit, not by its watchdog, and the sweep fails with one line."""
    sweep = tmp_path / "sweep"
    res = subprocess.run(
        [sys.executable, "-m", "harness", "-m", "hydra/launcher=local",
         "hydra.launcher.tasks_per_node=2", "layout=tp2pp2", "layout.pp=1", *FAST,
         "fault.rank=1", "fault.at_iter=0", "fault.kind=raise", "timeout_s=120",
         f"hydra.sweep.dir={sweep}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert "bcastbench: a job's tasks failed" in out and "Traceback" not in out, out[-3000:]
    logs = {p.name: p.read_text() for p in sweep.glob(".submitit/*/*_log.err")}
    assert len(logs) == 2, sorted(logs)
    rank1 = next(text for name, text in logs.items() if name.endswith("_1_log.err"))
    assert "fault.kind=raise: rank 1" in rank1, rank1[-2000:]
    for name, text in logs.items():
        assert "this rank exits so the launcher ends the others" in text, (name, text[-2000:])
        assert "stopped responding" not in text, (name, text[-2000:])
    assert not list(sweep.rglob("result.json"))
