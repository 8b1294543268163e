"""How sure the suite is of what it recommends: a winner only where the paired intervals say so
(ties listed, 'no interval' without one) on the terminal and in the report, oversubscribed cells
marked, every p50 recomputed from the samples the job kept, and one style per strategy."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import strategies  # noqa: E402
from harness.job.records import job_line  # noqa: E402
from harness.job.verdict import NO_INTERVAL, TIED, WINNER, decide, job_verdict  # noqa: E402
from harness.report import figures_sizes, markdown, sure, tables  # noqa: E402
from harness.report.styles import BUILTIN, style, styles  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sweep"
TEMPLATE = json.loads(next(iter(sorted(FIXTURE.rglob("result.json")))).read_text())
FLOOR_US = 100.0


# -- the rule -------------------------------------------------------------------------------
def test_a_winner_only_where_every_interval_excludes_one():
    times = {"shm": 1.0, "flat": 1.5, "pickled": 9.0}
    v = decide(times, {"flat": (1.2, 1.9), "pickled": (7.0, 11.0)}.get)
    assert v.kind == WINNER and v.best == "shm" and v.text() == "shm" and not v.tied
    assert v.runner_up_text() == "flat 1.50× [1.20–1.90]"


def test_an_interval_holding_one_is_a_tie_naming_every_tied_strategy():
    times = {"shm": 1.0, "auto": 1.02, "flat": 1.3, "pickled": 9.0}
    intervals = {"auto": (0.9, 1.2), "flat": (0.95, 1.8), "pickled": (7.0, 11.0)}
    v = decide(times, intervals.get)
    assert v.kind == TIED and v.text() == "shm ≈ auto ≈ flat (tied)"
    assert v.names == ("shm", "auto", "flat")


def test_without_an_interval_no_winner_is_invented():
    v = decide({"shm": 1.0, "flat": 1.5}, lambda name: None)
    assert v.kind == NO_INTERVAL and v.text() == "shm (no interval)"
    assert decide({"shm": 1.0}, lambda name: None).runner_up is None


# -- hand-built records, as a record_each job writes them -----------------------------------
def _record(name: str, p50: float, p50s: dict, pair: dict, **change) -> dict:
    """``name``'s record in a job that timed ``p50s``; ``pair[(a, b)]``: a's time over b's
    interval (paired), absent where the job had too few rounds."""
    refs = {}
    for other, t in p50s.items():
        if other != name:
            lo, hi = pair.get((other, name)) or (None, None)
            refs[other] = {"p50_us": t, "vs_strategy": t / p50, "vs_strategy_lo": lo,
                           "vs_strategy_hi": hi}  # fmt: skip
    refs["floor"] = {"p50_us": FLOOR_US}
    return {**TEMPLATE, "strategy": name, "p50_us": p50, "floor_p50_us": FLOOR_US,
            "vs_floor": p50 / FLOOR_US, "references": refs, "status": "ok", **change}  # fmt: skip


def _pairs(p50s: dict, spread: float) -> dict:
    """Every pair's paired interval: the ratio of their p50s ± ``spread``."""
    return {(a, b): (p50s[a] / p50s[b] - spread, p50s[a] / p50s[b] + spread)
            for a in p50s for b in p50s if a != b}  # fmt: skip


def _job(root: Path, name: str, p50s: dict, pair: dict, samples: bool = True, **change) -> Path:
    """One job's directory: the first strategy's record, one per other strategy below it, and
    (``samples``) a samples file whose slowest-rank median is each strategy's p50."""
    job = root / name
    first, *others = p50s
    for who, where in [(first, job), *[(o, job / o) for o in others]]:
        where.mkdir(parents=True)
        file = {"samples_file": "samples.csv.gz" if who == first else "../samples.csv.gz"}
        rec = _record(who, p50s[who], p50s, pair, **(file if samples else {}), **change)
        (where / "result.json").write_text(json.dumps(rec))
    if samples:
        rows = ["strategy,block,round,rank,wall_us,cpu_us"]
        rows += [f"{s},0,{k},-1,{t * f},"
                 for s, t in p50s.items() for k, f in enumerate((0.9, 1.0, 1.1))]  # fmt: skip
        (job / "samples.csv.gz").write_bytes(gzip.compress("\n".join(rows).encode()))
    return job


