"""The private Ray cluster's reaper stops the cluster's processes and nothing else the driver
runs: not what it ran before the cluster, and not what it started beside it (a Slurm test
cluster's daemons, a user's own servers). Here this test process is the driver; ``sleep``
processes stand in for the cluster's roots and for the driver's other children."""

from __future__ import annotations

import os
import subprocess
import threading

import psutil

from harness.worlds import ray_reaper


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def _reaped(proc: subprocess.Popen) -> subprocess.Popen:
    """``proc`` waited for on a thread: a child of this process that the reaper stops is
    reaped at once, as a driver's are once the cluster has ended, not left a zombie that
    the reaper's wait for it would wait out."""
    threading.Thread(target=proc.wait, daemon=True).start()
    return proc


def _running(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def test_the_reaper_stops_the_roots_and_their_children_and_nothing_else(tmp_path):
    before = _sleeper()  # the driver's own, from before the cluster
    fd, reaper = ray_reaper.start(tmp_path)
    root = _reaped(subprocess.Popen(["sh", "-c", "sleep 60 & wait"]))  # with a child of its own
    beside = _sleeper()  # started beside the cluster
    try:
        child = None
        while child is None:  # the root's child, once the shell has started it
            kids = psutil.Process(root.pid).children()
            child = kids[0] if kids else None
        os.write(fd, ray_reaper.roots_line({root.pid: psutil.Process(root.pid).create_time()}))
        os.close(fd)  # the driver is done: the reaper stops the cluster
        reaper.wait(timeout=30)
        assert not _running(root)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        assert _running(before) and _running(beside)
        assert not tmp_path.exists()
    finally:
        for proc in (before, root, beside):
            proc.kill()
            proc.wait()


def test_before_the_roots_arrive_what_the_driver_started_since_counts_as_the_clusters(tmp_path):
    """A driver killed inside ``ray.init`` never wrote the roots: every process it started
    after the reaper is taken for the cluster's, and what it ran before is still left."""
    before = _sleeper()
    fd, reaper = ray_reaper.start(tmp_path)
    after = _reaped(_sleeper())
    try:
        os.close(fd)  # before or after the reaper's first poll: it takes a last look
        reaper.wait(timeout=30)
        assert not _running(after)
        assert _running(before)
    finally:
        for proc in (before, after):
            proc.kill()
            proc.wait()


def test_the_roots_line_round_trips():
    roots = {123: 1765000000.125, 45: 1765000001.5}
    assert ray_reaper.parse_roots(ray_reaper.roots_line(roots).decode()) == roots
