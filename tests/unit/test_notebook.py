"""The report and the analysis notebook on a small committed sweep (tests/fixtures/sweep):
``bcastbench report`` (``harness.commands.report.main``) writes report.md and every figure; the notebook runs headless."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from harness import report
from harness.commands import report as report_command

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "sweep"
NOTEBOOK = REPO / "notebooks" / "analysis.ipynb"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture()
def sweep(tmp_path: Path) -> Path:
    """A copy of the fixture sweep: the report writes beside the records, never into git."""
    dst = tmp_path / "sweep"
    shutil.copytree(FIXTURE, dst)
    return dst


def test_fixture_is_small_and_has_a_refused_record():
    files = list(FIXTURE.rglob("result.json"))
    assert 4 <= len(files) and sum(f.stat().st_size for f in files) < 200_000
    df = report.load(FIXTURE)
    assert (~df["supported"]).any(), "the fixture should show an n/a (unsupported) record"


def test_report_main_writes_report_and_figures(sweep: Path, capsys):
    assert report_command.main([str(sweep)]) == 0
    text = (sweep / "report.md").read_text()
    assert "## Recommendation" in text
    assert (
        "| layout | payload range (measured sizes) | recommended (lowest vs_floor; ≈ tied) |"
        in text
    )
    assert "## Why each costs what it costs" in text
    assert "collectives on the leader" in text and "bytes pickled on the leader" in text
    assert "python -m harness -m " in text  # the command that produced the sweep
    assert "same job" in text  # the same-run caveat
    # tensordict_broadcast refuses DP > 1: shown as n/a with its reason, not dropped.
    assert "| tensordict_broadcast | n/a | n/a |" in text
    assert "**tensordict_broadcast**: n/a here." in text
    for name in report.FIGURES.values():
        png = sweep / name
        assert png.exists(), name
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 20_000, name
        assert f"]({name})" in text


def test_recommendation_is_derived_from_the_records():
    df = report.load(FIXTURE)
    rec = report.recommendation(df)
    table = report.strategy_table(df)
    for row in rec.itertuples(index=False):
        at = table[
            (table.layout == row.layout)
            & (table.payload_bytes == row.payload_bytes)
            & table.supported
        ]
        assert row.winner == at.sort_values("vs_floor").iloc[0]["strategy"]
    assert set(rec["layout"]) == set(df["layout"])


def test_floor_is_the_median_over_jobs():
    df = report.load(FIXTURE)
    floors = report.floor_table(df)
    ok = df[df.supported]
    for row in floors.itertuples(index=False):
        jobs = ok[(ok.layout == row.layout) & (ok.payload_bytes == row.payload_bytes)]
        assert row.n_jobs == len(jobs)
        assert row.floor_p50_us == pytest.approx(jobs["floor_p50_us"].median())


def test_notebook_runs_headless_and_draws_figures(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("BCASTBENCH_RUN_DIR", str(FIXTURE))  # the kernel inherits it
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError naming the cell if any cell fails
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= len(report.PLOTS), f"{len(images)} figures drawn"
    text = "".join(str(o.get("data", {}).get("text/markdown", "")) for o in outputs)
    assert "recommended (lowest vs_floor; ≈ tied)" in text
    assert not [o for o in outputs if o.get("output_type") == "error"]


def test_runs_that_differ_in_any_setting_are_never_merged(sweep: Path):
    """Issue 11 5b: two jobs of one strategy at one layout and payload size that differ in
    backend, device, payload kind, order or world size are separate rows, not one median."""
    import json

    src = next(p for p in sweep.rglob("result.json") if json.loads(p.read_text())["supported"])
    base = json.loads(src.read_text())
    variants = {
        "backend": dict(backend="nccl", device="cuda"),
        "payload": dict(payload="pretrain"),
        "order": dict(order="tp-cp-ep-pp-dp"),
        "world": dict(world_size=base["world_size"] * 2, dp=base["dp"] * 2),
    }
    for i, (name, change) in enumerate(variants.items()):
        rec = {**base, **change, "p50_us": base["p50_us"] * (10 + i)}
        (sweep / f"variant_{name}").mkdir()
        (sweep / f"variant_{name}" / "result.json").write_text(json.dumps(rec))
    df = report.load(sweep)
    table = report.strategy_table(df)
    same = table[
        (table.strategy == base["strategy"]) & (table.payload_bytes == base["payload_bytes"])
    ]
    rows = same[same.layout.str.match(rf"{base['layout']}( |$)")]
    assert len(rows) == 1 + len(variants), rows[["layout", "p50_us"]]
    assert sorted(rows.p50_us) == pytest.approx(
        sorted([base["p50_us"]] + [base["p50_us"] * (10 + i) for i in range(len(variants))])
    )
    assert (rows.n_jobs == 1).all()
    labels = " ".join(rows.layout)
    for word in ("backend=nccl", "payload=pretrain", "order=tp-cp-ep-pp-dp"):
        assert word in labels
    # The report still builds, one panel and one results table per setting.
    assert report_command.main([str(sweep)]) == 0
    assert "backend=nccl" in (sweep / "report.md").read_text()


def test_caveat_is_built_from_the_records():
    df = report.load(FIXTURE)
    text = report.caveat(df)
    assert f"host {df.hostname.iloc[0]}" in text and "backend gloo" in text
    assert "this machine" not in text and "2 cores" not in text
    gpu = df.assign(device="cuda", backend="nccl", hostname="gpu-node", cpu_count=64)
    text = report.caveat(gpu)
    assert "host gpu-node (64 cores)" in text and "CPU process" not in text


def test_split_modules_and_the_lazy_package_agree():
    from harness.report import figures, markdown, tables

    assert report.plot_latency is figures.plot_latency
    assert report.write_report is markdown.write_report
    assert report.strategy_table is tables.strategy_table
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        report.nope  # noqa: B018
