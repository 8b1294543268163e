"""Job configuration before any process starts: presets compose, bad values are refused
with the arithmetic, and the CLI says so and exits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.run.config import ConfigError, register, validate

REPO = Path(__file__).resolve().parents[2]
CONF = str(REPO / "conf")


def cfg_of(*overrides: str):
    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def harness(*args: str, timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["layout.tp=3"],
            "seq_len=1024 is not divisible",
        ),  # passes layout, fails nothing? see below
        (["payload.seq_len=30", "layout=tp2cp2"], "not divisible by 2·cp = 4"),
        (["strategy.name=nope"], "unknown strategy 'nope'; valid names"),
        (["payload.name=nope"], "unknown payload 'nope'"),
        (["payload.batch_size=0"], "payload.batch_size must be positive"),
        (["layout.pp=0"], "layout.pp must be a positive integer"),
        (["references=[floor,nope]"], "unknown reference strategy 'nope'"),
        (["fault.kind=explode"], "fault.kind must be crash or hang"),
        (["layout.order=tp-pp-xx"], "unknown axes ['xx']"),
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


def test_cli_bad_config_exits_nonzero_with_message(tmp_path):
    res = harness("strategy.name=nope", f"hydra.run.dir={tmp_path}")
    assert res.returncode != 0
    assert "unknown strategy 'nope'" in res.stderr
    assert not (tmp_path / "result.json").exists()
