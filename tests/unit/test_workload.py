"""Workloads that change per call, before any process starts: the period a config builds, the
seeded splits, the one-line refusals, and the record's and report's per-shape view of a
summary (no process group)."""

from __future__ import annotations

import pandas as pd
import pytest
from cli_support import cfg_of

from harness.errors import ConfigError
from harness.job.config import validate, workload_of
from harness.job.record_fields import FIELDS, complete, type_problems
from harness.job.records import build, vs_floor
from harness.job.results import RankResult
from harness.job.spec import JobSpec
from harness.job.summary import summarize
from harness.payload.workload import CallShape, WorkloadError, drawn_rows
from harness.payload.workload import build as build_workload
from harness.report.tables import shapes_table
from strategies.core.layout import Layout


def _workload(*overrides):
    cfg = cfg_of(*overrides)
    return workload_of(cfg, validate(cfg), int(cfg.payload.seq_len))


def test_cycle_alternates_its_entries_over_the_base_payload():
    w = _workload("payload.cycle=[{batch_size:768},{batch_size:3,seq_len:64}]")
    assert w.label == "cycle:b768/b3s64" and w.dp_split is None
    assert w.period == (CallShape((768,), 1024), CallShape((3,), 64))


def test_constant_config_is_not_varying():
    w = _workload()
    assert not w.varying and w.period == (CallShape((8,), 1024),)


def test_dp_split_list_and_drawn_on_two_replicas():
    w = _workload("layout=tp2pp2dp2", "payload.dp_split=[5,3]")
    assert w.period == (CallShape((5, 3), 1024),) and w.label == "dp_split:5+3"
    drawn = _workload("layout=tp2pp2dp2", "payload.dp_split=drawn", "payload.draws=4")
    assert [sum(s.rows) for s in drawn.period] == [16] * 4
    assert all(min(s.rows) >= 1 for s in drawn.period)
    assert (
        drawn.period
        == _workload("layout=tp2pp2dp2", "payload.dp_split=drawn", "payload.draws=4").period
    )  # seeded: the same on every rank and every run


def test_drawn_rows_always_cover_the_total():
    for draw in range(50):
        rows = drawn_rows(9, 3, seed=1, draw=draw)
        assert sum(rows) == 9 and min(rows) >= 1 and len(rows) == 3


def test_cycle_file_is_read_as_a_list_of_shapes(tmp_path):
    path = tmp_path / "step_shapes.yaml"
    path.write_text("- {batch_size: 12}\n- {batch_size: 2, seq_len: 128}\n")
    w = _workload(f"payload.cycle_file={path}")
    assert w.label == "cycle_file:step_shapes"
    assert [s.rows for s in w.period] == [(12,), (2,)]
    path.write_text("batch_size: 3\n")
    with pytest.raises(ConfigError, match="expected a YAML list of shapes"):
        _workload(f"payload.cycle_file={path}")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["payload.cycle=[]"], "payload.cycle is empty; expected a non-empty list"),
        (["payload.cycle=[{batch:3}]"], "payload.cycle[0]: unknown key(s) ['batch']; valid keys"),
        (["payload.cycle=[{batch_size:0}]"], "payload.cycle[0].batch_size must be a positive"),
        (
            ["layout=tp2pp2dp2", "payload.dp_split=[1,2,3]"],
            "payload.dp_split has 3 row counts [1, 2, 3] but the layout has dp=2 replicas",
        ),
        (["payload.dp_split=drawn"], "needs more than one replica"),
        (["layout=tp2pp2dp2", "payload.dp_split=drawn"], "needs payload.draws >= 1"),
        (["payload.cycle=[{seq_len:33}]"], "seq_len=33 is not divisible by 2·cp = 2"),
        (
            ["payload=schema", "payload.path=rl_rollout", "payload.cycle=[{seq_len:64}]"],
            "a recorded payload fixes seq_len",
        ),
        (["payload.cycle=[{batch_size:2}]", "payload.cycle_file=x.yaml"], "give one of them"),
    ],
)
def test_bad_workloads_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(cfg_of(*overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_workload_error_is_a_value_error():
    with pytest.raises(WorkloadError):
        build_workload({"batch_size": 1, "cycle": [{}], "draws": -1}, 1, 8, recorded=False)


def _rank_result(rank: int, leader: bool, times: dict, steady: dict | None) -> RankResult:
    names = list(times)
    return RankResult(
        rank=rank,
        is_leader=leader,
        times_s=times,
        steady_s=steady,
        collectives={n: [] for n in names},
        collectives_unavailable=dict.fromkeys(names),
        work={n: {} for n in names},
        peak_rss_bytes=dict.fromkeys(names, 1),
        peak_rss_delta_bytes=dict.fromkeys(names, 0),
        peak_cuda_bytes=dict.fromkeys(names, 0),
        problems={n: [] for n in names},
        payload_bytes=1000 if leader else None,
        shape_bytes=[1000, 10] if leader else None,
        device="cpu",
    )


def test_summary_and_record_list_every_shape_with_its_own_floor_and_steady_state():
    layout = Layout(pp=2)
    work = build_workload(
        {"batch_size": 8, "cycle": [{"batch_size": 8}, {"batch_size": 1}]}, 1, 16, False
    )
    spec = JobSpec("header", layout, seq_len=16, iters=4, warmup=1, workload=work, steady_iters=2)
    # warm-up 1: timed iterations move shapes 1, 0, 1, 0.
    times = {"header": [0.002, 0.010, 0.004, 0.010], "floor": [0.001, 0.005, 0.001, 0.005]}
    steady = {"header": [[0.010, 0.010], [0.001, 0.001]], "floor": [[0.005] * 2, [0.001] * 2]}
    results = [_rank_result(r, r == 0, times, steady) for r in range(2)]
    record = complete(build(spec, summarize(spec, results)))
    assert record["workload"] == "cycle:b8/b1" and record["batch_size"] == 8
    assert type_problems(record) == []
    assert record["payload_bytes"] == 505  # the mean per call of 1000 and 10 bytes
    large, small = record["shapes"]
    assert (large["batch_size"], large["calls"], large["payload_bytes"]) == (8, 2, 1000)
    assert large["p50_us"] == pytest.approx(10_000) and large["vs_floor"] == pytest.approx(2)
    assert small["p50_us"] == pytest.approx(3_000) and small["floor_p50_us"] == pytest.approx(1e3)
    assert small["steady_p50_us"] == pytest.approx(1_000) and small["vs_steady"] == pytest.approx(3)
    rows = shapes_table(pd.DataFrame([{**record, "layout": "pp2"}]))
    assert list(rows["batch_size"]) == [8, 1] and list(rows["workload"]) == ["cycle:b8/b1"] * 2


def test_constant_record_keeps_its_shape():
    spec = JobSpec("header", Layout(pp=2), seq_len=16, iters=2, warmup=0)
    times = {"header": [0.002, 0.002], "floor": [0.001, 0.001]}
    results = [_rank_result(r, r == 0, times, None) for r in range(2)]
    record = complete(build(spec, summarize(spec, results)))
    assert record["shapes"] is None and record["workload"] is None and record["dp_split"] is None
    assert list(record)[: len(FIELDS)] == list(FIELDS)
    assert type_problems(record) == []
    assert record["vs_floor"] == pytest.approx(2) == vs_floor(2.0, 1.0)
    assert vs_floor(2.0, None) is None
