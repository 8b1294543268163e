"""The Hydra-configured tools (``bcastbench run target=dispatch``, ``target=dispatch-emulated``,
``calibrate target=ray``, ``predict target=ray``, ``validate target=ray``, ``validate
target=emulated``): each shows its config with ``--cfg job``, refuses a bad value with one line
and exit 2 before anything starts, and the ones that need no world run for real here, writing
their record into the job's directory with the command that reruns it.

The Ray tool's real run is in tests/world/test_ray_world.py.
"""

from __future__ import annotations

import json
import shlex
import shutil

import pytest

from harness.commands import cli
from harness.paths import REPO

DISPATCH, EMULATED = "run target=dispatch", "run target=dispatch-emulated"
CALIBRATE, PREDICT, VALIDATE = "calibrate target=ray", "predict target=ray", "validate target=ray"
TABLE = "validate target=emulated"
TOOLS = (DISPATCH, EMULATED, CALIBRATE, PREDICT, VALIDATE, TABLE)
"""Each tool as typed after ``bcastbench``: ``tool.split()`` is its command line."""


@pytest.fixture
def nothing_starts(monkeypatch):
    """Every way these tools start a world, a cluster or a job, made to fail the test."""
    from harness.commands import emulated_table as table
    from harness.commands import ray_emulated as emulated
    from harness.worlds import opening

    def started(*args, **kwargs):
        raise AssertionError("a world, cluster or job started")

    monkeypatch.setattr(opening, "ray_world", started)
    monkeypatch.setattr(emulated, "cluster", started)
    monkeypatch.setattr(table, "run_jobs", started)


