"""The joined world under torchrun: a rank that stops responding names itself in the forked
world's terms (rank, limit, phase, outside any collective) and ends, so the launcher ends the
run well before gloo's own timeout would."""

from __future__ import annotations

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
    t0 = time.monotonic()
    res = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "harness",
         "layout=tp2pp2", "layout.pp=1", *FAST, "fault.rank=1", "fault.at_iter=0", "fault.kind=hang",
         "timeout_s=4", f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
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
