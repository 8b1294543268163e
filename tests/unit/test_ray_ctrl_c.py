"""A Ctrl-C reaches a driver that waits on Ray. Ray's wait runs Python's signal handlers inside
its C++ loop and drops the KeyboardInterrupt the default handler raises there, so a driver
blocked in ``ray.wait`` never saw its Ctrl-C (a sweep ran on until SIGINT had also killed the
cluster and the driver noticed). ``SwallowingRay`` waits the way Ray does; the Ray world's
waits take SIGINT as a flag and raise from their own loop (``ctrl_c_as_a_flag``)."""

from __future__ import annotations

import signal

import pytest

from harness.worlds.ray_answers import WAIT_SLICE_S, _wait_one, ctrl_c_as_a_flag


class SwallowingRay:
    """``ray.wait`` as Ray 2.x behaves: nothing is ever ready, and a signal handler's
    exception raised while it waits is dropped. The Ctrl-C arrives during wait
    ``ctrl_c_on_call``."""

    def __init__(self, ctrl_c_on_call: int = 2) -> None:
        self.calls = 0
        self.ctrl_c_on_call = ctrl_c_on_call

    def wait(self, pending, num_returns=1, timeout=None):
        self.calls += 1
        try:
            if self.calls == self.ctrl_c_on_call:
                signal.raise_signal(signal.SIGINT)  # its handler runs here, at once
        except KeyboardInterrupt:
            pass  # what Ray's check_signals does with it
        return [], pending


def test_a_plain_wait_loop_loses_the_ctrl_c():
    """The behaviour the flag exists for: the default handler's KeyboardInterrupt is lost."""
    ray = SwallowingRay()
    for _ in range(5):
        ray.wait(["ref"], timeout=0.0)
    assert ray.calls == 5


def test_the_worlds_wait_raises_the_ctrl_c_at_its_next_check():
    ray = SwallowingRay(ctrl_c_on_call=2)
    with pytest.raises(KeyboardInterrupt), ctrl_c_as_a_flag() as check:
        _wait_one(ray, ["ref"], 3600.0, check)
    assert ray.calls == 2  # seen before a third wait began
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handed back


def test_a_wait_that_ends_first_hands_the_signal_back_untouched():
    ray = SwallowingRay()
    with ctrl_c_as_a_flag() as check:
        ready, rest = _wait_one(ray, ["ref"], WAIT_SLICE_S, check)
    assert ready == [] and rest == ["ref"] and ray.calls == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with ctrl_c_as_a_flag() as check:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            check()
    finally:
        signal.signal(signal.SIGINT, previous)
