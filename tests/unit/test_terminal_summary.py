"""The summary a sweep prints when it ends (``harness.report.terminal``): one aligned line per
cell within 100 columns, ties counted where they do not fit, refused and failed cells one line
each, a long sweep's cells counted past a screenful."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from harness.report import terminal

FIXTURE = Path(__file__).parents[1] / "fixtures" / "sweep"


def test_every_cell_is_one_line_within_the_width():
    lines = terminal.sweep_summary(FIXTURE)
    assert lines[0].startswith("layout") and "fastest" in lines[0]
    cells = lines[1:]
    assert cells and all(len(line) <= terminal.WIDTH for line in lines)
    assert {line.split()[0] for line in cells} <= {"tp2pp2", "tp2pp2dp2", "refused"}


def test_a_refused_and_a_failed_cell_get_one_line_each(tmp_path):
    root = tmp_path / "sweep"
    shutil.copytree(FIXTURE, root)
    job = next(root.glob("0_*"))
    refused = json.loads((job / "result.json").read_text())
    refused.update(strategy="pickled", status="unsupported", supported=False,
                   error="pickled: memory: job flat on tp2pp2 with pickled needs 43 GiB")  # fmt: skip
    (job / "pickled").mkdir()
    (job / "pickled" / "result.json").write_text(json.dumps(refused))
    failed = dict(refused, strategy="header", status="failed", supported=True,
                  error="rank 1 exited with signal 9 (" + "x" * 200 + ")")  # fmt: skip
    (job / "header").mkdir()
    (job / "header" / "result.json").write_text(json.dumps(failed))
    lines = terminal.sweep_summary(root)
    assert any(line.startswith("refused tp2pp2 ") and "pickled (memory)" in line for line in lines)
    failed_lines = [line for line in lines if line.startswith("FAILED")]
    assert len(failed_lines) == 1 and failed_lines[0].endswith("…")
    assert all(len(line) <= terminal.WIDTH for line in lines)


def test_ties_that_do_not_fit_are_counted():
    names = ["shm", "independent_fetch", "vllm_tensor_dict", "flat"]
    assert terminal._named(names, 30) == "shm ≈ independent_fetch ≈ +2"
    assert terminal._named(["shm", "flat"], 30) == "shm ≈ flat"


def test_a_long_sweep_counts_what_it_does_not_list():
    lines = [f"cell {k}" for k in range(50)]
    shown = terminal._bounded(lines, "cells")
    assert len(shown) == terminal.MOST_LINES and shown[-1] == "… 21 more cells in results.csv"
