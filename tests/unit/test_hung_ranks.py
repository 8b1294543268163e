"""Which ranks a hung world names. ``culprits`` (the Ray world): the rank the others wait for,
not the first to go quiet. Ranks report progress at their own pace, so a rank waiting in a
collective can cross the silence limit a moment before the rank it waits for, which hangs
outside any collective; naming the waiting one blamed the wrong rank (CI named rank 0 in a
barrier while rank 1 hung). ``where`` (every world): a rank blocked in shm's node channel waits
for a peer, as one in a collective does."""

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


def test_a_rank_blocked_in_the_node_channel_waits_for_a_peer():
    """A reader blocked on its socket for the node leader's signal (shm) is waiting for a
    peer, as in a collective: a hung world names the rank it waits for, not it."""
    import socket
    import sys
    import threading
    import time
    import types

    from harness.worlds.rank import WAITING_FOR_PEER, in_collective, where
    from strategies.core.node_channel import NodeChannel

    leader, mine = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    reader = object.__new__(NodeChannel)  # the reader's state only: no process group
    reader.groups = types.SimpleNamespace(rank=1, leader=0)
    reader.node_leader, reader.sock, reader.timeout_s = 0, mine, 60.0
    ended: list = []
    thread = threading.Thread(target=lambda: ended.append(_raised(reader._next_message)))
    thread.start()
    try:
        place = ""
        while not place.startswith(WAITING_FOR_PEER) and thread.is_alive():
            time.sleep(0.01)  # until the thread is in its receive: no clock bounds the test
            place = where(sys._current_frames().get(thread.ident))
        assert place.startswith(WAITING_FOR_PEER), (place, ended)
        assert "_next_message" in place and in_collective(place)
    finally:
        leader.close()  # the reader's receive ends: the leader closed its socket
        thread.join()
    assert "closed its socket" in ended[0]


def _raised(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 -- the test reads the text
        return str(exc)
    return ""


def test_every_peer_wait_names_a_function_of_the_channel():
    """``PEER_WAITS`` names functions by file and name: each still exists there."""
    import importlib
    import inspect

    from harness.worlds.rank import PEER_WAITS

    for path, name in PEER_WAITS:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        found = [
            obj
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if cls.__module__ == module.__name__
            for obj in [cls.__dict__.get(name)]
            if obj is not None
        ]
        assert found, (path, name)


def test_a_receivers_error_raised_from_its_leaders_failure_follows_the_leader():
    """A failed job names a rank's own error before one passed on from its replica leader
    (``LeaderFailed``, however a caller wrapped it), so the driver waits for the leader's."""
    from strategies import LeaderFailed
    from strategies.core.contract import follows_its_leader

    def raised(make):
        try:
            make()
        except Exception as exc:
            return exc

    def wrapped():
        try:
            raise LeaderFailed("rank 1: the replica leader (rank 0) failed")
        except LeaderFailed as exc:
            raise ValueError("batch refused") from exc

    def in_handling():
        try:
            raise LeaderFailed("rank 1: the replica leader (rank 0) failed")
        except LeaderFailed:
            raise KeyError("while handling it") from None

    assert follows_its_leader(LeaderFailed("rank 2: the replica leader (rank 0) failed"))
    assert follows_its_leader(raised(wrapped))
    assert not follows_its_leader(raised(in_handling))  # `from None`: not its cause
    assert not follows_its_leader(ValueError("its own"))
    looped = ValueError("a")
    looped.__context__ = KeyError("b")
    looped.__context__.__context__ = looped
    assert not follows_its_leader(looped)


def test_the_ray_world_names_a_leaders_own_error_before_its_receivers():
    """A Ray world's failed task names, among the ranks that failed together, one whose actor
    died, else the leader's own error over a receiver's ``LeaderFailed`` (which Ray hands back
    wrapped, the rank's exception as its ``cause``), else the first to answer."""
    from harness.worlds.ray_answers import root_of
    from strategies import LeaderFailed

    class Died(Exception):
        pass

    class TaskError(Exception):  # Ray's wrapper of a task's exception
        def __init__(self, cause):
            super().__init__(str(cause))
            self.cause = cause

    follower = TaskError(LeaderFailed("rank 1: the replica leader (rank 0) failed"))
    own, death = TaskError(ValueError("leader's own")), Died("actor died")
    assert root_of((1, follower), [(0, own)], Died) == (0, own)
    assert root_of((1, follower), [(0, own), (3, death)], Died) == (3, death)
    assert root_of((1, follower), [(2, follower)], Died) == (1, follower)  # no leader's error
    assert root_of((0, own), [(1, follower)], Died) == (0, own)
    assert root_of((2, own), [(0, TaskError(KeyError("another")))], Died) == (2, own)
