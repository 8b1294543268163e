"""Tier 1: harness.machine measures other work's CPU from /proc/stat (not the load average)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from harness.machine import other_cores, other_cores_now, snapshot

pytestmark = pytest.mark.skipif(snapshot() is None, reason="no /proc/stat")

SPIN = (
    "import time\nprint('spinning', flush=True)\nt = time.monotonic()\n"
    "while time.monotonic() - t < 2.0:\n    pass\n"
)


def test_a_running_child_is_other_work_until_reaped():
    with subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True) as proc:
        proc.stdout.readline()  # past its start-up, however long a busy machine makes it
        busy = other_cores_now(1.0)
    # One spinning process holds about a core; anything else running only adds to it.
    assert busy is not None and busy >= 0.5


def test_own_work_is_not_other_work():
    start = snapshot()
    # Half a second of this process's own CPU, however long a busy machine takes to give it.
    t = time.process_time()
    while time.process_time() - t < 0.5:
        pass
    mid = snapshot()
    assert mid.own_s - start.own_s >= 0.45
    other = other_cores(start, mid)
    assert other is not None and other >= 0.0
    # Not a bound on other work (CI shares its machine), only that ours was taken out: the
    # machine was at least as busy as we were, and we are not in the remainder.
    assert (mid.busy_s - start.busy_s) >= (mid.own_s - start.own_s) * 0.9


def test_no_interval_has_no_answer():
    now = snapshot()
    assert other_cores(now, now) is None and other_cores(None) is None
