"""Job configuration before any process starts: presets compose, bad values are refused
with the arithmetic, and the CLI says so and exits."""

from __future__ import annotations

import math
import sys

import pytest
from cli_support import REPO, cfg_of
from omegaconf import open_dict

from harness.errors import ConfigError
from harness.job.config import validate
from harness.payload import generated, sizes


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["layout.tp=3"],
            "seq_len=1024 is not divisible",
        ),  # passes layout, fails nothing? see below
        (["payload.seq_len=30", "layout=tp2cp2"], "not divisible by 2·cp = 4"),
        (["strategy.name=nope"], "unknown strategy 'nope'; valid names"),
        # strategy=custom says what it needs, not that 'custom' is unknown.
        (["strategy=custom"], "strategy=custom needs strategy._target_=<package.module.Class>"),
        (["payload.name=nope"], "unknown payload 'nope'"),
        (["payload.batch_size=0"], "payload.batch_size must be positive"),
        (["layout.pp=0"], "layout.pp must be a positive integer"),
        (["references=[floor,nope]"], "unknown reference strategy 'nope'"),
        (["fault.kind=explode"], "fault.kind must be one of crash, hang, raise, delay"),
        (["repeats=0"], "repeats must be >= 1"),
        (
            ["fault.kind=delay", "fault.rank=9", "fault.delay_us=100"],
            "fault.rank=9 is not a rank of the world of 4; valid: -1 (no fault) or 0..3",
        ),
        (["fault.kind=delay", "fault.rank=1"], "fault.delay_us must be >= 1"),
        (
            ["fault.kind=delay", "fault.delay_us=2000"],
            "fault.kind=delay delays no rank while fault.rank=-1 (no fault); name the rank whose "
            "calls take 2000 us longer: fault.rank=0..3",
        ),
        (["layout.order=tp-pp-xx"], "unknown axes ['xx']"),
        # A size claim no machine can hold is priced from the shapes, never allocated.
        (["payload.batch_size=1000000000000"], "takes 47424000000000000 bytes (42 PiB)"),
        (["payload.seq_len=10000000000"], "of 8 rows × 10000000000 tokens takes"),
        (
            ["payload.cycle=[{batch_size:2},{batch_size:99999999999}]"],
            "in its 2 shapes together (all built before the first call; the largest 99999999999 rows",
        ),
        # Each shape fits, the two together do not: a leader builds both before its first call.
        (
            [
                "payload.max_bytes=120000",
                "payload.batch_size=2",
                "payload.cycle=[{seq_len:1024},{seq_len:512}]",
            ],
            "takes 142592 bytes (139 KiB) on replica 0's leader > payload.max_bytes = 120000",
        ),
        (["payload.max_bytes=1000", "payload.batch_size=2"], "> payload.max_bytes = 1000"),
        # Each leader's two shapes fit; a dispatch job's driver builds every replica's rows of
        # both, and the floor's flat copy of each, before its first call.
        (
            [
                "ray_job=leader_header",
                "layout=tp2pp2dp2",
                "payload.max_bytes=300000",
                "payload.batch_size=2",
                "payload.cycle=[{seq_len:1024},{seq_len:512}]",
            ],
            "in its 2 shapes together (all built before the first call; the largest 4 rows "
            "× 1024 tokens) takes 570368 bytes (557 KiB) on the driver (every global batch",
        ),
        (["payload.max_bytes=0"], "payload.max_bytes must be a positive integer or null"),
    ],
)
def test_validation_errors(overrides, message):
    cfg = cfg_of(*overrides)
    if overrides == ["layout.tp=3"]:
        # A layout that is valid on its own but not for the world it is given.
        with pytest.raises(
            ConfigError, match=r"dp\(1\) \* pp\(2\) \* tp\(3\) \* cp\(1\) = 6 != WORLD_SIZE\(4\)"
        ):
            validate(cfg, world_size=4)
        return
    with pytest.raises(
        ConfigError,
        match=message.replace("(", r"\(")
        .replace(")", r"\)")
        .replace("[", r"\[")
        .replace("]", r"\]"),
    ):
        validate(cfg)


def test_presets_compose():
    for name, world in {"tp2pp2": 4, "tp2cp2": 4, "pp4": 4, "tp2pp2dp2": 8, "seed_3d": 8}.items():
        layout = validate(cfg_of(f"layout={name}"))
        assert layout.world_size == world
    seed = validate(cfg_of("layout=seed_3d"))
    assert seed.groups("pp")[:2] == [[0, 2], [1, 3]]  # the seed document's PP groups


