"""What the tests that drive the job config and the CLI share: the repository's root, a config
composed as a job would compose it (no process started), and ``python -m harness`` run as a
user would run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from harness.job.config_schema import register

REPO = Path(__file__).resolve().parents[1]
CONF = str(REPO / "conf")


def cfg_of(*overrides: str):
    """The job config these overrides compose to (Hydra's compose, no @hydra.main)."""
    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def harness(*args: str, timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    """``python -m harness ARGS`` from the repository root, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def check_uneven_cycle_shapes(rec: dict) -> None:
    """A record of the real-step CLI job (``payload.cycle=[{seq_len:64},{seq_len:32}]``,
    ``payload.dp_split=[3,1]``, ``iters=4``, ``steady_iters``): ok and correct, each shape listed
    with its replicas' rows, its two calls, its own floor and steady p50, 64 tokens first."""
    assert rec["status"] == "ok" and rec["correct"] is True, rec.get("error")
    assert rec["dp_split"] == [3, 1]
    shapes = rec["shapes"]
    assert sorted(s["seq_len"] for s in shapes) == [32, 64]
    for shape in shapes:
        assert shape["dp_rows"] == [3, 1] and shape["calls"] == 2
        assert shape["vs_floor"] > 0 and shape["steady_p50_us"] > 0
    assert shapes[0]["payload_bytes"] > shapes[1]["payload_bytes"] > 0  # 64 tokens, then 32


def at_a_terminal(*args: str) -> list[str]:
    """``python -m harness ARGS`` as a terminal's foreground job starts it: with Ctrl-C's
    signal at its default, whatever this test session inherited. A suite started in the
    background (``make test &``, nohup, a CI runner's job) has SIGINT ignored, every child
    inherits that, and a command that ignores SIGINT cannot be interrupted: a Ctrl-C test run
    there tested nothing but the inheritance. exec keeps the default it is handed."""
    reset = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, '-m', 'harness', *sys.argv[1:]])"
    )
    return [sys.executable, "-c", reset, *args]
