"""What the tests that drive the job config and the CLI share: the repository's root, a config
composed as a job would compose it (no process started), and ``python -m harness`` run as a
user would run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from harness.run.config import register

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