@pytest.mark.parametrize(
    "argv, says",
    [
        # A value the job's validation refuses, with the arithmetic and what would be valid.
        (
            ["strategy=header", "layout=tp2cp2", "payload.seq_len=510"],
            "payload.seq_len=510 is not divisible by 2·cp = 4",
        ),
        # Hydra's own missing-option error, with the options.
        (["strategy=nope"], "Could not find 'strategy/nope'; valid: "),
        # A value of the wrong type, naming the field.
        (["payload.batch_size=x"], "payload.batch_size=x"),
        (["strategy.name=nope"], "unknown strategy 'nope'; valid names"),
        # strategy=custom says what it needs, not that 'custom' is unknown.
        (["strategy=custom"], "strategy=custom needs strategy._target_=<package.module.Class>"),
        # A key the schema lacks, with the keys its node has.
        (["layout.tq=2"], "valid keys: dp, pp, tp, cp, order"),
        (["strategy=ray_object_store"], "runs only on world=ray (this job: world=forked)"),
    ],
)
def test_cli_bad_config_is_one_line_and_exit_2(argv, says, tmp_path, capsys, monkeypatch):
    """In process (the subprocess test below checks the real command once)."""
    from harness.commands import cli

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    run_dir = tmp_path / "run"
    assert cli.main([*argv, f"hydra.run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert "floor" not in err.partition("valid names")[2].partition("]")[0]
    assert not run_dir.exists(), "a refused run left its folder behind"


def test_sweep_is_validated_before_its_first_job(tmp_path, capsys, monkeypatch):
    """The third combination is invalid: the sweep starts no job and writes nothing."""
    from harness.commands import cli

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    sweep = tmp_path / "sweep"
    argv = ["-m", "layout=tp2cp2", "payload.seq_len=64,128,30", f"hydra.sweep.dir={sweep}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "job 3 of 3 (layout=tp2cp2 payload.seq_len=30)" in err, err
    assert "no job was started" in err and len(err.splitlines()) == 1
    assert not sweep.exists()


def test_named_sweeps_time_every_selectable_strategy_in_one_job_per_cell():
    """conf/sweep/bench.yaml times every selectable strategy (strategies.names(), no list to
    keep up to date) side by side in one job per cell (layout × size, layouts outermost), each
    with a record of its own, repeated; one layout gives every rank a core of a 2-core host."""
    import strategies
    from harness.job.sweep_plan import sweep_jobs

    jobs = sweep_jobs(["sweep=bench"])
    assert len(jobs) == 4 * 4
    assert [j[0] for j in jobs[::4]] == [
        "layout=tp2", "layout=tp2pp2", "layout=tp2cp2", "layout=tp2pp2dp2",
    ]  # fmt: skip
    assert len(sweep_jobs(["sweep=bench_quick"])) == 2 * 2
    bench = cfg_of("sweep=bench")
    assert set(bench.references) == {"floor", *strategies.names_for_world()} and bench.record_each
    assert (bench.iters, bench.warmup, bench.payload.seq_len) == (6, 2, 512)
    assert bench.repeats >= 3 and bench.iters * bench.repeats >= 18
    # A slow strategy takes what its budget pays for, never fewer rounds than an interval needs.
    assert bench.time_budget_s is not None and bench.time_budget_s > 0
    assert cfg_of("sweep=bench", "layout=tp2").layout.tp * 1 == 2


def test_the_real_step_sweep_is_a_varying_workload_on_uneven_replicas():
    """conf/sweep/real_step.yaml: every selectable strategy on tp2pp2dp2, each call padded to
    its own seq_len and the two replicas handed a drawn, uneven split of the rows."""
    import strategies
    from harness.job.sweep_plan import check_sweep, sweep_jobs

    assert {j[1] for j in sweep_jobs(["sweep=real_step"])} == {
        f"strategy={n}" for n in strategies.names_for_world()
    }
    assert len(check_sweep(["sweep=real_step"], lambda: validate)) == len(
        strategies.names_for_world()
    )
    step = cfg_of("sweep=real_step", "layout=tp2pp2dp2")
    assert step.payload.dp_split == "drawn" and step.payload.draws >= 1
    assert len({entry["seq_len"] for entry in step.payload.cycle}) > 1


def test_cli_exits_2_with_one_line_and_no_traceback(tmp_path, capsys, monkeypatch):
    """In process, as ``python -m harness`` runs it (a separate process would spend its time
    importing torch before it gets to the config; the process's exit status is the
    return value, and the sweep-directory test checks it on a real process)."""
    from harness.commands import cli

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the command sets it; restored after
    status = cli.main(
        ["strategy=header", "layout=tp2cp2", "payload.seq_len=511", f"hydra.run.dir={tmp_path}"]
    )
    stderr = capsys.readouterr().err
    assert status == 2
    assert "Traceback" not in stderr and "Error executing job" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "payload.seq_len=511 is not divisible by 2·cp = 4" in lines[0]
    assert "valid: a multiple of 4, e.g. 508 or 512" in lines[0]
    assert not (tmp_path / "result.json").exists()


def test_run_folders_are_named_by_the_shape_that_runs():
    from omegaconf import OmegaConf

    from harness.job.config_schema import shape_name

    assert shape_name(cfg_of("layout=tp2pp2", "layout.tp=8", "layout.pp=8").layout) == "tp8pp8"
    assert shape_name(OmegaConf.create({"tp": 0})) == "invalid-layout"
    config = (REPO / "conf" / "config.yaml").read_text()
    assert config.count("${bcastbench.layout:${layout}}") == 2  # run dir and sweep subdir


def test_a_world_of_more_than_two_ranks_per_cpu_is_warned_about_once(caplog, monkeypatch):
    import logging

    from harness.job import app
    from strategies.core.layout import Layout

    monkeypatch.setattr(app, "host_cores", lambda: 2)
    monkeypatch.setattr(app, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="bcastbench"):
        app._warn_oversubscribed(Layout(tp=2, pp=2))  # 2 per CPU: fine
        app._warn_oversubscribed(Layout(tp=8, pp=8))
        app._warn_oversubscribed(Layout(tp=8, pp=8))
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "64 ranks on 2 CPUs (32 ranks per CPU)" in warning


@pytest.mark.parametrize("name", ["rl_rollout", "pretrain", "multimodal"])
@pytest.mark.parametrize("rows,seq_len", [(1, 2), (3, 1024), (7, 130), (2, 6)])
def test_a_generated_payload_is_priced_exactly_before_it_is_made(name, rows, seq_len):
    """The bound config.validate checks is the generator's own size: tensors to the byte, the
    text columns never above their per-row allowance."""

    batch = generated.make(name, rows, seq_len, seed=5)
    tensors = sum(v.numel() * v.element_size() for v in batch.batch.values())
    text = sum(len(str(x).encode()) for col in batch.non_tensor_batch.values() for x in col)
    priced = sizes.payload_bytes(name, rows, seq_len)
    allowance = rows * sizes.TEXT_BYTES_PER_ROW if batch.non_tensor_batch else 0
    assert priced == tensors + allowance
    assert text <= allowance


def test_a_mistyped_key_is_refused_before_torch_is_imported():
    """``bcastbench run`` composes the config from light modules and imports the job (torch,
    megatron-core, tensordict) only once it composed: a typo answers at once. Shown with
    ``python -X importtime``, which lists every module the command imported."""
    import subprocess
    import sys

    for argv in (["typo=1"], ["-m", "typo=1,2"]):
        res = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "harness", "run", *argv],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert res.returncode == 2, res.stderr[-2000:]
        lines = res.stderr.splitlines()
        assert any("Key 'typo' not in 'BenchConf'" in line for line in lines), res.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import")}
        heavy = imported & {"torch", "tensordict", "megatron", "megatron.core", "pandas"}
        assert not heavy, (argv, sorted(heavy))


def test_a_size_range_is_one_job_per_size_the_nccl_tests_way(capsys):
    """``payload.batch_size=sizes(64K,16M,4)`` is nccl-tests' ``-b 64K -e 16M -f 4``: the batch
    sizes whose payload is nearest each size, one job each; a bad range is one line, exit 2."""
    from harness.commands import cli
    from harness.payload.sizes import payload_bytes, sizes_for

    rows = sizes_for("rl_rollout", 512, "64K", "16M", 4)
    assert rows == sorted(rows) and len(rows) == 5
    for k, b in enumerate(rows):
        target = 64 * 2**10 * 4**k
        assert target / 2 <= payload_bytes("rl_rollout", b, 512) <= target * 2, (k, b)
    argv = ["run", "-m", "payload.batch_size=sizes(64K,16M,4)", "payload.seq_len=512",
            "layout=tp2", "--check"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "5 jobs checked" in capsys.readouterr().out
    assert cli.main(["run", "-m", "payload.batch_size=sizes(16M,64K,4)", "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected 0 < begin <= end" in err[0], err


def test_transferqueue_without_its_extra_is_one_line_naming_it_and_exit_2(
    tmp_path, capsys, monkeypatch
):
    """An installation without the transferqueue extra (imports of transfer_queue fail):
    choosing the strategy exits 2 before anything starts, in one line naming the extra; the
    named sweeps leave it out."""
    import strategies
    from harness.commands import cli

    monkeypatch.setitem(sys.modules, "transfer_queue", None)  # import raises ImportError
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    run_dir = tmp_path / "run"
    assert cli.main(["world=ray", "strategy=transferqueue", f"hydra.run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'bcastbench[transferqueue]'" in err and len(err.splitlines()) == 1, err
    assert "transferqueue" not in strategies.names_for_world("ray")
    assert not run_dir.exists()


def test_the_eta_weighs_the_jobs_left_by_their_ranks():
    """A sweep of small worlds first and large ones last (make bench's order) must not promise
    the end at the small ones' pace: the jobs left weigh by their ranks (``job_weight``)."""
    from omegaconf import OmegaConf

    from harness.job.sweep_plan import RANKS_EXPONENT, job_weight
    from harness.report.sweep_state import eta_s

    def cfg(**layout):
        return OmegaConf.create({"layout": {"dp": 1, "pp": 1, "tp": 1, "cp": 1, **layout}})

    assert job_weight(cfg(tp=2)) == 2**RANKS_EXPONENT
    assert job_weight(cfg(tp=2, pp=2, dp=2)) == 8**RANKS_EXPONENT
    weights = [job_weight(cfg(tp=2))] * 2 + [job_weight(cfg(tp=2, pp=2, dp=2))] * 2
    by_count = eta_s(10.0, 2, 4, [])  # what the line said before: 10 s more
    by_ranks = eta_s(10.0, 2, 4, weights)
    assert by_count == 10.0 and by_ranks == pytest.approx(10.0 * 4**RANKS_EXPONENT)
    assert eta_s(10.0, 4, 4, weights) == 0.0
    assert math.isnan(eta_s(10.0, 0, 4, weights)) and math.isnan(eta_s(10.0, 1, 0, []))


@pytest.mark.parametrize(
    "argv, compositions",
    [
        (["sweep=bench"], 4),
        (["sweep=large"], 2),
        (["layout.pp=1", "layout=tp2,tp2pp2", "+strategy.options.fields=[input_ids]",
          "strategy=ray_object_store,self_load", "world=ray", "payload.batch_size=48,384"], 4),
        (["layout=tp2pp2", "~steady_iters", "payload=verl_grpo,rl_rollout", "iters=3,4"], 2),
        (["strategy=auto", "+strategy.options.first=shm,header", "payload.batch_size=3,8"], 1),
    ],
    ids=["bench", "large", "lazy_fetch", "deletion_and_payloads", "options"],
)  # fmt: skip
def test_a_sweep_check_composes_each_job_as_hydra_does(argv, compositions):
    """``check_sweep`` composes each choice of config groups once and applies a job's value
    overrides to a copy: every job's config equals the one Hydra's own ``load_sweep_config``
    composes from scratch when the job starts (the config and the groups it chose)."""
    from omegaconf import OmegaConf

    from harness.job.sweep_plan import _Composer, _expanded

    with _expanded(argv, "config") as (loader, master, jobs):
        compose = _Composer(loader, master)
        assert len(jobs) >= 2
        for job in jobs:
            ours, hydras = compose(job), loader.load_sweep_config(master, job)
            assert ours.hydra.runtime.choices == hydras.hydra.runtime.choices, job
            for cfg in (ours, hydras):
                with open_dict(cfg):
                    del cfg["hydra"]
            assert OmegaConf.to_container(ours) == OmegaConf.to_container(hydras), job
            assert OmegaConf.is_struct(ours) == OmegaConf.is_struct(hydras)
        # Composed once per choice of groups (the sizes of a layout share its defaults).
        assert len(compose.composed) == compositions