def _records(job: Path) -> list[dict]:
    """The job's own record first, then the others it wrote."""
    paths = [job / "result.json", *sorted(job.glob("*/result.json"))]
    return [json.loads(p.read_text()) for p in paths]


CLEAR = {"auto": 150.0, "shm": 120.0, "flat": 300.0}
CLOSE = {"auto": 121.0, "shm": 120.0, "flat": 300.0}


def test_job_line_names_a_clear_winner_and_the_runner_up(tmp_path):
    job = _job(tmp_path, "clear", CLEAR, _pairs(CLEAR, 0.05))
    main, *others = _records(job)
    line = job_line(main, others)
    assert "fastest: shm, then auto 1.25× [1.20–1.30]" in line


def test_job_line_lists_a_tie_and_marks_an_oversubscribed_host(tmp_path):
    job = _job(tmp_path, "close", CLOSE, _pairs(CLOSE, 0.1),
               oversubscribed=True, ranks_on_node=4, host_cores=2)  # fmt: skip
    main, *others = _records(job)
    line = job_line(main, others)
    assert "fastest: shm ≈ auto (tied)" in line
    assert "† oversubscribed: 4 ranks on 2 cores" in line


def test_auto_serving_a_strategy_timed_beside_it_is_named_so_and_is_no_tie(tmp_path):
    """auto's calls are shm's when it serves shm: a tie by construction. The job line names it
    ``auto (→ shm)``, the verdict leaves it out (a real tie or runner-up is another one), and
    the report's cell does the same."""
    job = _job(tmp_path, "served", CLOSE, _pairs(CLOSE, 0.1))
    main, *others = _records(job)
    main["auto_choice"] = "shm"
    line = job_line(main, others)
    assert line.startswith("auto (→ shm) ") and "auto chose" not in line
    assert "fastest: shm, then flat" in line and "≈ auto" not in line
    (job / "result.json").write_text(json.dumps(main))
    rec = tables.recommendation(tables.load(tmp_path)).iloc[0]
    assert rec["answer"] == "shm" and rec["runner_up"] == "flat" and rec["tied_with"] == []


def test_a_job_without_its_fastest_strategys_record_says_what_it_knows(tmp_path):
    job = _job(tmp_path, "alone", CLEAR, _pairs(CLEAR, 0.05))
    main = _records(job)[0]  # auto's alone: shm's own record (with the others) not read
    verdict = job_verdict([main])
    assert verdict.best == "shm" and verdict.runner_up == "auto"
    lo, hi = verdict.runner_up_interval  # auto over shm: auto's record's shm ratio turned round
    assert lo == pytest.approx(1 / (120 / 150 + 0.05)) and hi == pytest.approx(1 / 0.75)


# -- the report -----------------------------------------------------------------------------
@pytest.fixture
def sweep(tmp_path) -> Path:
    """Two cells of one layout: a clear winner at 3 rows, a tie at 32 (oversubscribed)."""
    root = tmp_path / "sweep"
    _job(root, "0_b3", CLEAR, _pairs(CLEAR, 0.05), batch_size=3, payload_bytes=1000)
    _job(root, "1_b32", CLOSE, _pairs(CLOSE, 0.1), batch_size=32, payload_bytes=32000,
         oversubscribed=True, ranks_on_node=4, host_cores=2, load_avg_1m=3.5)  # fmt: skip
    return root


def test_the_recommendation_names_winners_and_ties_from_the_intervals(sweep):
    rec = tables.recommendation(tables.load(sweep)).set_index("payload_bytes")
    assert rec.loc[1000, "kind"] == WINNER and rec.loc[1000, "answer"] == "shm"
    assert rec.loc[32000, "kind"] == TIED and rec.loc[32000, "answer"] == "shm ≈ auto (tied)"
    text = markdown.recommendation_markdown(tables.load(sweep))
    assert "| **shm** |" in text and "**shm** ≈ **auto** (tied)" in text
    assert "auto 1.25× [1.20–1.30]" not in text  # the table's cell is the ratio alone:
    assert "1.25× [1.20–1.30]" in text


def test_old_records_without_intervals_say_so():
    rec = tables.recommendation(tables.load(FIXTURE))
    assert set(rec["kind"]) == {NO_INTERVAL}
    assert all(a.endswith("(no interval)") for a in rec["answer"])


