"""The Hydra harness end to end: validation, a multirun, torchrun, crash, hang and Ctrl-C.

CLI tests run ``python -m harness`` as users do (subprocesses); each costs a few seconds of
imports, so they are few and each checks several things.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.report.collect import load
from harness.run.config import register

REPO = Path(__file__).resolve().parents[2]
CONF = str(REPO / "conf")
FAST = ["iters=2", "warmup=1", "payload.batch_size=2", "payload.seq_len=64"]


def cfg_of(*overrides: str):
    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def harness(*args: str, timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def our_ranks() -> list[str]:
    """Processes forked by a harness driver that are still alive (there must be none)."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "-m harness" in line and "pytest" not in line]


@pytest.mark.world
def test_multirun_records_progress_and_a_crash(tmp_path):
    """Three jobs; the last one's rank 2 crashes: the sweep fails fast, naming the rank, and
    the two records written before it stay intact."""
    sweep = tmp_path / "sweep"
    t0 = time.monotonic()
    res = harness(
        "-m", "strategy=header,flat", *FAST, f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[1/2]" in res.stdout and "[2/2]" in res.stdout and "ETA" in res.stdout
    df = load(sweep)
    assert sorted(df.strategy) == ["flat", "header"]
    assert (df.correct == True).all()  # noqa: E712
    for col in ("p50_us", "vs_floor", "vs_baseline", "algbw_gbps", "floor_p50_us", "git_rev"):
        assert df[col].notna().all(), col
    assert (sweep / "results.csv").exists()
    crash = harness(
        "-m", "fault.rank=-1,2", "fault.at_iter=1", "timeout_s=30", *FAST,
        f"hydra.sweep.dir={tmp_path / 'crash'}",
    )  # fmt: skip
    assert crash.returncode != 0
    assert "rank 2 exited with code 17 while 'timed iteration 1 of header'" in crash.stderr
    records = list((tmp_path / "crash").rglob("result.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["correct"] is True
    assert not list((tmp_path / "crash").rglob(".result.*"))
    assert time.monotonic() - t0 < 240  # two CLI sweeps; generous for a shared 2-core machine
    assert our_ranks() == []


@pytest.mark.world
def test_hang_fails_within_timeout_naming_the_rank(tmp_path):
    t0 = time.monotonic()
    res = harness(
        "fault.rank=1", "fault.at_iter=0", "fault.kind=hang", "timeout_s=6", *FAST,
        f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert res.returncode != 0
    assert "rank 1 stopped responding for 6 s while 'timed iteration 0 of header'" in res.stderr
    assert "outside any collective" in res.stderr
    assert elapsed < 6 + 15 + 25  # + the CLI's own start-up (imports, world) on a busy machine
    assert our_ranks() == []


@pytest.mark.world
def test_torchrun_joins_the_world(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    res = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "4", "-m", "harness",
         "layout=tp2pp2", *FAST, f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads((tmp_path / "result.json").read_text())
    assert rec["world_size"] == 4 and rec["correct"] is True and rec["tp"] == 2


@pytest.mark.world
def test_ctrl_c_leaves_no_rank_and_no_half_record(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "-m", "strategy=header,flat,pickled",
         "iters=400", "warmup=0", "payload.batch_size=2", "payload.seq_len=64",
         f"hydra.sweep.dir={sweep}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(sweep.rglob("result.json")) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends to the foreground group
    proc.wait(timeout=60)
    time.sleep(1.0)
    assert our_ranks() == []
    assert not list(sweep.rglob(".result.*"))
    for rec in sweep.rglob("result.json"):
        json.loads(rec.read_text())  # every record there is whole
