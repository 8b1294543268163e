"""A sweep directory belongs to one sweep: a second sweep into it, while the first runs or after
it left records there, is refused with one line naming the other sweep, and no job starts."""

from __future__ import annotations

import fcntl
import json
import os
import sys

import pytest

from harness.commands import cli
from harness.job.sweep_lock import LOCK, claim, release


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")


SWEEP = ["-m", "strategy=header,flat", "iters=1", "warmup=0"]


def test_a_sweep_dir_with_records_is_refused(tmp_path, capsys, in_process):
    sweep = tmp_path / "sweep"
    (sweep / "0_header_tp2pp2_b8").mkdir(parents=True)
    record = sweep / "0_header_tp2pp2_b8" / "result.json"
    record.write_text(json.dumps({"status": "ok", "p50_us": 1.0}))
    before = record.read_bytes()
    assert cli.main([*SWEEP, f"hydra.sweep.dir={sweep}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds 1 record(s) of an earlier sweep" in err[0], err
    assert "choose another hydra.sweep.dir" in err[0]
    assert record.read_bytes() == before
    assert sorted(p.name for p in sweep.iterdir()) == [LOCK, "0_header_tp2pp2_b8"]


def test_a_sweep_dir_in_use_is_refused_naming_its_owner(tmp_path, capsys, in_process):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    owner = {"pid": 4242, "host": "elsewhere", "started": "today", "command": "bcastbench -m x"}
    fd = os.open(sweep / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, json.dumps(owner).encode())
        fcntl.flock(fd, fcntl.LOCK_EX)  # another sweep holds it
        assert cli.main([*SWEEP, f"hydra.sweep.dir={sweep}"]) == 2
    finally:
        os.close(fd)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is in use by another sweep (pid 4242 on elsewhere" in err[0], err
    assert not list(sweep.rglob("result.json"))


def test_claim_is_released_when_its_holder_ends(tmp_path):
    root = claim(tmp_path / "s")
    info = json.loads((root / LOCK).read_text())
    assert info["pid"] == os.getpid() and oct((root / LOCK).stat().st_mode & 0o777) == "0o644"
    release(root)
    claim(root)  # free again: no records yet
    release(root)


def test_collect_recovers_a_record_its_killed_writer_left(tmp_path, capsys):
    """A writer killed between flush and rename leaves a whole hidden temporary and no
    record: collect renames it into place (readable by the team) and says so; a broken one is
    reported and left alone."""
    from harness.job.record_fields import complete
    from harness.report.collect import main as collect

    whole = tmp_path / "0_header_tp2pp2_b8"
    whole.mkdir()
    tmp = whole / ".result.json.abc123.tmp"
    record = complete({"status": "ok", "strategy": "header", "layout": "tp2pp2", "batch_size": 8})
    tmp.write_text(json.dumps(record))
    os.chmod(tmp, 0o600)
    broken = tmp_path / "1_flat_tp2pp2_b8"
    broken.mkdir()
    (broken / ".result.json.def456.tmp").write_text('{"status": "o')
    assert collect([str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert f"recovered {whole / 'result.json'}" in out.out
    assert "left " in out.err and "def456" in out.err
    assert (whole / "result.json").stat().st_mode & 0o777 == 0o644
    assert not tmp.exists() and (broken / ".result.json.def456.tmp").exists()


def test_only_hydras_own_files_are_shared_in_a_run_directory(tmp_path):
    """A run directory may be one the harness did not make (a torchrun rank that writes nothing
    runs in the temporary directory itself): only ``.hydra/`` and the job's log there are made
    readable; nothing else in it changes mode (an executable stays executable)."""
    from harness.files import share_hydra_files

    (tmp_path / ".hydra").mkdir(mode=0o700)
    (tmp_path / ".hydra" / "config.yaml").write_text("x: 1")
    os.chmod(tmp_path / ".hydra" / "config.yaml", 0o600)
    (tmp_path / "run.log").write_text("line")
    os.chmod(tmp_path / "run.log", 0o600)
    tool = tmp_path / "venv" / "bin" / "torchrun"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    os.chmod(tool, 0o755)
    os.chmod(tmp_path, 0o1777)
    share_hydra_files(tmp_path)
    modes = {p: oct(p.stat().st_mode & 0o7777) for p in
             (tmp_path, tmp_path / ".hydra", tmp_path / ".hydra" / "config.yaml",
              tmp_path / "run.log", tool)}  # fmt: skip
    assert list(modes.values()) == ["0o1777", "0o755", "0o644", "0o644", "0o755"], modes
