"""The report shows the honest floor: the fastest raw method each job timed, named, with the
single broadcast beside it where another method won; records written before the floor became a
family (the fixture sweep) still render, their floor being the single broadcast."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from harness.report import figures, markdown, tables  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sweep"
CHUNKS_SHARE = 0.8
"""The chunked floor's p50 as a share of the single broadcast in the rewritten records."""
CHUNK_BYTES = 12345
"""A byte count only the chunked floor's reference carries, so the cost row shows whose it is."""


def _honest(rec: dict) -> dict:
    """``rec`` as a job of the floor family would write it: floor:chunks2 beat one broadcast."""
    single = rec["references"]["floor"]
    chunks = {**single, "p50_us": single["p50_us"] * CHUNKS_SHARE, "p90_us": single["p90_us"]}
    chunks.update(collectives_per_call=2, comm_bytes_leader=CHUNK_BYTES)
    rec["references"]["floor:chunks2"] = chunks
    rec.update(
        floor_p50_us=chunks["p50_us"],
        floor_method="chunks2",
        floor_single_p50_us=single["p50_us"],
        vs_floor=rec["p50_us"] / chunks["p50_us"],
        vs_floor_single=rec["p50_us"] / single["p50_us"],
    )
    return rec


@pytest.fixture(scope="module")
def honest_sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("honest")
    for path in FIXTURE.rglob("result.json"):
        rec = json.loads(path.read_text())
        if rec.get("supported", True) and rec.get("floor_p50_us"):
            rec = _honest(rec)
        out = root / path.parent.relative_to(FIXTURE)
        out.mkdir(parents=True)
        (out / "result.json").write_text(json.dumps(rec))
    return root


def test_floor_table_is_the_fastest_method_with_the_single_broadcast_beside_it(honest_sweep):
    df = tables.load(honest_sweep)
    floors = tables.floor_table(df)
    assert not floors.empty and set(floors["floor_method"]) == {"chunks2"}
    assert (floors["method_jobs"] == floors["n_jobs"]).all()
    ratio = floors["floor_p50_us"] / floors["floor_single_p50_us"]
    assert ratio.round(6).eq(CHUNKS_SHARE).all()
    # p90 is the winning method's own, not the single broadcast's.
    single_p90 = df.groupby(["layout", "payload_bytes"])["ref_floor_p90_us"].median()
    merged = floors.set_index(["layout", "payload_bytes"])["floor_p90_us"]
    assert (merged.sort_index() == single_p90.loc[merged.index].sort_index()).all()
    assert tables.winning_floor(df, "comm_bytes_leader").dropna().eq(CHUNK_BYTES).all()


def test_old_records_fall_back_to_the_single_broadcast():
    df = tables.load(FIXTURE)
    floors = tables.floor_table(df)
    assert set(floors["floor_method"]) == {tables.SINGLE}
    assert (floors["floor_single_p50_us"] == floors["floor_p50_us"]).all()
    timed = df[df["floor_p50_us"].notna()]
    assert (timed["vs_floor_single"] - timed["vs_floor"]).abs().max() < 1e-9
    assert "one raw broadcast* (single" not in markdown.results_markdown(df)
    assert "*floor* (reference: one broadcast)" in markdown.cost_markdown(df)


def test_text_names_the_method_and_keeps_the_single_broadcast(honest_sweep):
    df = tables.load(honest_sweep)
    results = markdown.results_markdown(df)
    assert "*floor*: fastest raw method" in results
    assert "fastest raw method: chunked into 2 (all " in results
    single = [line for line in results.splitlines() if line.startswith("| *one raw broadcast*")]
    # Per layout: in the p50 table, and as its ratio to the floor in the vs_floor table.
    ratios = [line for line in single if "×" in line]
    assert ratios and len(single) == 2 * len(ratios)
    assert all(f"{1 / CHUNKS_SHARE:.2f}×" in line for line in ratios)
    costs = markdown.cost_markdown(df)
    floor_rows = [line for line in costs.splitlines() if line.startswith("| *floor*")]
    assert floor_rows and all("reference: chunked into 2" in r for r in floor_rows)
    assert all(r.split("|")[2].strip() == "2" and "12 KiB" in r for r in floor_rows)


def _labels(fig) -> set[str]:
    return {line.get_label() for ax in fig.axes for line in ax.get_lines()}


@pytest.mark.parametrize("plot", ["plot_latency", "plot_overhead", "plot_algbw"])
def test_figures_draw_the_honest_floor_and_the_single_broadcast(honest_sweep, plot):
    fig = getattr(figures, plot)(tables.load(honest_sweep))
    labels = _labels(fig)
    assert any(label.startswith("floor") and "fastest raw method" in label for label in labels)
    assert any(label.startswith("one raw broadcast") for label in labels)
    old = _labels(getattr(figures, plot)(tables.load(FIXTURE)))
    assert not any(label.startswith("one raw broadcast") for label in old)


def test_report_renders_old_and_new_records(honest_sweep, tmp_path):
    for src in (FIXTURE, honest_sweep):
        root = tmp_path / src.name
        shutil.copytree(src, root)
        text = markdown.write_report(root).path.read_text()
        assert "fastest raw way" in text and "## Why each costs" in text
