"""Which ranks a hung Ray job names (``culprits``): the rank the others wait for, not the first
to go quiet. Ranks report progress at their own pace, so a rank waiting in a collective can
cross the silence limit a moment before the rank it waits for, which hangs outside any
collective; naming the waiting one blamed the wrong rank (CI named rank 0 in a barrier while
rank 1 hung)."""

from __future__ import annotations

from harness.worlds.rank import IN_COLLECTIVE
from harness.worlds.ray_answers import culprits

BARRIER = f"{IN_COLLECTIVE} torch.distributed.barrier (from start_line)"
OUTSIDE = "outside any collective (in run_job_on_rank)"
PHASE = "timed iteration 0 of header"


def test_nobody_is_named_before_someone_is_silent_for_the_limit():
    assert culprits([(0, PHASE, 3.9, BARRIER), (1, PHASE, 3.0, OUTSIDE)], 4.0) == []


def test_a_waiting_rank_past_the_limit_waits_for_the_rank_outside_to_cross_it():
    states = [(0, PHASE, 4.2, BARRIER), (1, PHASE, 3.6, OUTSIDE), (2, PHASE, 4.1, BARRIER)]
    assert culprits(states, 4.0) == []
    later = [(r, p, idle + 2.0, at) for r, p, idle, at in states]
    assert culprits(later, 4.0) == [(1, PHASE, OUTSIDE)]


def test_a_rank_waiting_three_limits_is_named_while_the_rank_outside_goes_on():
    """The rank outside keeps reporting (it does not hang) while rank 0 waits in a collective
    it will never leave: after ``LONG_WAIT`` limits rank 0 is named, not kept waiting."""
    assert culprits([(0, PHASE, 11.9, BARRIER), (1, PHASE, 0.5, OUTSIDE)], 4.0) == []
    assert culprits([(0, PHASE, 12.0, BARRIER), (1, PHASE, 0.5, OUTSIDE)], 4.0) == [
        (0, PHASE, BARRIER)
    ]


def test_silent_ranks_outside_are_named_alone():
    states = [(0, PHASE, 9.0, BARRIER), (1, PHASE, 5.0, OUTSIDE), (3, PHASE, 4.5, OUTSIDE)]
    assert culprits(states, 4.0) == [(1, PHASE, OUTSIDE), (3, PHASE, OUTSIDE)]


def test_a_rank_whose_actor_does_not_answer_counts_as_outside():
    states = [(0, PHASE, 8.0, BARRIER), (2, "not answering", 8.0, "its actor does not answer")]
    assert culprits(states, 4.0) == [(2, "not answering", "its actor does not answer")]


def test_when_every_rank_waits_in_a_collective_the_silent_ones_are_named():
    states = [(0, PHASE, 4.5, BARRIER), (1, PHASE, 2.0, BARRIER)]
    assert culprits(states, 4.0) == [(0, PHASE, BARRIER)]
