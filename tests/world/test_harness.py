"""The Hydra harness end to end: validation, a multirun, torchrun, crash, hang and Ctrl-C.

CLI tests run ``python -m harness`` as users do (subprocesses); each costs a few seconds of
imports, so they are few and each checks several things.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_support import REPO, at_a_terminal, check_uneven_cycle_shapes, harness

from harness.job.record_fields import FIELDS
from harness.report.collect import load
from strategies.core.phase_clock import PHASES

FAST = ["iters=2", "warmup=1", "payload.batch_size=2", "payload.seq_len=64"]


def our_ranks(tmp_path: Path) -> list[str]:
    """Processes of this test's harness commands still alive (there must be none): forked ranks
    carry their driver's command line, which names the test's own directory."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    return [
        line
        for line in out.splitlines()
        if "-m harness" in line and str(tmp_path) in line and "pytest" not in line
    ]


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
    assert crash.returncode == 1
    assert "rank 2 exited with code 17 while 'timed iteration 1 of header'" in crash.stdout
    assert "1 of 2 jobs failed" in crash.stderr and "Traceback" not in crash.stderr
    by_status = {
        rec["status"]: rec
        for rec in map(
            json.loads, (p.read_text() for p in (tmp_path / "crash").rglob("result.json"))
        )
    }
    assert sorted(by_status) == ["failed", "ok"] and by_status["ok"]["correct"] is True
    for rec in by_status.values():  # one record shape, ok or failed
        assert list(rec)[: len(FIELDS)] == list(FIELDS), rec["status"]
    assert by_status["ok"]["error"] is None and by_status["failed"]["p50_us"] is None
    assert by_status["failed"]["error"].startswith("rank 2 exited with code 17")
    # The failed job is a row of the sweep's table too, with its status and error.
    table = load(tmp_path / "crash")
    assert sorted(table.status) == ["failed", "ok"]
    assert (tmp_path / "crash" / "results.csv").read_text().count("rank 2 exited with code 17")
    assert not list((tmp_path / "crash").rglob(".result.*"))
    assert time.monotonic() - t0 < 240  # two CLI sweeps; generous for a shared 2-core machine
    assert our_ranks(tmp_path) == []


