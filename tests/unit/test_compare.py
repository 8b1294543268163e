"""``bcastbench compare`` (harness/commands/compare.py, harness/report/cells.py) and the
cross-run statistics it stands on (``harness.job.stats``): the Hodges-Lehmann interval against
a brute-force check and the Mann-Whitney tables, the verdict rules, cells matched across
inputs of every kind, and every bad input as one line and exit 2.

The fixtures (tests/fixtures/compare/) are two real tp2 jobs with ``record_each``: ``old``, and
``new`` with ``fault.kind=delay fault.delay_us=2000 fault.rank=1`` (header slowed about 4x,
pickled untouched), each with its ``results.csv`` from ``bcastbench collect``."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import shutil

import numpy as np
import pytest

from harness.commands import cli
from harness.job import stats
from harness.paths import REPO
from harness.report import cells

FIXTURES = REPO / "tests" / "fixtures" / "compare"
OLD, NEW = FIXTURES / "old", FIXTURES / "new"


def run(capsys, *args) -> tuple[int, str, str]:
    status = cli.main(["compare", *map(str, args)])
    out = capsys.readouterr()
    return status, out.out, out.err


# -- the statistics --------------------------------------------------------------------------
def _brute_u_counts(m: int, n: int) -> list[int]:
    """Every way to place m of m + n ranks, and the U each gives."""
    counts = [0] * (m * n + 1)
    for ranks in itertools.combinations(range(m + n), m):
        counts[sum(r - i for i, r in enumerate(ranks))] += 1
    return counts


@pytest.mark.parametrize(("m", "n"), [(1, 1), (3, 4), (5, 5), (4, 7), (8, 6)])
def test_u_distribution_is_the_enumerated_one(m, n):
    assert stats.u_counts(m, n) == _brute_u_counts(m, n)


@pytest.mark.parametrize(("m", "n", "k"), [(4, 4, 1), (5, 5, 3), (8, 8, 14), (10, 10, 24),
                                           (6, 9, 11), (3, 3, None)])  # fmt: skip
def test_shift_rank_is_the_mann_whitney_table(m, n, k):
    """Two-sided 5 % critical U (reject at U <= k - 1): 10 vs 10 -> 23, 8 vs 8 -> 13, ..."""
    assert stats.shift_rank(m, n) == k


@pytest.mark.parametrize(("m", "n"), [(30, 40), (50, 50), (24, 72)])
def test_normal_ranks_agree_with_exact_ones(m, n, monkeypatch):
    exact = stats.shift_rank(m, n)
    monkeypatch.setattr(stats, "EXACT_MAX_PAIRS", 0)
    assert abs(stats.shift_rank(m, n) - exact) <= 1


def test_hl_interval_is_the_brute_force_one_and_deterministic():
    rng = np.random.default_rng(7)
    old = rng.lognormal(7.0, 0.3, 12)
    new = rng.lognormal(7.4, 0.3, 9)
    ratio, (lo, hi) = stats.shift_ratio(old, new)
    diffs = sorted(math.log(b) - math.log(a) for a in old for b in new)
    counts, total = _brute_u_counts(12, 9), math.comb(21, 9)
    k = max(j for j in range(1, len(diffs)) if sum(counts[:j]) / total <= 0.025)
    assert lo == pytest.approx(math.exp(diffs[k - 1]))
    assert hi == pytest.approx(math.exp(diffs[len(diffs) - k]))
    assert ratio == pytest.approx(math.exp(float(np.median(diffs))))
    assert stats.shift_ratio(list(old), list(new)) == (ratio, (lo, hi))


def test_a_pure_shift_is_found_exactly():
    old = [100.0, 120.0, 90.0, 150.0, 110.0, 95.0, 130.0]
    ratio, (lo, hi) = stats.shift_ratio(old, [2 * t for t in old])
    assert ratio == pytest.approx(2.0) and lo < 2.0 < hi
    assert stats.shift_ratio(old, old)[0] == pytest.approx(1.0)
    assert stats.shift_ratio(old, [1.0, 2.0, 3.0])[1] is not None  # 7 vs 3 reaches 95 %
    assert stats.shift_ratio([1.0, 2.0], [1.0, 2.0])[1] is None
    assert stats.shift_ratio([], old) is None and stats.shift_ratio([0.0] * 5, old) is None


@pytest.mark.parametrize(("interval", "expected"), [
    ((1.06, 1.3), "slower"), ((1.05, 1.3), "same"), ((0.5, 0.95), "faster"),
    ((0.5, 1 / 1.05), "same"), ((0.9, 1.1), "same"), (None, "unknown"),
])  # fmt: skip
def test_verdict_rules(interval, expected):
    assert stats.verdict(interval, noise=0.05) == expected


def test_p50_ratio_interval_crosses_the_ends():
    assert stats.p50_ratio_interval((90.0, 110.0), (180.0, 220.0)) == (180 / 110, 220 / 90)
    assert stats.p50_ratio_interval(None, (1.0, 2.0)) is None


# -- cells -----------------------------------------------------------------------------------
def test_cells_of_a_directory_carry_each_strategys_slowest_rank_samples():
    found = cells.load_cells(OLD)
    assert sorted(k[0] for k in found) == ["header", "pickled"]
    header = next(c for k, c in found.items() if k[0] == "header")
    assert header.key[1:3] == ("tp2", "rl_rollout") and len(header.samples) == 8


def test_matching_cells_and_the_delayed_one_is_slower():
    rows = cells.compare(cells.load_cells(OLD), cells.load_cells(NEW))
    verdicts = {r.key[0]: (r.verdict, r.method) for r in rows}
    assert verdicts == {"header": ("slower", "hl"), "pickled": ("same", "hl")}


def test_options_label_and_pooling(tmp_path):
    assert cells.label("pickled", {"serialization": "dataclass"}) == (
        "pickled [serialization=dataclass]"
    )
    assert cells.label("pickled", "{}") == "pickled" and cells.label("flat", None) == "flat"
    for name in ("one", "two"):  # a sweep that ran the same cell twice
        shutil.copytree(OLD, tmp_path / name)
    pooled = cells.load_cells(tmp_path)
    assert len(pooled) == 2 and all(len(c.samples) == 16 for c in pooled.values())


def test_results_csv_and_no_samples_fall_back_to_p50_intervals(capsys):
    status, out, _ = run(capsys, OLD / "results.csv", NEW / "results.csv", "--csv")
    assert status == 0
    lines = out.splitlines()
    assert lines[0].startswith("strategy,layout,payload,bytes,old_p50_us")
    assert all(",p50ci," in line for line in lines[1:]) and len(lines) == 3
    status, out, _ = run(capsys, OLD, NEW, "--no-samples")
    assert status == 0 and "p50ci" in out and "hl =" not in out


def test_plain_output_is_a_table_with_a_legend(capsys):
    status, out, _ = run(capsys, OLD, NEW)
    lines = out.splitlines()
    assert status == 0 and lines[0].split()[:3] == ["strategy", "layout", "payload"]
    assert lines[1].split()[0] == "header" and lines[1].split()[-1] == "slower"
    assert lines[-1].startswith("method: hl = Hodges-Lehmann")


def test_fail_above_names_only_the_slowed_cell(capsys):
    status, _, err = run(capsys, OLD, NEW, "--fail-above", "1.5")
    assert status == 1
    assert err.splitlines() == [line for line in err.splitlines() if "header on tp2" in line]
    assert len(err.splitlines()) == 1 and "rl_rollout" in err and "9246 B" in err
    assert run(capsys, OLD, OLD, "--fail-above", "1.5")[0] == 0
    assert run(capsys, OLD, NEW, "--fail-above", "100")[0] == 0


def test_an_oversubscribed_cell_is_reported_not_gated(tmp_path, capsys):
    """A cell whose job ran more ranks than cores in either run is marked † and named by
    ``--fail-above`` without failing it (the host's load can decide it), unless
    ``--gate-oversubscribed``."""
    new = tmp_path / "new"
    shutil.copytree(NEW, new)
    for path in new.rglob("result.json"):
        record = json.loads(path.read_text())
        record["oversubscribed"] = record["strategy"] == "header"
        path.write_text(json.dumps(record))
    status, out, err = run(capsys, OLD, new, "--fail-above", "1.5")
    assert status == 0, err
    assert err.startswith(
        "bcastbench compare: not gated (oversubscribed), slower than 1.5x: header"
    )
    assert len(err.splitlines()) == 1 and "tp2 †" in out and out.splitlines()[-1].startswith("†")
    status, _, err = run(capsys, OLD, new, "--fail-above", "1.5", "--gate-oversubscribed")
    assert status == 1 and err.startswith("bcastbench compare: slower than 1.5x: header"), err


def _benchmark_json(path, p50s_us, with_data=True):
    """A pytest-benchmark JSON as the plugin's gate leaves it (one benchmark)."""
    stats_ = {"data": [p / 1e6 for p in p50s_us]} if with_data else {"median": 0.001}
    info = {"strategy": "header", "layout": "tp2pp2", "payload": "rl_rollout",
            "payload_bytes": 1000, "p50_us": float(np.median(p50s_us)),
            "p50_lo_us": min(p50s_us), "p50_hi_us": max(p50s_us)}  # fmt: skip
    path.write_text(
        json.dumps({"benchmarks": [{"name": "t", "stats": stats_, "extra_info": info}]})
    )
    return path


def test_pytest_benchmark_json(tmp_path, capsys):
    old = _benchmark_json(tmp_path / "old.json", [100.0, 104, 98, 101, 99, 103, 102])
    new = _benchmark_json(tmp_path / "new.json", [200.0, 210, 196, 202, 199, 205, 201])
    status, out, err = run(capsys, old, new, "--fail-above", "1.5")
    assert status == 1 and "header on tp2pp2" in err
    assert " hl " in out and "slower" in out
    bare = _benchmark_json(tmp_path / "bare.json", [100.0, 104, 98], with_data=False)
    status, out, _ = run(capsys, bare, bare)
    assert status == 0 and "p50ci" in out


# -- bad input: one line on stderr, exit 2 ---------------------------------------------------
def _copy(tmp_path):
    shutil.copytree(OLD, tmp_path / "run")
    return tmp_path / "run"


def _bad_inputs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = _copy(tmp_path / "a")
    (missing / "samples.csv.gz").unlink()
    malformed = _copy(tmp_path / "b")
    (malformed / "samples.csv.gz").write_bytes(gzip.compress(b"strategy,round\nheader,0\n"))
    garbage = _copy(tmp_path / "c")
    (garbage / "samples.csv.gz").write_bytes(b"not gzip at all")
    broken_json = tmp_path / "broken.json"
    broken_json.write_text("{not json")
    other = _copy(tmp_path / "d")
    for path in other.rglob("result.json"):
        path.write_text(path.read_text().replace('"tp2"', '"tp4"'))
    negative = _benchmark_json(tmp_path / "negative.json", [100.0, -1.0, 98, 101, 99, 103])
    return {
        "does not exist": (tmp_path / "nowhere", "no such file or directory"),
        "a negative round": (negative, "is not a positive number of seconds"),
        "no records": (empty, "no successful record"),
        "samples missing": (missing, "samples.csv.gz: samples file missing"),
        "samples malformed": (malformed, "no column block, rank, wall_us, cpu_us"),
        "samples not gzip": (garbage, "not a readable gzipped CSV"),
        "unreadable JSON": (broken_json, "broken.json: not readable JSON"),
        "no cell in common": (other, "no cell in common: OLD has 2 cell(s), NEW has 2"),
    }


@pytest.mark.parametrize("case", ["does not exist", "no records", "samples missing",
                                  "samples malformed", "samples not gzip", "unreadable JSON",
                                  "no cell in common", "a negative round"])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    path, words = _bad_inputs(tmp_path)[case]
    status, out, err = run(capsys, OLD, path)
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("bcastbench compare: error: ")
    assert words in err and "Traceback" not in err


def test_a_record_from_before_samples_falls_back_to_its_p50_interval(tmp_path, capsys):
    older = _copy(tmp_path)
    (older / "samples.csv.gz").unlink()
    for path in older.rglob("result.json"):
        record = json.loads(path.read_text())
        path.write_text(json.dumps({**record, "samples_file": None}))
    status, out, _ = run(capsys, OLD, older, "--csv")
    assert status == 0 and all(",p50ci," in line for line in out.splitlines()[1:])


def test_no_samples_reads_no_samples_file(tmp_path, capsys):
    missing = _copy(tmp_path)
    (missing / "samples.csv.gz").unlink()
    assert run(capsys, OLD, missing, "--no-samples")[0] == 0
