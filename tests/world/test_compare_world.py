"""``bcastbench compare`` on two real runs: a job, then the same job with rank 1 spending 2 ms
more in every call of the strategy under test. Compare names that cell, and only it, above
``--fail-above 1.5`` (exit 1), and a run compared with itself passes (exit 0). Both jobs run in
process on one forked 2-rank world, with ``record_each`` so the untouched reference (pickled)
is a cell too."""

from __future__ import annotations

import sys

import pandas as pd
import pytest

from harness.commands import cli
from harness.job import stats

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


def slowest(directory, name: str):
    """A run's calls of ``name`` as its record counts them (the slowest rank of each)."""
    samples = pd.read_csv(directory / "samples.csv.gz")
    return samples[(samples.strategy == name) & (samples["rank"] == -1)].wall_us.to_numpy()


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
    # Which cells compare must name follows from the samples the two runs kept, by the same
    # statistics; how far the load moved the untouched reference is not ours to bound.
    expected = {
        name
        for name in ("header", "pickled")
        if stats.shift_ratio(slowest(old, name), slowest(new, name))[1][0] > 1.5
    }
    # The delay guarantees every delayed call its 2 ms: where the first run's calls all took
    # well under that, the delayed cell has to be named.
    assert slowest(new, "header").min() >= 2000
    if slowest(old, "header").max() * 1.5 < 2000:
        assert "header" in expected
    named = {line.split(": ")[2].split()[0] for line in err.splitlines()}
    assert all(" on tp2" in line for line in err.splitlines()), err
    assert named == expected and status == (1 if expected else 0), out + err
    verdicts = {line.split()[0]: line.split()[-1] for line in out.splitlines()[1:-1]}
    assert set(verdicts) == {"header", "pickled"}, out
    assert all(verdicts[name] == "slower" for name in expected), out

    assert cli.main(["compare", str(old), str(old), "--fail-above", "1.5"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and all(line.split()[-1] == "same" for line in out.splitlines()[1:-1])
