"""``harness.report.drawing.draw_beside``: every figure drawn exactly once whichever process
takes it, in order, with what the text returned; a child that dies costs no figure; an error
in a figure or in the text is the caller's, and no child is left behind. Nothing here depends
on which process happens to take which figure."""

from __future__ import annotations

import os
import time

import pytest

from harness import files
from harness.report import drawing

pytestmark = pytest.mark.unit


@pytest.fixture
def two_cores(monkeypatch):
    """Two cores, and the pids of the children forked (to check each was reaped)."""
    monkeypatch.setattr(drawing, "host_cores", lambda: 2)
    forked, fork = [], os.fork

    def recorded():
        pid = fork()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", recorded)
    return forked


def _marks(tmp_path, n):
    """Draws that each create a file named for their index (``O_EXCL``: a second draw of the
    same figure fails) and return the pid that drew it."""

    def draw(i):
        def one():
            os.close(os.open(tmp_path / f"fig{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return i, os.getpid()

        return one

    return [draw(i) for i in range(n)]


def _no_child_left(forked):
    assert forked, "no child was forked"
    for pid in forked:
        with pytest.raises(ChildProcessError):  # reaped already
            os.waitpid(pid, os.WNOHANG)


def test_every_figure_is_drawn_once_in_order(tmp_path, two_cores):
    results, text = drawing.draw_beside(_marks(tmp_path, 9), lambda: "text")
    assert text == "text"
    assert [i for i, _ in results] == list(range(9))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"fig{i}" for i in range(9))
    _no_child_left(two_cores)


def test_one_core_draws_here(tmp_path, monkeypatch):
    monkeypatch.setattr(drawing, "host_cores", lambda: 1)
    results, _ = drawing.draw_beside(_marks(tmp_path, 3), lambda: None)
    assert {pid for _, pid in results} == {os.getpid()}


def test_figures_a_dead_child_took_are_drawn_here(tmp_path, two_cores):
    parent = os.getpid()
    said = []

    def die_in_child(i):
        def one():
            if os.getpid() != parent:
                os._exit(3)
            return i

        return one

    results, _ = drawing.draw_beside([die_in_child(i) for i in range(4)], lambda: 0, said.append)
    assert results == [0, 1, 2, 3]
    # The child died only if it took a figure; where it did, a line says so.
    assert all("exited with status 3" in line for line in said)
    _no_child_left(two_cores)


def test_a_figure_that_fails_in_the_child_is_said_in_one_line_and_drawn_here(two_cores, capfd):
    parent = os.getpid()

    def fails_in_child(i):
        def one():
            if os.getpid() != parent:
                raise ValueError("no such column: p50_us")
            time.sleep(0.05)  # the parent's draws take a while, as figures do
            return i

        return one

    said = []
    results, _ = drawing.draw_beside([fails_in_child(i) for i in range(4)], lambda: 0, said.append)
    assert results == [0, 1, 2, 3]
    _no_child_left(two_cores)
    # Where the child took a figure, its failure is one line (the figure is drawn here, and a
    # traceback, if any, is this process's own), not a traceback beside the parent's.
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert err.count("ValueError: no such column: p50_us") == len(said), (err, said)


def test_a_figure_that_cannot_be_drawn_raises_its_own_error(two_cores):
    def broken():
        raise ValueError("no such column: p50_us")

    with pytest.raises(ValueError, match="p50_us"):
        drawing.draw_beside([broken, broken], lambda: None, lambda line: None)
    _no_child_left(two_cores)


def test_an_error_in_the_text_stops_the_child(tmp_path, two_cores):
    def text():
        raise KeyError("supported")

    with pytest.raises(KeyError, match="supported"):
        drawing.draw_beside(_marks(tmp_path, 3), text)
    _no_child_left(two_cores)


def test_a_thread_beside_or_a_failed_fork_draws_here(tmp_path, two_cores, monkeypatch):
    """A process with a thread beside the main one (a notebook's kernel) is not forked: a lock
    the thread held would stay held in the child; nor is one whose fork fails."""
    monkeypatch.setattr(drawing.threading, "active_count", lambda: 2)
    results, _ = drawing.draw_beside(_marks(tmp_path, 3), lambda: None)
    assert not two_cores and {pid for _, pid in results} == {os.getpid()}
    monkeypatch.undo()
    monkeypatch.setattr(drawing, "host_cores", lambda: 2)

    def no_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    for mark in tmp_path.iterdir():
        mark.unlink()
    results, _ = drawing.draw_beside(_marks(tmp_path, 3), lambda: None)
    assert {pid for _, pid in results} == {os.getpid()}


def test_a_child_stopped_while_writing_leaves_no_temporary_file(tmp_path, two_cores):
    """The text fails while the child writes a figure: the child is asked to stop, and
    ``write_atomic`` removes its temporary file on the way out."""
    started = tmp_path / "started"
    out = tmp_path / "figures"

    def slow_figure():
        def write(f):
            started.touch()
            time.sleep(120)  # until stopped

        return files.write_atomic(out / "slow.png", write)

    def text():
        for _ in range(6000):  # the child's first figure has begun: bounded by what is seen
            if started.exists():
                raise RuntimeError("the text failed")
            time.sleep(0.01)
        raise AssertionError("the child never started its figure")

    with pytest.raises(RuntimeError, match="the text failed"):
        drawing.draw_beside([slow_figure], text)
    _no_child_left(two_cores)
    assert list(out.iterdir()) == []
