"""A forked world's directory (its ranks' stack files and rendezvous file) that a driver killed
by SIGKILL could not remove is removed by the next world to start, and only such a one."""

from __future__ import annotations

import os
import subprocess
import sys

from harness.worlds.forked import STACKS_PREFIX, orphaned


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_a_dead_drivers_directory_is_orphaned(tmp_path):
    dead = tmp_path / f"{STACKS_PREFIX}{_dead_pid()}-abc123"
    live = tmp_path / f"{STACKS_PREFIX}{os.getppid()}-abc123"
    mine = tmp_path / f"{STACKS_PREFIX}{os.getpid()}-abc123"
    unnamed = tmp_path / f"{STACKS_PREFIX}abc123"  # made before directories named their driver
    other = tmp_path / "unrelated-1-abc"
    for d in (dead, live, mine, unnamed, other):
        d.mkdir()
        (d / "rank0.txt").write_text("")
    assert orphaned(str(tmp_path)) == [str(dead)]


def test_a_missing_root_has_no_orphans(tmp_path):
    assert orphaned(str(tmp_path / "absent")) == []
