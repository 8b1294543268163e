"""The forked world's phase board: what a rank posts is what the driver reads, whole."""

from __future__ import annotations

import multiprocessing

from harness.worlds.forked_rank import PHASE_BYTES, PhaseBoard


def board(n: int = 2) -> PhaseBoard:
    return PhaseBoard(multiprocessing.get_context("fork"), n)


def test_a_rank_that_has_not_reported_reads_as_nothing():
    assert board().read(1) == (-1, 0, "")


def test_each_rank_reads_back_its_last_phase_job_and_step():
    b = board(3)
    b.write(0, 7, 1, "building groups")
    b.write(2, 7, 5, "timed iteration 3 of flat")
    b.write(0, 7, 2, "timed iteration 0 of π header")
    assert b.read(0) == (7, 2, "timed iteration 0 of π header")
    assert b.read(1) == (-1, 0, "")
    assert b.read(2) == (7, 5, "timed iteration 3 of flat")


def test_a_long_phase_is_cut_to_the_slot_without_touching_the_next_rank():
    b = board(2)
    b.write(1, 1, 1, "neighbour")
    b.write(0, 1, 1, "x" * (PHASE_BYTES * 2))
    assert b.read(0)[2] == "x" * PHASE_BYTES
    assert b.read(1)[2] == "neighbour"


def test_a_rank_posting_from_another_process_is_read_by_the_driver():
    b = board(1)
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=b.write, args=(0, 3, 9, "counting collectives of direct"))
    p.start()
    p.join(30)
    assert b.read(0) == (3, 9, "counting collectives of direct")