def test_oversubscribed_cells_are_marked_with_a_legend(sweep):
    df = tables.load(sweep)
    assert sure.oversubscribed_cells(df) == {(df["layout"].iloc[0], 32000): "4 ranks on 2 cores"}
    text = markdown.results_markdown(df)
    header = next(line for line in text.splitlines() if line.startswith("| strategy"))
    assert header.count(sure.MARK) == 1 and "31 KiB" + sure.MARK in header
    assert "† oversubscribed: more ranks on a node than the host had cores (4 ranks on 2" in text
    assert "ranks on a node" in tables.context_line(df) and "load" in tables.context_line(df)


def test_tables_show_each_figure_with_its_interval(tmp_path):
    root = tmp_path / "sweep"
    _job(root, "0_b3", CLEAR, _pairs(CLEAR, 0.05), p50_lo_us=110.0, p50_hi_us=130.0,
         vs_floor_lo=1.1, vs_floor_hi=1.3)  # fmt: skip
    text = markdown.results_markdown(tables.load(root))
    assert "| shm | 0.12 [0.11–0.13] |" in text and "| shm | 1.20× [1.10–1.30] |" in text


def test_every_p50_is_recomputed_from_its_samples(sweep):
    check = sure.check_samples(tables.load(sweep))
    assert (check.checked, check.matched, check.mismatches, check.without) == (6, 6, [], 0)
    assert "6 of 6 records checked match" in sure.samples_markdown(check)


def test_a_mismatch_and_a_bad_samples_file_are_named(sweep, tmp_path):
    shm = sweep / "0_b3" / "shm" / "result.json"
    shm.write_text(json.dumps({**json.loads(shm.read_text()), "p50_us": 125.0}))
    (sweep / "1_b32" / "samples.csv.gz").write_bytes(b"not gzip")
    _job(sweep, "2_old", CLEAR, {}, samples=False, batch_size=128, payload_bytes=128000)
    check = sure.check_samples(tables.load(sweep))
    assert check.checked == 6 and check.matched == 2 and check.without == 3
    text = sure.samples_markdown(check)
    assert "p50 125.000 µs, its samples' median 120.000 µs" in text
    assert "is not a samples file" in text and "3 record(s) name no samples file" in text
    (sweep / "1_b32" / "samples.csv.gz").unlink()
    assert any("is missing" in m for m in sure.check_samples(tables.load(sweep)).mismatches)


def test_report_md_says_what_was_checked_and_links_the_nccl_tests_figure(sweep):
    text = markdown.write_report(sweep).path.read_text()
    assert "## Checked against the samples" in text and "6 of 6 records checked match" in text
    assert f"]({figures_sizes.FIGURE})" in text and (sweep / figures_sizes.FIGURE).is_file()


def test_the_nccl_tests_figure_draws_time_and_busbw_with_interval_bars(tmp_path):
    root = tmp_path / "sweep"
    _job(root, "0_b3", CLEAR, _pairs(CLEAR, 0.05), p50_lo_us=110.0, p50_hi_us=130.0,
         busbw_gbps=0.5)  # fmt: skip
    fig = figures_sizes.plot_time_and_busbw(tables.load(root))
    assert len(fig.axes) == 2
    time_ax, busbw_ax = fig.axes
    assert {"shm", "auto", "flat"} <= {line.get_label() for line in time_ax.get_lines()}
    assert time_ax.containers and busbw_ax.containers  # the interval bars


# -- styles ---------------------------------------------------------------------------------
def test_every_registered_strategy_has_its_own_stable_style():
    names = strategies.names()
    drawn = styles(names)
    assert len({(s["color"], s["marker"]) for s in drawn.values()}) == len(names)
    assert len({s["color"] for s in drawn.values()}) == len(names)
    for name in names:  # the same whichever others a figure draws
        assert styles([name])[name] == drawn[name] == style(name)
    assert set(BUILTIN) <= set(names)
    assert style("pickled [serialization=dataclass]")["color"] == style("pickled")["color"]
    assert style("leader:header") == style("leader:header")


