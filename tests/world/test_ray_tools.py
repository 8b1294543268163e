"""``bcastbench ray-dispatch`` for real on a 2-rank local Ray world: a two-job sweep, both jobs
on one world (the second starts nothing), each record verified, written to its job directory,
the sweep's list and ``out``, with the command that reruns that job. Skipped without ray.
"""

from __future__ import annotations

import json
import shlex

import pytest

ray = pytest.importorskip("ray", reason='ray is an optional extra: pip install "ray==2.60.0"')
pytestmark = pytest.mark.ray  # a private Ray cluster per test: make test runs these apart
if not hasattr(ray, "init"):  # tests/verl_support.py registers a bare stand-in without Ray
    pytest.skip(
        'only a test stand-in for ray is loaded: pip install "ray==2.60.0"', allow_module_level=True
    )


def _values(overrides: list[str]) -> dict:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(overrides)}


def test_ray_dispatch_sweep_shares_one_world(tmp_path):
    from harness.commands import cli
    from harness.run import launch

    job = ["layout=tp2pp2", "layout.pp=1", "payload.seq_len=64", "iters=2", "warmup=1"]
    job += ["modes=[leader:header,all_ranks]", "ray.object_store_mb=128"]
    out = tmp_path / "all.json"
    argv = ["-m", *job, "payload.batch_size=2,4", f"out={out}", f"hydra.sweep.dir={tmp_path}"]
    try:
        assert cli.main(["ray-dispatch", *argv]) == 0
    finally:
        launch.close_ray()
    records = json.loads(out.read_text())
    assert json.loads((tmp_path / "dispatch.json").read_text()) == records  # the sweep's list
    assert [r["batch_size"] for r in records] == [2, 4]
    for rec, path in zip(records, sorted(tmp_path.glob("*/dispatch.json"))):
        assert json.loads(path.read_text()) == [rec]
        assert rec["correct"] and rec["world_size"] == 2
        assert set(rec["modes"]) == {"leader:header", "all_ranks", "leader:floor", "all_ranks:raw"}
        # Hydra writes a sweep job's values in its own escaped form (leader\:header): they
        # parse back to this job's values.
        this_job = [*job, f"payload.batch_size={rec['batch_size']}", f"out={out}"]
        assert _values(shlex.split(rec["command"])[2:]) == _values(this_job), rec["command"]
    first, second = (r["world_start_s"] for r in records)
    assert first > 0 and second == 0.0, "the sweep's second job must reuse the first's world"
