"""``harness.report.drawing.draw_beside``: every figure drawn exactly once whichever process
takes it, in order, with what the text returned; a child that dies costs no figure; an error
in a figure or in the text is the caller's, and no child is left behind. Nothing here depends
on which process happens to take which figure."""

from __future__ import annotations

import os

import pytest

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
