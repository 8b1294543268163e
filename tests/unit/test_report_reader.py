"""What a design reviewer reads: three result tables whose captions say which way is better, the
floor in words, peak RSS growth only where a job measured it on fresh pages, figures that draw
a one-job report and fit their text, and one line and exit 2 for a directory with no records
(report, collect and validate alike)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from harness.commands import report as build  # noqa: E402
from harness.report import collect, figures, markdown, tables  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sweep"
ONE_JOB = "3_header_tp2pp2_b32"


def _copy(tmp_path: Path, names: list[str] | None = None, **change) -> Path:
    """The fixture sweep (or only the named jobs) under ``tmp_path``, every record updated."""
    root = tmp_path / "sweep"
    for path in sorted(FIXTURE.rglob("result.json")):
        if names is not None and path.parent.name not in names:
            continue
        rec = {**json.loads(path.read_text()), **change}
        (root / path.parent.name).mkdir(parents=True)
        (root / path.parent.name / "result.json").write_text(json.dumps(rec))
    return root


def _released(rec: dict, growth: int) -> dict:
    """``rec`` as a job that released its free heap before the memory call writes it."""
    rec["peak_rss_delta_bytes"] = growth
    for ref in rec.get("references", {}).values():
        ref.update(peak_rss_delta_bytes=growth * 2, peak_rss_heap_released=True)
    return rec


# -- report.md -------------------------------------------------------------------------------
def test_each_measure_is_its_own_table_saying_which_way_is_better():
    text = markdown.results_markdown(tables.load(FIXTURE))
    captions = [line for line in text.splitlines() if line.startswith("**")]
    per_layout = len(tables.layouts_of(tables.load(FIXTURE)))
    assert len(captions) == 3 * per_layout
    assert sum("p50 per call (ms" in c and "lower is better" in c for c in captions) == per_layout
    assert sum("`vs_floor`" in c and "lower is better" in c for c in captions) == per_layout
    assert sum("pickled" in c and "higher is better" in c for c in captions) == per_layout
    cells = [line for line in text.splitlines() if line.startswith("| ")]
    # No cell holds two figures: a ratio table's cells are one "×" figure each.
    assert not [c for c in cells if "·" in c or any(part.count("×") > 1 for part in c.split("|"))]


def test_recommendation_columns_say_which_way_is_better():
    text = markdown.recommendation_markdown(tables.load(FIXTURE))
    head = text.splitlines()[0]
    assert "winner vs_floor (×, lower is better)" in head
    assert "winner speedup over pickled (×, higher is better)" in head


@pytest.mark.parametrize(
    ("counts", "jobs", "says"),
    [
        ((("one", 1),), 1, "one broadcast (the only job)"),
        ((("chunks2", 3),), 3, "chunked into 2 (all 3 jobs)"),
        (
            (("one", 1), ("chunks2", 1)),
            2,
            "one broadcast (in 1 of 2 jobs), chunked into 2 (1 of 2)",
        ),
        ((("pp_first", 2), ("seed_hops", 1)), 3, "PP first then TP×CP (in 2 of 3 jobs), the "),
    ],
)
def test_floor_method_is_written_in_words(counts, jobs, says):
    row = {"floor_method": counts[0][0], "method_jobs": counts[0][1], "n_jobs": jobs,
           "method_counts": counts}  # fmt: skip
    assert tables.floor_method_text(row).startswith(says)


def test_floor_table_counts_every_method_that_won(tmp_path):
    root = _copy(tmp_path)
    first = next(p for p in sorted(root.rglob("result.json")) if "_tp2pp2_b32" in str(p))
    rec = json.loads(first.read_text())
    rec["floor_method"] = "chunks2"
    first.write_text(json.dumps(rec))
    floors = tables.floor_table(tables.load(root))
    row = floors[(floors.layout == "tp2pp2") & (floors.payload_bytes == rec["payload_bytes"])]
    counts = dict(row.iloc[0]["method_counts"])
    assert counts["chunks2"] == 1 and counts["one"] == int(row.iloc[0]["n_jobs"]) - 1
    text = markdown.results_markdown(tables.load(root))
    assert f"chunked into 2 (1 of {int(row.iloc[0]['n_jobs'])})" in text


def test_growth_not_measured_on_fresh_pages_is_left_out_and_said_so():
    df = tables.load(FIXTURE)  # recorded before the free heap was released
    assert not df["rss_growth_measured"].any()
    assert df["peak_rss_delta_bytes"].isna().all()
    costs = markdown.cost_markdown(df)
    assert "peak RSS growth" not in costs and "Its growth during one call is left out" in costs
    assert "peak RSS of a rank" in costs  # the whole-process peak stays


def test_growth_measured_on_fresh_pages_is_shown_with_pickled_beside_the_floor(tmp_path):
    root = tmp_path / "released"
    for path in FIXTURE.rglob("result.json"):
        rec = json.loads(path.read_text())
        if rec.get("supported") and rec["strategy"] != "pickled":
            (root / path.parent.name).mkdir(parents=True)
            rec = _released(rec, 3 << 20)
            (root / path.parent.name / "result.json").write_text(json.dumps(rec))
    df = tables.load(root)
    assert df["rss_growth_measured"].all()
    costs = markdown.cost_markdown(df)
    assert "peak RSS growth during one call (max over ranks)" in costs
    assert "malloc_trim" in costs and "clear_refs" in costs
    header_row = next(line for line in costs.splitlines() if line.startswith("| header |"))
    assert "3.0 MiB" in header_row
    pickled_row = next(line for line in costs.splitlines() if line.startswith("| *pickled*"))
    assert "6.0 MiB" in pickled_row  # its reference figure, twice the strategy's here


def test_report_names_the_command_that_regenerates_it(tmp_path):
    root = _copy(tmp_path)
    text = markdown.write_report(root).path.read_text()
    assert f"`bcastbench report {root}`" in text
    assert "harness.commands.report" not in text


# -- figures ---------------------------------------------------------------------------------
def _drawn(fig):
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


@pytest.mark.parametrize("plot", ["plot_latency", "plot_algbw"])
def test_one_job_draws_its_floor_as_a_point(tmp_path, plot):
    df = tables.load(_copy(tmp_path, [ONE_JOB]))
    fig = getattr(figures, plot)(df)
    (ax,) = [a for a in fig.axes if a.get_visible()]
    floor = next(line for line in ax.get_lines() if line.get_label().startswith("floor"))
    assert len(floor.get_xdata()) == 1 and floor.get_marker() not in (None, "None", "")
    title = ax.get_title()
    assert "the one job's fastest raw method (one broadcast)" in title
    assert "1 jobs" not in title


def test_titles_count_jobs_in_words():
    df = tables.load(FIXTURE)
    floors = tables.floor_table(df)
    first = tables.layouts_of(df)[0]
    n = int(floors.loc[floors.layout == first, "n_jobs"].max())
    title = figures.plot_latency(df).axes[0].get_title().replace("\n", " ")
    assert f"median over {n} jobs per size; won by one broadcast" in title


@pytest.mark.parametrize("strategies", [["header"], ["header", "flat"]])
def test_speedup_heatmap_keeps_its_text_inside_the_figure(tmp_path, strategies):
    names = [p.parent.name for p in FIXTURE.rglob("result.json")
             if json.loads(p.read_text())["strategy"] in strategies]  # fmt: skip
    fig = figures.plot_speedup(tables.load(_copy(tmp_path, names)))
    renderer = _drawn(fig)
    box = fig.bbox
    texts = [fig._suptitle] + [a.yaxis.label for a in fig.axes] + [a.title for a in fig.axes]
    for text in texts:
        if text is None or not text.get_text() or not text.get_visible():
            continue
        extent = text.get_window_extent(renderer)
        assert extent.x0 >= box.x0 - 1 and extent.x1 <= box.x1 + 1, text.get_text()
        assert extent.y0 >= box.y0 - 1 and extent.y1 <= box.y1 + 1, text.get_text()


# -- a directory with no records -------------------------------------------------------------
def _validate_main(argv):
    from harness.commands.validate import main

    return main(argv)


@pytest.mark.parametrize("command", ["report", "collect", "validate"])
@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_a_directory_without_records_is_one_line_and_exit_2(tmp_path, capsys, command, kind):
    root = tmp_path / "runs"
    if kind == "empty":
        root.mkdir()
    main = {"report": build.main, "collect": collect.main, "validate": _validate_main}[command]
    assert main([str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert str(root) in err and "result.json" in err and "run or sweep directory" in err


def test_report_help_names_bcastbench_report(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/repo/harness/commands/report.py"])
    with pytest.raises(SystemExit):
        build.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: bcastbench report")


# -- the measurement behind the growth column -----------------------------------------------
def test_growth_counts_what_a_call_allocates_even_after_the_same_call_freed_it():
    """A call that allocates what an earlier call freed reads its allocation, not the reused
    pages' 0, once the free heap is released before VmHWM is reset (phases.PeakMemory)."""
    import torch

    from harness.job import phases

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no /proc/self/clear_refs to reset VmHWM with")
    size = 24 << 20

    def call() -> float:
        return float(torch.ones(size // 4).sum())  # every page written

    call(), call()  # what a warm-up and the timed rounds leave behind
    assert phases.release_free_heap()
    base = phases.rss_now()
    assert phases.rss_peak_reset()
    call()
    assert phases.rss_peak() - base >= size * 0.9
