"""Tier-1 tests of the prediction tools (no process group): harness.commands.predict (Hydra app, scaled
payload specs, one-replica pricing), harness.commands.validate on a small recorded sweep, and
harness.commands.extrapolate on a couple of world sizes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.commands.predict import EXAMPLE, run, scaled_spec
from harness.model.prices import predict_all, price_strategy, replicas_independent
from harness.payload import generated
from strategies import Unsupported, get_class, has_plan, names
from strategies.core.cluster import load_cluster
from strategies.core.layout import Layout
from strategies.core.plan import plan_of, spec_of
from strategies.core.pricing import price

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "model_sweep"


def compose(overrides: list[str]):
    from harness.commands.predict import composed

    return composed(overrides)


# -- the app ---------------------------------------------------------------------------------
def test_example_command_names_a_winner(capsys):
    # Its speed (under a second per layout) is measured by tests/benchmarks, not asserted here.
    record = run(compose(EXAMPLE))
    out = capsys.readouterr().out
    assert record["world_size"] == 16384
    assert record["winner"] in names()
    assert f"winner: {record['winner']}" in out
    assert "dominated by" in record["why"]
    assert record["strategies"]["tensordict_broadcast"]["supported"] is False  # DP > 1
    assert record["strategies"]["floor"]["supported"] is True
    json.dumps(record)  # what prediction.json holds must serialise


def test_compose_two_layouts_as_a_multirun_would():
    winners = {}
    for dp in (8, 64):
        cfg = compose([*EXAMPLE[:1], f"layout.dp={dp}", *EXAMPLE[2:], "quiet=true"])
        assert cfg.cluster.name == "h200_ib" and cfg.layout.dp == dp
        record = run(cfg)
        assert record["world_size"] == dp * 8 * 8 * 2
        winners[dp] = record["winner"]
    assert all(winners.values())


def test_multirun_writes_one_prediction_per_job(tmp_path):
    cmd = [
        sys.executable, "-m", "harness.commands.predict", "-m", "layout.dp=1,2", "layout.tp=2",
        "layout.pp=2", "payload.batch_size=4", "payload.seq_len=64", "quiet=true",
        f"hydra.sweep.dir={tmp_path}",
    ]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    found = sorted(tmp_path.rglob("prediction.json"))
    assert len(found) == 2
    assert {json.loads(p.read_text())["layout"]["dp"] for p in found} == {1, 2}
    assert not list(tmp_path.rglob("*.tmp"))


# -- specs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rl_rollout", "pretrain", "multimodal"])
def test_scaled_spec_matches_the_real_batch(name):
    b, s = 200, 128
    fast, real = scaled_spec(name, b, s), spec_of(generated.make(name, b, s, 0))
    for field in ("tensor_bytes", "n_tensors", "header_bytes", "dtype_bytes", "leaf_bytes"):
        assert getattr(fast, field) == getattr(real, field), field
    assert fast.broadcast_non_tensor == real.broadcast_non_tensor
    assert fast.pickle_bytes == pytest.approx(real.pickle_bytes, rel=0.01)
    # Prompt texts have random lengths: the per-sample mean from 64 samples is within a few %.
    assert fast.non_tensor_bytes == pytest.approx(real.non_tensor_bytes, rel=0.06)
    assert not fast.pickle_exact


def test_scaled_spec_small_batch_is_exact():
    assert scaled_spec("rl_rollout", 8, 64) == spec_of(generated.make("rl_rollout", 8, 64, 0))


# -- one-replica pricing is exact --------------------------------------------------------------
@pytest.mark.parametrize(
    "cluster,layout",
    [
        ("h200_ib", Layout(dp=4, pp=2, tp=8)),
        ("h200_ib", Layout(dp=4, pp=4, tp=4, cp=2)),
        ("h200_ib", Layout(dp=3, pp=2, tp=8, order="tp-cp-ep-pp-dp")),
        ("h200_ib", Layout(dp=4, pp=2, tp=2)),  # replicas share nodes: full pricing
        ("emulated", Layout(dp=2, pp=2, tp=2)),
    ],
)
def test_one_replica_pricing_equals_full_pricing(cluster, layout):
    c = load_cluster(cluster)
    spec = scaled_spec("rl_rollout", 16, 256)
    # A strategy without a plan (one a user installed) is measured, not priced.
    for name in [*filter(has_plan, names()), "floor"]:
        try:
            full = price(plan_of(get_class(name), layout, spec, c.device), c, layout)
        except Unsupported:
            with pytest.raises(Unsupported):
                price_strategy(name, layout, spec, c)
            continue
        fast = price_strategy(name, layout, spec, c)
        assert fast.total_s == pytest.approx(full.total_s, rel=1e-12), name
        assert [s.n_comms for s in fast.steps] == [s.n_comms for s in full.steps]
    assert replicas_independent(Layout(dp=4, pp=2, tp=8), 8)
    assert not replicas_independent(Layout(dp=4, pp=2, tp=2), 8)


def test_a_gpu_cluster_prices_shm_with_its_staging_copies():
    """h200_ib's ranks hold their batch on the GPU (``ClusterConf.device``): shm is priced
    staged through host memory (one D2H on the leader, one H2D per receiver), as it runs there,
    so over NVLink a collective beats it and auto would not pick it; on the local CPU preset
    the same plan carries no copy."""
    from harness.model.prices import auto_pick

    h200, local = load_cluster("h200_ib"), load_cluster("local")
    assert (h200.device, local.device) == ("cuda", "cpu")
    layout = Layout(tp=8)
    spec = scaled_spec("rl_rollout", 512, 4096)
    preds = predict_all(layout, spec, h200)
    leader = {w.role: w for w in preds["shm"].local}["leader"]
    assert leader.d2h_s > 0
    assert auto_pick(preds) != "shm"
    local_leader = {w.role: w for w in price_strategy("shm", layout, spec, local).local}
    assert local_leader["leader"].d2h_s == 0


def test_lazy_fetch_is_priced_for_the_fields_of_the_jobs_payload(capsys):
    from harness.commands.predict import main

    label = "mooncake[fields=input_ids+old_log_probs]"
    assert main(["payload=rl_rollout", f'strategies=[mooncake,"{label}"]']) == 0
    out = capsys.readouterr().out
    whole = float(out.split("\nmooncake ")[1].split()[0])
    some = float(out.split(f"\n{label} ")[1].split()[0])
    assert some < whole, out


def test_predict_prices_the_pull_strategy_and_every_pickled_serialization():
    """independent_fetch is shm's hand-off plus each reader's fetch from the node store; pickled's
    out-of-band serializations pickle only the non-tensor part (cheaper than ROLL's torch.save
    archive), and verl's receivers copy each tensor that vLLM's view. None is an auto
    candidate, so auto still picks among its own."""
    from harness.model.prices import auto_pick, option_label, parse_label
    from strategies.auto import CANDIDATES
    from strategies.core.costs import Prediction

    layout, spec = Layout(tp=2, pp=2), scaled_spec("rl_rollout", 128, 512)
    preds = predict_all(layout, spec, load_cluster("local"))
    p5, verl = "pickled_pickle5", "pickled_verl_numpy"
    assert all(isinstance(preds[k], Prediction) for k in ("independent_fetch", p5, verl))
    assert preds["shm"].total_s < preds["independent_fetch"].total_s
    fetch = {w.role: w for w in preds["independent_fetch"].local}["receiver"]
    assert fetch.store_s > {w.role: w for w in preds["shm"].local}["receiver"].store_s == 0
    assert preds[p5].total_s < preds["pickled"].total_s
    assert preds[p5].total_s < preds[verl].total_s
    assert auto_pick(preds) in CANDIDATES
    # A name with options is priced under its label: the option's plan, not the default's.
    label = "pickled[serialization=verl_numpy]"
    assert parse_label(label) == ("pickled", {"serialization": "verl_numpy"})
    assert option_label(*parse_label(label)) == label
    asked = predict_all(layout, spec, load_cluster("local"), [label, "independent_fetch"])
    assert sorted(asked) == ["floor", "independent_fetch", label]
    assert asked[label].total_s == preds[verl].total_s
    record = run(compose(["layout=tp2", "cluster=local", f'strategies=["{label}"]', "quiet=true"]))
    assert record["winner"] == label


def test_validate_prices_the_floor_method_that_won():
    """A record's measured floor is its fastest raw method (``floor_method``); validate prices
    that method, not always one broadcast (a node-local shm floor has no collective at all)."""
    from harness.commands.validate import floor_plan

    layout = Layout(tp=2, pp=2)
    spec = spec_of(generated.make("rl_rollout", 128, 512, seed=0))
    assert len(floor_plan(layout, spec, "one").comms) == 1
    assert len(floor_plan(layout, spec, "chunks4").comms) == 4
    shm = floor_plan(layout, spec, "shm")
    assert shm.comms == [] and [h.ranks for h in shm.shared] == [(0, 1, 2, 3)]
    for unknown in (None, float("nan"), "leader:floor"):  # older or dispatch records
        assert len(floor_plan(layout, spec, unknown).comms) == 1


def test_predict_all_marks_unsupported():
    preds = predict_all(
        Layout(dp=2, pp=2, tp=2), scaled_spec("pretrain", 4, 64), load_cluster("local")
    )
    assert isinstance(preds["tensordict_broadcast"], str)
    assert preds["tensordict_broadcast"].startswith("n/a")


# -- validate_model --------------------------------------------------------------------------
def test_validate_model_on_fixture(tmp_path):
    from harness.commands.validate import validate

    sweep = tmp_path / "sweep"
    shutil.copytree(FIXTURE, sweep)
    out = validate(sweep, "local", quiet=True)
    m, table, ranks = out["metrics"], out["table"], out["rankings"]
    assert m["records"] == len(table) == 12
    assert m["points"] == len(ranks) == 3  # tp2pp2 B=3, B=768; tp2pp2dp2 B=32
    for key in ("median_abs_err", "median_abs_err_no_oversub", "floor_median_abs_err"):
        assert 0 <= m[key] < 10
    assert 0 <= m["agreement"] <= m["agreement_or_tie"] <= 1
    # The dp=2 world (8 ranks) is twice the calibration world (4 ranks, 2 cores): factor 2,
    # applied by pricing.price itself; the table also carries the model without it.
    assert set(table.oversub_factor) == {1.0, 2.0}
    assert (table.predicted_us == table.predicted_no_oversub_us * table.oversub_factor).all()
    assert all(ranks.why[~ranks.agree].str.len() > 0)
    # A tie is a disagreement whose two predictions lie inside the records' p90/p50 spread.
    assert (ranks.tie == (~ranks.agree & (ranks.model_gap <= ranks.noise))).all()
    for suffix in ("csv", "md", "png"):
        assert (sweep / f"model_validation.{suffix}").stat().st_size > 0
    md = (sweep / "model_validation.md").read_text()
    assert "median" in md and "gloo" in md
    assert "tie-aware" in md and "strict" in md


# -- extrapolate -----------------------------------------------------------------------------
def test_extrapolate_small(tmp_path):
    from harness.commands.extrapolate import run as extrapolate

    out = extrapolate("h200_ib", tmp_path, batch_size=64, seq_len=1024, pps=(1, 2),
                      max_world=32, quiet=True)  # fmt: skip
    df = out["table"]
    assert set(df.world_size) == {8, 16, 32}
    assert set(df.pp) == {1, 2}
    assert len(out["sentences"]) == 2
    md = (tmp_path / "extrapolation.md").read_text()
    assert "PREDICTED" in md and "scatter_allgather" in md
    assert (tmp_path / "extrapolation.png").stat().st_size > 0


# -- bad values: one line, exit 2 --------------------------------------------------------------
@pytest.mark.parametrize(
    "module,argv,message",
    [
        ("predict", ["layout.dp=0"], "layout.dp must be a positive integer"),
        ("predict", ["cluster=nope"], "valid: emulated, emulated_rails, h200_ib, local"),
        ("predict", ["-m", "layout.dp=1,0"], "layout.dp must be a positive integer"),
        ("predict", ["cluster.intra.alpha_us=-1"], "intra.alpha_us must be finite and >= 0"),
        ("predict", ["strategies=[bogus]"], "strategies: unknown ['bogus']"),
        (
            "predict",
            ['strategies=["pickled[serialization=zzz]"]'],
            "option 'serialization' must be one of 'roll', 'dataclass', 'pickle5', 'verl_numpy'",
        ),
        ("predict", ['strategies=["pickled[oops]"]'], "is not name[key=value,...]"),
        (
            "predict",
            ['strategies=["shm[views=false]"]'],
            "option 'views' changes nothing the model prices; shm's plan prices ['stage', ",
        ),
        ("predict", ['strategies=["shm[bogus=1]"]'], "strategy 'shm' has no option 'bogus'"),
        (
            "predict",
            ["payload=rl_rollout", 'strategies=["nixl[fields=input_ids+tokens]"]'],
            "fields ['tokens'] are not in the batch; its fields: ['prompts', 'responses',",
        ),
        ("calibrate", ["world=1"], "world must be >= 2"),
        ("calibrate", ["reps=x"], "reps=x"),
        ("extrapolate", ["max_world=4"], "max_world must be >= 8"),
        ("extrapolate", ["cluster.nics_per_node=0"], "nics_per_node must be a positive integer"),
        ("extrapolate", ["payload.batch_size=0"], "payload.batch_size must be positive"),
    ],
)
def test_bad_value_prints_one_line_and_exits_2(module, argv, message, capsys):
    import importlib

    main = importlib.import_module(f"harness.commands.{module}").main
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert "Traceback" not in err


def test_cluster_table_bad_value_exits_2(tmp_path, capsys):
    from harness.commands.emulated_table import main

    for argv, message in (
        ([f"source={tmp_path}"], "not a cluster table directory"),
        ([f"source={tmp_path}", "iters=0"], "iters must be >= 1"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and message in err[0], err


def test_model_modules_import_from_their_homes():
    from harness import paths
    from strategies.core import cluster, formulas, pricing

    assert cluster.ClusterError is formulas.ClusterError
    assert cluster.CONF_DIR == paths.CONF_DIR / "cluster"  # the presets auto reads, the harness's
    assert pricing.price.__module__ == "strategies.core.pricing"
    assert callable(formulas.coefficients) and callable(cluster.load_cluster)
    for module in ("predict", "calibrate", "extrapolate", "validate"):
        import importlib

        assert callable(importlib.import_module(f"harness.commands.{module}").main)


def test_extrapolate_is_a_hydra_app(tmp_path):
    from harness.commands.extrapolate import main, pipeline_depths

    assert pipeline_depths(8) == (1, 2, 4, 8) and pipeline_depths(6) == (1, 2, 4, 6)
    argv = ["layout.tp=8", "layout.pp=2", "payload.batch_size=64", "payload.seq_len=1024",
            "max_world=16", "quiet=true", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    assert main(argv) == 0
    assert {p.name for p in tmp_path.iterdir()} >= {
        "extrapolation.csv",
        "extrapolation.md",
        "extrapolation.png",
    }


def test_a_host_memory_that_is_no_size_is_refused_in_one_line():
    from harness.commands.predict import check
    from harness.errors import ConfigError

    for bad in ("0", "-5"):
        with pytest.raises(ConfigError, match="host_memory_bytes must be a positive number"):
            check(compose([f"host_memory_bytes={bad}"]))
    check(compose(["host_memory_bytes=1099511627776"]))
