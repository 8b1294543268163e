"""A long job's progress on the driver's log (``harness.worlds.forked_answers``): rank 0's phase
at INFO no more than once per ``PROGRESS_EVERY_S``, every phase at DEBUG. No world: the
collector's echo alone."""

from __future__ import annotations

import logging
import time

from harness.worlds import forked_answers
from harness.worlds.forked_answers import Collector


def test_a_long_job_says_where_rank_0_is_at_most_once_per_period(caplog):
    collector = Collector([], [], [], board=None, stacks="", teardown=lambda: None)
    began = time.monotonic() - forked_answers.PROGRESS_EVERY_S - 1
    collector._began = collector._echoed = began
    with caplog.at_level(logging.DEBUG, logger="bcastbench"):
        collector._echo("timed iteration 3 of pickled")
        collector._echo("timed iteration 4 of pickled")
    (first, second) = caplog.records
    assert first.levelno == logging.INFO and "rank 0 at timed iteration 3 of pickled" in first.msg
    assert f"{forked_answers.PROGRESS_EVERY_S + 1:.0f} s into the job" in first.msg
    assert second.levelno == logging.DEBUG and "iteration 4" in second.msg
