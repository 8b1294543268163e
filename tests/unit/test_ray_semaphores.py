"""The named semaphores a private Ray cluster's processes leave in /dev/shm (a compiled graph's
channels) go with the cluster: removed by pid, and no one else's."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.worlds import ray_reaper

NO_PID = 4194305
"""Above Linux's largest pid (pid_max is at most 2**22): no process has it."""


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_the_semaphores_of_the_clusters_pids_and_no_others_are_removed():
    ours = [Path(f"/dev/shm/sem.{kind}{NO_PID}-bcastbench-test") for kind in ("hdr", "obj")]
    other = Path(f"/dev/shm/sem.hdr{NO_PID}0-bcastbench-test")  # another pid, same prefix
    try:
        for path in [*ours, other]:
            path.write_bytes(b"")
        assert sorted(ray_reaper.remove_semaphores({NO_PID})) == sorted(ours)
        assert not any(p.exists() for p in ours) and other.exists()
        assert ray_reaper.remove_semaphores({NO_PID}) == []  # nothing left: nothing said
    finally:
        for path in [*ours, other]:
            path.unlink(missing_ok=True)