def test_a_record_each_job_counts_once_and_bench_sums_up_the_verdicts(sweep):
    floors = tables.floor_table(tables.load(sweep))
    assert list(floors["n_jobs"]) == [1, 1]  # three records per job, one floor each
    from harness.commands.bench import _verdicts

    assert _verdicts(sweep) == "2 cells: 1 winner, 1 tied (report.md names them)"


def test_a_winner_tied_with_the_next_sizes_is_no_crossover():
    """``shm ≈ auto`` at one size and ``auto ≈ shm`` at the next (auto serving shm) is one
    answer, not a crossover; a winner the next size's leader beats with confidence is one."""
    import pandas as pd

    from harness.report.tables import crossovers

    def row(size, winner, tied, kind):
        return {"layout": "tp2", "payload_bytes": size, "winner": winner, "tied_with": tied,
                "kind": kind}  # fmt: skip

    tied = pd.DataFrame([row(1, "shm", ["auto"], "tie"), row(2, "auto", ["shm"], "tie")])
    assert crossovers(tied) == [
        "**tp2**: no crossover: the lead passes between shm and auto, each tied with the next "
        "size's leader."
    ]
    clear = pd.DataFrame([row(1, "flat", [], "winner"), row(2, "shm", [], "winner")])
    assert crossovers(clear) == ["**tp2**: flat → shm between 1 B and 2 B."]


def test_push_or_pull_sets_the_best_of_each_side_by_side(tmp_path):
    """A cell with push and pull strategies timed in one job: the best of each by vs_floor,
    pull over push with the interval paired in the push winner's job; auto is neither; a
    report without a pull strategy has no such section."""
    from harness.report.pull_section import push_pull_markdown, push_pull_table

    p50s = {
        "shm": 120.0, "auto": 110.0, "flat": 300.0, "independent_fetch": 180.0, "mooncake": 400.0
    }  # fmt: skip
    _job(tmp_path / "mixed", "0_b3", p50s, _pairs(p50s, 0.05), batch_size=3, payload_bytes=1000)
    row = push_pull_table(tables.load(tmp_path / "mixed")).iloc[0]
    assert (row.push, row.pull) == ("shm", "independent_fetch")
    assert row.pull_over_push == pytest.approx(1.5) and row.interval == pytest.approx((1.45, 1.55))
    assert row.families == {
        "store": ("independent_fetch", pytest.approx(1.8)), "engine": ("mooncake", pytest.approx(4.0))
    }  # fmt: skip
    section = push_pull_markdown(tables.load(tmp_path / "mixed"))
    assert "| shm | 1.20× | independent_fetch | 1.80× | 1.50× [1.45–1.55] |" in section
    assert "store: independent_fetch 1.80×; engine: mooncake 4.00×" in section
    _job(tmp_path / "push", "0_b3", CLEAR, _pairs(CLEAR, 0.05), payload_bytes=1000)
    assert push_pull_markdown(tables.load(tmp_path / "push")) == ""


def test_push_or_pull_figure_draws_both_kinds_and_the_ratio(tmp_path):
    """The figure beside the section: per layout a vs_floor panel (pull solid, push dashed)
    and a pull-over-push panel whose point is the table's ratio; none without a pull record."""
    from harness.report import figures_pull

    p50s = {"shm": 120.0, "flat": 300.0, "independent_fetch": 180.0}
    for i, size in enumerate((1000, 4000)):
        _job(tmp_path / "mixed", f"{i}_b{i}", p50s, _pairs(p50s, 0.05), batch_size=i + 3,
             payload_bytes=size)  # fmt: skip
    fig = figures_pull.plot_push_pull(tables.load(tmp_path / "mixed"))
    top, bottom = fig.axes  # one layout: its vs_floor panel above its ratio panel
    styles = {line.get_label(): line.get_linestyle() for line in top.get_lines()}
    assert styles["independent_fetch"] == "-" and styles["shm"] == "--"
    ratio = next(line for line in bottom.get_lines() if line.get_label().startswith("best pull"))
    assert list(ratio.get_ydata()) == pytest.approx([1.5, 1.5])
    assert figures_pull.save(tables.load(tmp_path / "mixed"), tmp_path).name == "push_vs_pull.png"
    _job(tmp_path / "push", "0_b3", CLEAR, _pairs(CLEAR, 0.05), payload_bytes=1000)
    assert figures_pull.save(tables.load(tmp_path / "push"), tmp_path / "push") is None