@pytest.mark.parametrize("tool", TOOLS)
def test_cfg_job_shows_the_config(tool, nothing_starts, capsys):
    assert cli.main([*tool.split(), "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    key = {CALIBRATE: "reps:", PREDICT: "task: example", VALIDATE: "task: validate"}
    assert key.get(tool, "payload:") in out, out


@pytest.mark.parametrize(
    "tool,argv,message",
    [
        (DISPATCH, ["modes=[leader:nope]"], "unknown strategy 'nope'"),
        (DISPATCH, ["-m", "payload.batch_size=4,0"], "payload.batch_size must be >= 1"),
        (DISPATCH, ["layout=nope"], "Could not find 'layout/nope'"),
        (DISPATCH, ["ray.dispatch=leader"], "modes= says what runs"),
        (DISPATCH, ["batch_size=4"], "Key 'batch_size' not in 'RayDispatchConf'"),
        (EMULATED, ["emulate.nodes=3"], "emulate.nodes=3 does not divide the world of 4"),
        (EMULATED, ["ray.address=auto"], "ray.address: set by target=dispatch-emulated"),
        (EMULATED, ["emulate.links=rails"], "emulate.links must be node or gpu"),
        (CALIBRATE, ["ranks=0"], "ranks must be >= 1"),
        (CALIBRATE, ["out=costs.txt"], "out must name a .yaml file"),
        (PREDICT, ["task=fit"], "task must be one of ['example', 'validate']"),
        (VALIDATE, [], "task=validate needs records=[FILE,...]"),
        (PREDICT, ["ray.put_call_us=-1"], "put_call_us must be finite and >= 0"),
        (TABLE, ["iters=0"], "iters must be >= 1"),
        (TABLE, ["source=/nonexistent"], "not a cluster table directory"),
    ],
)
def test_bad_value_is_one_line_and_exit_2(tool, argv, message, nothing_starts, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*tool.split(), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert err.startswith(f"bcastbench {tool}: error:") and "Traceback" not in err


def test_emulated_refuses_where_namespaces_cannot_be_made(monkeypatch, nothing_starts, capsys):
    from harness.commands import ray_emulated as emulated

    monkeypatch.setattr(emulated, "_namespaces_unavailable", lambda: "they need root")
    with pytest.raises(SystemExit) as exit_:
        cli.main(EMULATED.split())
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.endswith("cannot be built here: they need root"), err


def test_driver_overrides_compose_as_ray_dispatch():
    """What target=dispatch-emulated hands its driver is target=dispatch's config, value for
    value."""
    from harness.commands import ray_dispatch as dispatch
    from harness.commands import ray_emulated as emulated
    from harness.commands.hydra_app import compose

    dispatch.register()
    emulated.register()
    job = ["layout.order=tp-cp-ep-dp-pp", "modes=[leader:flat,all_ranks]", "+options.x=a b:c"]
    emu = compose("ray_emulated", job)
    driver = compose("ray_dispatch", emulated.driver_overrides(emu))
    for key in ("layout", "payload", "modes", "iters", "warmup", "options"):
        assert driver[key] == emu[key], key
    assert driver.options == {"x": "a b:c"}


def _json(path):
    return json.loads(path.read_text())


def test_ray_model_validate_and_example_record_their_command(tmp_path, monkeypatch):
    from harness.commands import ray_model as ray_dispatch

    (first, *_) = _json(REPO / "results" / "reference_ray" / "local.json")
    first["modes"] = {m: first["modes"][m] for m in ("leader:header", "all_ranks")}
    records = tmp_path / "one.json"
    records.write_text(json.dumps([first]))
    argv = [f"records=[{records}]"]
    assert cli.main([*VALIDATE.split(), *argv, f"hydra.run.dir={tmp_path / 'v'}"]) == 0
    out = _json(tmp_path / "v" / "ray_model_validate.json")
    assert [r["mode"] for r in out["rows"]] == ["leader:header", "all_ranks"]
    # The target's own task=validate is in the command that reruns it, as Hydra saw it.
    assert out["command"] == shlex.join(["bcastbench", *VALIDATE.split(), "task=validate", *argv])

    # The example's scan cut to two cells: the command's path, not the 32-cell pricing.
    scan = ray_dispatch.example_scan
    monkeypatch.setattr(
        ray_dispatch, "example_scan", lambda c, r: scan(c, r, dps=(1, 16), batches=(8,))
    )
    assert cli.main([*PREDICT.split(), "cluster=h200_ib", f"hydra.run.dir={tmp_path / 'e'}"]) == 0
    out = _json(tmp_path / "e" / "ray_model_example.json")
    assert [r["gpus"] for r in out["rows"]] == [128, 2048] and out["assumptions"]
    assert out["command"] == f"bcastbench {PREDICT} cluster=h200_ib"


def test_emulated_table_rereads_a_table_directory(tmp_path):
    source = tmp_path / "table"
    for links in ("node", "gpu"):
        (source / links).mkdir(parents=True)
        for name in ("result.json", "machine.json"):
            shutil.copy(REPO / "results" / "reference_emulated" / links / name, source / links)
    job = tmp_path / "job"
    assert cli.main([*TABLE.split(), f"source={source}", f"hydra.run.dir={job}"]) == 0
    assert "Verdict:" in (source / "report.md").read_text()
    out = _json(job / "emulated_table.json")
    assert {r["links"] for r in out["rows"]} == {"node", "gpu"}
    assert out["command"] == f"bcastbench {TABLE} source={source}"


def test_a_dispatch_job_whose_mode_is_refused_is_one_record_and_one_line():
    """A dispatch job is a JobSpec of the other scope: the one record builder writes it, and a
    refusal of the mode under test prints as the job's one line, not a table."""
    from harness.commands.ray_dispatch import format_table
    from harness.job.records import build
    from harness.job.results import Refusal
    from harness.job.spec import JobSpec
    from strategies.core.layout import Layout

    spec = JobSpec("tensordict_broadcast", Layout(dp=2, tp=2), dispatch="leader", world="ray")
    assert (spec.scope, spec.under_test, spec.baseline) == (
        "dispatch+broadcast", "leader:tensordict_broadcast", "leader:pickled"
    )  # fmt: skip
    assert [m.name for m in spec.dispatch_modes()] == [
        "leader:tensordict_broadcast", "leader:floor"
    ]  # fmt: skip
    record = build(spec, Refusal("leader:tensordict_broadcast: dp=2 replicas"))
    assert record["status"] == "unsupported" and record["mode"] == "leader:tensordict_broadcast"
    line = format_table(record)
    assert "UNSUPPORTED" in line and "dp=2 replicas" in line, line


def test_the_dispatch_report_skips_refused_jobs_and_keeps_varying_ones_apart(tmp_path):
    """A target=dispatch list may hold a job whose first mode was refused (no modes: nothing to
    draw); a sweep's result.json jobs merge by setting, a varying workload never with a
    constant one of the same largest shape."""
    from harness.report.dispatch_records import load_dispatch_records

    row = {"p50_us": 10.0}
    refused = {"scope": "dispatch+broadcast", "status": "unsupported", "modes": None}
    listed = {"scope": "dispatch+broadcast", "layout": "tp2pp2", "modes": {"all_ranks": row}}
    (tmp_path / "dispatch.json").write_text(json.dumps([refused, listed]))
    common = {"scope": "dispatch+broadcast", "status": "ok", "strategy": None,
              "layout": "tp2pp2dp2", "payload": "rl_rollout", "batch_size": 3,
              "seq_len": 64}  # fmt: skip
    jobs = [
        {**common, "modes": {"leader:header": row}},
        {**common, "modes": {"all_ranks": row}},
        {**common, "workload": "cycle:s64/s32 dp_split:3,1", "dp_split": [3, 1],
         "modes": {"all_ranks": row}},
    ]  # fmt: skip
    for k, job in enumerate(jobs):
        (tmp_path / str(k)).mkdir()
        (tmp_path / str(k) / "result.json").write_text(json.dumps(job))
    records = load_dispatch_records(tmp_path)
    assert records[0]["modes"] == {"all_ranks": row}  # the refused job is not there
    merged = {r.get("workload"): set(r["modes"]) for r in records[1:]}
    assert merged == {None: {"leader:header", "all_ranks"}, jobs[2]["workload"]: {"all_ranks"}}
