"""``bcastbench run --check``: every job of the command line composed and validated, their number
printed, nothing started and nothing written; a bad config is the usual one line and exit 2."""

from __future__ import annotations

import pytest

from harness.commands import cli


@pytest.fixture
def here(tmp_path, monkeypatch):
    """An empty working directory, and every way a job could start made to fail the test."""
    from harness.job import app
    from harness.worlds import opening

    def started(*args, **kwargs):
        raise AssertionError("a job or world started")

    monkeypatch.setattr(app, "run", started)
    monkeypatch.setattr(opening, "open_world", started)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _check(argv, capsys) -> tuple[int, str, str]:
    status = cli.main(["run", "--check", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_a_single_run_is_one_job_checked_and_nothing_written(here, capsys):
    status, out, err = _check(["strategy=header", "layout=tp2pp2", "payload.batch_size=64"], capsys)
    assert (status, out, err) == (0, "bcastbench: 1 job checked; none started\n", "")
    assert list(here.iterdir()) == []


def test_a_sweep_counts_every_job(here, capsys):
    argv = ["-m", "strategy=flat,header", "layout=tp2pp2,tp2pp2dp2", "payload.batch_size=3,8,64"]
    status, out, _ = _check(argv, capsys)
    assert (status, out) == (0, "bcastbench: 12 jobs checked; none started\n")
    assert list(here.iterdir()) == []


def test_the_flag_may_come_anywhere_and_a_named_sweep_expands(here, capsys):
    status = cli.main(["-m", "sweep=bench_quick", "--check", "iters=2"])
    assert status == 0 and "jobs checked; none started" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["payload.batch_size=0"], "payload.batch_size must be positive, got 0"),
        (["layout=nope"], "layout/nope"),
        (["payload.batch_size=8,64"], "Ambiguous value for argument"),  # a sweep needs -m
        (["iters=0"], "iters must be >= 1"),
        (["-m", "payload.batch_size=4,0"], "job 2 of 2"),
    ],
)
def test_a_bad_config_is_one_line_and_exit_2(argv, message, here, capsys):
    status, out, err = _check(argv, capsys)
    assert status == 2 and out == "", out
    assert len(err.splitlines()) == 1 and err.startswith("bcastbench: error:"), err
    assert message in err and "Traceback" not in err, err
    assert list(here.iterdir()) == []


def test_a_key_the_schema_lacks_names_the_valid_ones(here, capsys):
    status, _, err = _check(["payload.batchsize=8"], capsys)
    assert status == 2 and "valid keys: " in err and "batch_size" in err, err
