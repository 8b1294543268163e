"""``bcastbench compare`` on two real runs: a job, then the same job with rank 1 spending 2 ms
more in every call of the strategy under test. Compare names that cell, and only it, above
``--fail-above 1.5`` (exit 1), and a run compared with itself passes (exit 0). Both jobs run in
process on one forked 2-rank world, with ``record_each`` so the untouched reference (pickled)
is a cell too."""

from __future__ import annotations

import sys

import pytest

from harness.commands import cli

BASE = ["strategy=header", "layout=tp2", "iters=10", "warmup=1", "payload.batch_size=2",
        "payload.seq_len=64", "references=[floor,pickled]", "record_each=true"]  # fmt: skip
DELAY = ["fault.kind=delay", "fault.delay_us=2000", "fault.rank=1"]


@pytest.fixture
def worlds_closed():
    """Close the worlds this test's in-process jobs forked (the session's worlds stay)."""
    from harness.worlds.protocol import REGISTRY

    before = set(REGISTRY.worlds)
    yield
    for key in set(REGISTRY.worlds) - before:
        REGISTRY.close(key)


@pytest.mark.world
def test_compare_names_the_delayed_cell_only(tmp_path, monkeypatch, capsys, worlds_closed):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    old, new = tmp_path / "old", tmp_path / "new"
    assert cli.main([*BASE, f"hydra.run.dir={old}"]) == 0
    assert cli.main([*BASE, *DELAY, f"hydra.run.dir={new}"]) == 0
    capsys.readouterr()

    status = cli.main(["compare", str(old), str(new), "--fail-above", "1.5"])
    out, err = capsys.readouterr()
    assert status == 1, out + err
    named = err.splitlines()
    assert len(named) == 1 and "header on tp2" in named[0], err
    verdicts = {line.split()[0]: line.split()[-1] for line in out.splitlines()[1:-1]}
    assert verdicts["header"] == "slower" and "pickled" in verdicts

    assert cli.main(["compare", str(old), str(old), "--fail-above", "1.5"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and all(line.split()[-1] == "same" for line in out.splitlines()[1:-1])
