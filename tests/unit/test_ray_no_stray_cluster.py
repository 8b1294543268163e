"""No Ray cluster the harness did not start: a Ray call made where no cluster is connected (after
a Ray world closed, say) raises, instead of Ray starting a local cluster of its own with its
defaults and a dashboard, as it did at the end of some sweeps. A user who sets
``RAY_ENABLE_AUTO_CONNECT`` keeps their choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CALL = """
import harness, ray
try:
    ray.put(1)
except Exception as exc:
    print(type(exc).__name__, exc)
print("initialized", ray.is_initialized())
"""


def _run(env: dict) -> str:
    pytest.importorskip("ray")
    out = subprocess.run(
        [sys.executable, "-c", CALL], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_ray_call_with_no_cluster_raises_instead_of_starting_one():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_AUTO_CONNECT"}
    said = _run(env)
    assert "Ray has not been started" in said and "initialized False" in said, said


def test_the_users_own_setting_is_kept():
    env = {**os.environ, "RAY_ENABLE_AUTO_CONNECT": "1"}
    code = "import os, harness; print(os.environ['RAY_ENABLE_AUTO_CONNECT'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "1", out.stderr