@pytest.mark.world
def test_hang_fails_within_timeout_naming_the_rank(tmp_path):
    t0 = time.monotonic()
    res = harness(
        "fault.rank=1", "fault.at_iter=0", "fault.kind=hang", "timeout_s=6", *FAST,
        f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert res.returncode == 1
    assert "rank 1 stopped responding for 6 s while 'timed iteration 0 of header'" in res.stderr
    assert "outside any collective" in res.stderr
    assert elapsed < 6 + 15 + 25  # + the CLI's own start-up (imports, world) on a busy machine
    assert our_ranks(tmp_path) == []


@pytest.mark.world
def test_a_varying_workload_on_uneven_replicas_runs_from_the_command_line(tmp_path):
    """The CLI path of a real step: seq_len cycled per call, replicas handed 3 and 1 rows,
    steady rounds after the sequence; the record lists each shape with its own floor, every
    call verified on every rank."""
    res = harness(
        "layout=tp2pp2", "layout.pp=1", "layout.dp=2", "iters=4", "warmup=1",
        "steady_iters=2", "payload.seq_len=64", "payload.cycle=[{seq_len:64},{seq_len:32}]",
        "payload.dp_split=[3,1]", f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads((tmp_path / "result.json").read_text())
    check_uneven_cycle_shapes(rec)
    assert (rec["dp"], rec["tp"], rec["dp_split"]) == (2, 2, [3, 1])
    assert rec["workload"] and rec["batch_size"] == 3


@pytest.mark.world
def test_torchrun_joins_the_world(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    res = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "harness",
         "layout=tp2pp2", "layout.pp=1", *FAST, f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads((tmp_path / "result.json").read_text())
    assert rec["world_size"] == 2 and rec["correct"] is True and rec["tp"] == 2
    # Only rank 0 owns the job's directory: one log, named after the job, not __main__.
    assert sorted(p.name for p in tmp_path.glob("*.log")) == ["bcastbench.log"]


@pytest.mark.world
def test_ctrl_c_leaves_no_rank_and_no_half_record(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(
        # A short first job, whose record is on disk before the Ctrl-C, then one long enough
        # to be running when it comes.
        at_a_terminal("-m", "strategy=header", "iters=6,5000",
         "warmup=0", "payload.batch_size=2", "payload.seq_len=64",
         f"hydra.sweep.dir={sweep}"),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(sweep.rglob("result.json")) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends to the foreground group
    out, _ = proc.communicate(timeout=60)
    time.sleep(1.0)
    assert our_ranks(tmp_path) == []
    assert proc.returncode == 130
    # One line says where the records are; no KeyboardInterrupt traceback.
    assert f"bcastbench: interrupted; records written so far: {sweep}" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert not list(sweep.rglob(".result.*"))
    for rec in sweep.rglob("result.json"):
        json.loads(rec.read_text())  # every record there is whole
    assert (sweep / "results.csv").exists()  # the table of the jobs done before Ctrl-C


@pytest.fixture
def forked_worlds_closed():
    """Close the worlds a test's in-process job forked (the session's worlds stay)."""
    from harness.worlds.protocol import REGISTRY

    before = set(REGISTRY.worlds)
    yield
    for key in set(REGISTRY.worlds) - before:
        REGISTRY.close(key)


@pytest.mark.smoke
def test_one_job_in_process_records_its_shape(tmp_path, monkeypatch, forked_worlds_closed):
    """The smoke test of `make test-fast`: one small job through `bcastbench run` (in process:
    launcher, validation, a forked world, summary, record). ``layout=tp2pp2 layout.tp=1`` is
    recorded as the shape it ran, pp2, not as the preset's name."""
    from harness.commands import cli

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    handlers = list(logging.getLogger().handlers)
    assert cli.main(["layout=tp2pp2", "layout.tp=1", *FAST, f"hydra.run.dir={tmp_path}"]) == 0
    # The command hands the root logger back as it found it (no handler left on the job's
    # log file, which a later line would reopen after the directory is gone).
    assert logging.getLogger().handlers == handlers
    rec = json.loads((tmp_path / "result.json").read_text())
    assert (rec["layout"], rec["world_size"], rec["tp"], rec["pp"]) == ("pp2", 2, 1, 2)
    assert rec["status"] == "ok" and rec["correct"] is True and rec["vs_floor"] > 0
    # The run says what it did, on the terminal and in its log: strategy, shape, p50, ratios
    # and where the record is.
    log = (tmp_path / "bcastbench.log").read_text()
    assert "header pp2  rl_rollout b2" in log and "p50 " in log and "vs_floor " in log, log
    assert "faster than pickled" in log and f"record: {tmp_path / 'result.json'}" in log, log


@pytest.mark.world
def test_records_and_hydra_files_are_readable_by_the_team_under_umask_077(tmp_path):
    """Under a private umask every directory of the sweep and every file in it, Hydra's
    .hydra/ and logs included, ends readable by others as the records are; a second sweep
    into the same directory is refused and changes nothing."""
    sweep = tmp_path / "results" / "sweeps" / "s"
    argv = [sys.executable, "-m", "harness", "-m", "strategy=header", *FAST]
    res = subprocess.run(
        [*argv, f"hydra.sweep.dir={sweep}"], cwd=REPO, capture_output=True, text=True,
        timeout=240, preexec_fn=lambda: os.umask(0o077),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    modes = {
        str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777
        for p in [tmp_path / "results", *(tmp_path / "results").rglob("*")]
    }
    private = {path: oct(mode) for path, mode in modes.items() if mode & 0o044 != 0o044}
    assert not private, private
    assert any(path.endswith(".hydra/config.yaml") for path in modes)
    assert any(path.endswith("bcastbench.log") for path in modes)
    before = {p: p.stat().st_mtime_ns for p in sweep.rglob("*") if p.is_file()}
    again = subprocess.run(
        [*argv, f"hydra.sweep.dir={sweep}"], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert again.returncode == 2 and "already holds 1 record(s)" in again.stderr, again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    lock = sweep / ".bcastbench-sweep.lock"
    assert {p: p.stat().st_mtime_ns for p in sweep.rglob("*") if p.is_file()} == before | {
        lock: lock.stat().st_mtime_ns
    }


@pytest.mark.world
def test_a_recorded_batch_is_recorded_with_its_real_shape(
    tmp_path, monkeypatch, forked_worlds_closed
):
    """payload=file: the record says the recording's own width (9 tokens), not the config's
    seq_len default, and the job runs on the recording's rows."""
    from tensordict import TensorDict

    from harness.commands import cli
    from harness.payload.recording import save
    from strategies import DataProto

    td = TensorDict(
        {"input_ids": torch.arange(27).reshape(3, 9), "reward": torch.ones(3)}, batch_size=[3]
    )
    path = save(DataProto(td, {}, {}), tmp_path / "step.pt")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    run = tmp_path / "run"
    argv = ["payload=file", f"payload.path={path}", "payload.batch_size=4", "iters=2"]
    assert cli.main([*argv, "warmup=1", f"hydra.run.dir={run}"]) == 0
    rec = json.loads((run / "result.json").read_text())
    assert rec["status"] == "ok" and rec["correct"] is True
    assert (rec["seq_len"], rec["batch_size"], rec["payload"]) == (9, 4, "file:step")
    assert rec["payload_path"] == str(path.resolve())


@pytest.mark.world
def test_a_job_says_how_sure_it_is_and_a_delay_shows(tmp_path, monkeypatch, forked_worlds_closed):
    """One in-process job with repeats: every p50 and same-job ratio has its interval, the
    record says what the host offered and what a call cost in CPU, every timed call is kept
    beside it (the p50 recomputes from them), and a rank told to spend 3 ms more in every call
    of the strategy under test makes every call of it take at least that, which its interval
    against the same job's floor shows."""
    import pandas as pd

    from harness.commands import cli

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    base = ["layout=tp2", "iters=6", "warmup=1", "repeats=2", "payload.batch_size=2",
            "payload.seq_len=64", "references=[floor,pickled]"]  # fmt: skip
    assert cli.main([*base, f"hydra.run.dir={tmp_path / 'plain'}"]) == 0
    delay = ["fault.kind=delay", "fault.delay_us=3000", "fault.rank=1"]
    assert cli.main([*base, *delay, f"hydra.run.dir={tmp_path / 'late'}"]) == 0
    plain, late = (
        json.loads((tmp_path / d / "result.json").read_text()) for d in ("plain", "late")
    )
    for rec in (plain, late):
        assert rec["repeats"] == 2
        assert rec["p50_lo_us"] <= rec["p50_us"] <= rec["p50_hi_us"]
        for ratio in ("vs_floor", "vs_baseline"):
            assert rec[f"{ratio}_lo"] <= rec[f"{ratio}_hi"], ratio
        assert rec["references"]["pickled"]["vs_strategy_lo"] is not None
        assert rec["host_cores"] >= 1 and rec["ranks_on_node"] == 2
        assert rec["oversubscribed"] == (2 > rec["host_cores"]) and rec["cpu_us_per_call"] > 0
        # header marks its phases: the leader's call splits into plan, encode, copy and signal.
        split = [rec[f"leader_{p}_{u}"] for p in PHASES for u in ("us", "cpu_us")]
        assert all(v is not None and v >= 0 for v in split) and rec["leader_plan_us"] > 0, split
        samples = pd.read_csv(
            tmp_path / ("plain" if rec is plain else "late") / rec["samples_file"]
        )
        mine = samples[(samples.strategy == rec["strategy"]) & (samples["rank"] == -1)]
        assert len(mine) == 12 and mine.wall_us.median() == pytest.approx(rec["p50_us"])
    # The delay is inside every call of the strategy under test on rank 1: no call of it can
    # take less (what the load does to the rest is not asserted: it is not ours to bound).
    samples = pd.read_csv(tmp_path / "late" / late["samples_file"])
    slowest = samples[samples["rank"] == -1]
    assert slowest[slowest.strategy == late["strategy"]].wall_us.min() >= 3000
    assert late["p50_lo_us"] >= 3000
    # Wherever every call of the job's floor took less than the delay, every round's ratio is
    # above 1, so the interval has to be wholly above 1 too.
    method = late["floor_method"]
    floor = slowest[slowest.strategy == ("floor" if method == "one" else f"floor:{method}")]
    if floor.wall_us.max() < 3000:
        assert late["vs_floor_lo"] > 1, late


@pytest.mark.world
def test_a_rank_out_of_memory_is_named_and_the_sweep_keeps_its_records(tmp_path):
    """fault.kind=oom caps rank 1's address space just above what it holds: its next
    allocation fails as on a host out of memory. The job fails naming that rank as out of
    memory (not a peer that failed after it), and the job before it keeps its record."""
    sweep = tmp_path / "oom"
    res = harness(
        "-m", "fault.rank=-1,1", "fault.kind=oom", "fault.at_iter=1", "layout=tp2",
        "iters=2", "warmup=1", "payload.batch_size=128", "payload.seq_len=512", "timeout_s=30",
        f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in sweep.rglob("result.json")]
    by_status = {rec["status"]: rec for rec in records}
    assert sorted(by_status) == ["failed", "ok"] and by_status["ok"]["correct"] is True
    error = by_status["failed"]["error"]
    assert error.startswith("rank 1 ran out of memory in job header on tp2"), error
    assert our_ranks(tmp_path) == []
