"""Records keep their strategy's options and the report keys on them; failed jobs are left out
of the report (and counted); a directory of failed jobs is one line and exit 1; Ray settings
are checked before any Ray starts."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pandas as pd
import pytest

from harness.job import records
from harness.job.spec import JobSpec
from harness.report import collect, tables
from strategies.core.layout import Layout

REPO = Path(__file__).resolve().parents[2]


def _record(tmp, name, strategy="pickled", options=None, status="ok", p50=100.0, **extra):
    spec = JobSpec(strategy, Layout(pp=2, tp=2), batch_size=8, seq_len=64, options=options or {})
    rec = {**records._job_fields(spec), "status": status, "supported": status != "failed"}
    if status == "ok":
        rec.update(payload_bytes=4096, p50_us=p50, p90_us=p50, floor_p50_us=50.0,
                   vs_floor=p50 / 50.0, vs_baseline=1.0, algbw_gbps=0.04)  # fmt: skip
    else:
        rec.update(error="rank 1 died")
    rec.update(extra)
    (tmp / name).mkdir()
    (tmp / name / "result.json").write_text(json.dumps(rec))
    return rec


def test_records_carry_options_scope_and_world():
    spec = JobSpec("pickled", Layout(pp=2, tp=2), options={"serialization": "dataclass"})
    fields = records._job_fields(spec)
    assert fields["options"] == {"serialization": "dataclass"}
    assert fields["scope"] == "broadcast" and fields["world"] == "forked"
    assert "dispatch" not in fields
    ray_job = JobSpec("header", Layout(pp=2, tp=2), world="ray", dispatch="all_ranks")
    fields = records._job_fields(ray_job)
    assert fields["scope"] == "dispatch+broadcast" and fields["dispatch"] == "all_ranks"
    assert fields["strategy"] is None  # all_ranks runs no broadcast strategy


def test_runs_with_different_options_are_never_merged(tmp_path):
    _record(tmp_path, "a", options={"serialization": "roll"}, p50=100.0)
    _record(tmp_path, "b", options={"serialization": "dataclass"}, p50=300.0)
    _record(tmp_path, "c", strategy="header", p50=40.0)
    df = tables.load(tmp_path)
    assert sorted(df["strategy"]) == [
        "header",
        "pickled [serialization=dataclass]",
        "pickled [serialization=roll]",
    ]
    table = tables.strategy_table(df)
    p50 = dict(zip(table["strategy"], table["p50_us"]))
    assert p50["pickled [serialization=roll]"] == 100.0
    assert p50["pickled [serialization=dataclass]"] == 300.0


def test_failed_jobs_are_left_out_and_counted(tmp_path):
    from harness.report.markdown import _failed_note

    _record(tmp_path, "a", strategy="header")
    _record(tmp_path, "b", strategy="flat", status="failed")
    df = tables.load(tmp_path)
    assert list(df["strategy"]) == ["header"]
    assert df.attrs["n_failed"] == 1
    assert "1 failed job(s) left out" in _failed_note(df)
    assert {"status", "error"} <= set(collect.COLUMNS)
    assert "failed" in collect.summary_table(collect.load(tmp_path))


def test_a_sweep_whose_jobs_ran_elsewhere_is_counted_from_its_records(
    tmp_path, capsys, monkeypatch
):
    """A launcher that runs each job in processes of its own (submitit on Slurm) never ends a
    job in the driver: the summary counts the sweep's records, and a failed one is a failure
    the command reports, not "0 jobs, 0 failed"."""
    from omegaconf import OmegaConf

    from harness.report import progress
    from harness.report.sweep_state import SweepState

    _record(tmp_path, "0_header", strategy="header")
    _record(tmp_path, "1_flat", strategy="flat", status="failed")
    monkeypatch.setattr(progress, "STATE", SweepState(total=2))
    progress.Progress().on_multirun_end(
        OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    )
    assert (progress.STATE.done, progress.STATE.failed) == (2, 1)
    out = capsys.readouterr().out
    assert "bcastbench: 2 jobs, 1 failed" in out and "FAILED  flat" in out, out


def test_report_of_only_failed_jobs_is_one_line_and_exit_1(tmp_path, capsys):
    from harness.commands.report import main

    _record(tmp_path, "a", status="failed")
    _record(tmp_path, "b", strategy="flat", status="failed")
    assert main([str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert "all 2 job(s)" in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize(
    "text, says",
    [
        ('{"strategy": 5', "not a readable record"),  # a truncated write
        ("[1, 2]", "not a record (a JSON object)"),
        ('{"strategy": "shm", "p50_us": "abc"}', "not a job record (no layout, payload"),
    ],
)
def test_a_file_that_is_no_record_is_skipped_naming_it_by_every_reader(tmp_path, capsys, text,
                                                                        says):  # fmt: skip
    """A result.json that is not one of ours (records are written whole) is said once, naming
    the file, and left out: beside a real record the report is made from that one; alone, every
    reader ends in one line and exit 2 instead of a traceback."""
    from harness.commands.report import main as report
    from harness.commands.validate import validate
    from harness.report.collect import main as to_csv

    alone = tmp_path / "alone"
    (alone / "x").mkdir(parents=True)
    (alone / "x" / "result.json").write_text(text)
    assert report([str(alone)]) == 2
    err = capsys.readouterr().err
    assert err.count("skipped") == 1 and says in err and str(alone / "x") in err, err
    assert "no job record in it can be read" in err and "Traceback" not in err
    assert to_csv([str(alone)]) == 2 and "no job record" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no job record in it can be read"):
        validate(alone, quiet=True)

    beside = tmp_path / "beside"
    shutil.copytree(REPO / "tests" / "fixtures" / "sweep" / "1_flat_tp2pp2_b32", beside / "good")
    (beside / "bad").mkdir()
    (beside / "bad" / "result.json").write_text(text)
    df = collect.load(beside)
    assert len(df) == 1 and df.attrs["n_skipped"] == 1
    assert report([str(beside)]) == 0


def test_a_sweeps_table_reads_each_record_once_and_again_only_when_replaced(
    tmp_path, capsys, monkeypatch
):
    """``collect.Loader`` (the table a sweep rewrites after every job): a second load reads
    only new or replaced records, says an unreadable one once, and gives the table a fresh
    ``load`` gives."""
    load = collect.Loader()
    _record(tmp_path, "a", p50=100.0)
    assert list(load(tmp_path)["p50_us"]) == [100.0]
    read = []
    real = collect.read_record
    monkeypatch.setattr(collect, "read_record", lambda path: read.append(path) or real(path))
    _record(tmp_path, "b", p50=200.0)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "result.json").write_text('{"strategy": 5')  # a torn write
    df = load(tmp_path)
    assert [p.parent.name for p in read] == ["b", "c"] and df.attrs["n_skipped"] == 1
    assert capsys.readouterr().err.count("skipped") == 1
    # A record replaced whole (a recovered writer's) is read again; the rest are not. Its size
    # differs: a clock tick can hold both writes, and the freed inode can come back.
    shutil.rmtree(tmp_path / "a")
    _record(tmp_path, "a", p50=1500.25)
    read.clear()
    df = load(tmp_path)
    assert [p.parent.name for p in read] == ["a"] and "skipped" not in capsys.readouterr().err
    assert list(df["p50_us"]) == [1500.25, 200.0] and load.changed
    pd.testing.assert_frame_equal(df, collect.load(tmp_path))
    load(tmp_path)
    assert not load.changed
    shutil.rmtree(tmp_path / "b")
    assert len(load(tmp_path)) == 1 and load.changed


def test_a_sweeps_table_written_after_a_failed_write_is_current(tmp_path, monkeypatch):
    """``SweepTable``: a write that failed (a full disk) leaves the table stale, and the next
    job's write brings it up to date though no record changed in between; with nothing
    changed since a good write, the table is left alone."""
    from harness import files
    from harness.report.progress import SweepTable

    table, real = SweepTable(), files.write_csv
    _record(tmp_path, "a")
    monkeypatch.setattr(files, "write_csv", lambda *a: (_ for _ in ()).throw(OSError(28, "full")))
    with pytest.raises(OSError):
        table.write(tmp_path)
    writes = []
    monkeypatch.setattr(files, "write_csv", lambda *a: writes.append(a) or real(*a))
    table.write(tmp_path)
    table.write(tmp_path)
    assert len(writes) == 1 and len(pd.read_csv(tmp_path / "results.csv")) == 1


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from harness import paths
    from harness.job.config_schema import register

    register()
    with initialize_config_dir(config_dir=str(paths.CONF_DIR), version_base="1.3"):
        return compose("config", overrides)


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["world=threads"], "world must be forked or ray"),
        (["ray.dispatch=leader"], "ray.dispatch=leader needs world=ray"),
        (["world=ray", "ray.dispatch=everyone"], "ray.dispatch must be one of none, leader"),
        (["world=ray", "ray.placement=SPREAD"], "ray.placement must be STRICT_PACK or PACK"),
        (["ray_job=all_ranks", "fault.rank=1"], "fault injection runs on broadcast jobs only"),
        (
            ["ray_job=leader_header", "emulate.enabled=true"],
            "bcastbench run target=dispatch-emulated",
        ),
    ],
)
def test_ray_settings_are_checked_before_ray_starts(overrides, says):
    from harness.errors import ConfigError
    from harness.job.config import validate

    with pytest.raises(ConfigError, match=says):
        validate(_compose(overrides))


def test_missing_ray_is_one_line_naming_the_install(monkeypatch, capsys, tmp_path):
    from harness.commands import cli
    from harness.job import app  # noqa: F401 -- imported with the real Ray, as a run has it

    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))  # not Ray: no init
    assert cli.main(["world=ray", f"hydra.run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "ray==2.60.0"' in err, err
