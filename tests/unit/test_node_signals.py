"""Tier 1: the node channel's option and platform rules (``strategies.core.node_signals``):
when readers poll the completion word, the cores a process may use, and the readers' report
words on the completion page."""

from __future__ import annotations

import types

import pytest

import strategies.core.node_signals as ns
from strategies.core.node_channel import ranks_on_node


@pytest.mark.parametrize("value", ["2ms", -1, 1.5, True], ids=repr)
def test_a_poll_option_that_is_not_microseconds_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"shm: poll_us must be microseconds .* got "):
        ns.check_poll_option(value)


def test_polling_needs_a_time_and_a_core_per_rank(monkeypatch):
    monkeypatch.setattr(ns.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(ns, "usable_cores", lambda: 4.0)
    assert ns.polls(2000, 4) and not ns.polls(2000, 5)
    assert not ns.polls(None, 1) and not ns.polls(0, 1)


def test_polling_needs_a_machine_whose_stores_keep_their_order(monkeypatch):
    monkeypatch.setattr(ns, "usable_cores", lambda: 64.0)
    monkeypatch.setattr(ns.platform, "machine", lambda: "aarch64")
    assert not ns.polls(2000, 2)


def test_report_words_need_a_machine_whose_stores_keep_their_order(monkeypatch):
    monkeypatch.setattr(ns.platform, "machine", lambda: "aarch64")
    assert not ns.report_words_allowed()
    monkeypatch.setattr(ns.platform, "machine", lambda: "x86_64")
    assert ns.report_words_allowed()


@pytest.mark.parametrize("readers,slots", [(1, 1), (3, 3), (127, 3), (128, 3), (511, 7)])
def test_every_readers_report_words_have_a_place_of_their_own_on_the_page(readers, slots):
    """The completion word, then each reader's read word and a release word per slot, none
    shared, all on a page of whole memory pages."""
    size = ns.completion_page_bytes(readers, slots)
    assert size % ns.COMPLETION_PAGE_BYTES == 0
    taken = {0}
    for i in range(readers):
        at = ns.report_at(i, slots)
        words = {at + ns.REPORT.size * k for k in range(1 + slots)}
        assert not words & taken
        taken |= words
    assert max(taken) + ns.REPORT.size <= size


def test_a_report_word_only_rises_and_a_closed_page_is_no_error():
    """A message released after a later one of its slot leaves the later one's word (the
    writer compares the word with the slot's current message); a finalizer that reports
    after the channel's page closed does nothing."""
    import mmap

    page = mmap.mmap(-1, ns.COMPLETION_PAGE_BYTES)
    words = ns.ReportWords()
    words.page, words.at = page, {5: ns.report_at(0, 3)}
    ns.write_report(page, words.at[5], 4)
    ns.write_report(page, words.at[5] + ns.REPORT.size * 3, 9)
    ns.write_report(page, words.at[5] + ns.REPORT.size * 3, 6)
    assert words.read(5) == 4 and words.released(5, 2) == 9 and words.released(5, 0) == 0
    page.close()
    ns.write_report(page, words.at[5], 10)


@pytest.mark.parametrize(
    ("v2", "v1", "want"),
    [
        ("150000 100000", None, 1.5),  # cgroup v2 quota: 1.5 cores
        ("max 100000", None, None),  # no quota: the affinity
        (None, ("200000", "100000"), 2.0),  # cgroup v1
        (None, ("-1", "100000"), None),
        (None, None, None),  # no cgroup files at all
    ],
)
def test_usable_cores_is_the_affinity_capped_by_the_cgroup_quota(
    tmp_path, monkeypatch, v2, v1, want
):
    monkeypatch.setattr(ns.os, "sched_getaffinity", lambda pid: set(range(8)))
    v2_path, q_path, p_path = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    if v2 is not None:
        v2_path.write_text(v2)
    if v1 is not None:
        q_path.write_text(v1[0])
        p_path.write_text(v1[1])
    monkeypatch.setattr(ns, "QUOTA_FILES", ((str(v2_path), None), (str(q_path), str(p_path))))
    assert ns.usable_cores() == (8.0 if want is None else want)


def test_ranks_on_node_counts_the_world_on_this_node():
    groups = types.SimpleNamespace(rank=2, replica_ranks=(0, 1, 2, 3), node_of=(0, 0, 1, 1, 1))
    assert ranks_on_node(groups) == 3


def polling_reader(awaited_word: int):
    """A node channel's reader half on one end of a socket pair, polling a completion page
    that holds ``awaited_word``; returns (reader, the writer's end)."""
    import mmap
    import socket

    from strategies.core.node_channel import NodeChannel

    writer, mine = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    reader = object.__new__(NodeChannel)  # only the reader's state: no process group
    reader.groups = types.SimpleNamespace(rank=1, leader=0)
    reader.node_leader, reader.sock, reader._sock_poll = 0, mine, None
    reader.poll_s, reader.timeout_s = 0.001, 5.0
    reader.completion = mmap.mmap(-1, ns.COMPLETION_PAGE_BYTES)
    ns.COMPLETED.pack_into(reader.completion, 0, awaited_word)
    reader.closed, reader.closed_why = False, ""
    reader.socks, reader.fds, reader.slots, reader.read_upto, reader.published = {}, {}, [], {}, [0]
    reader.words, reader.report_at = ns.ReportWords(), None
    return reader, writer


def test_a_polling_reader_tells_its_message_abort_from_a_channel_given_up():
    """Message 7 awaited, its abort first in the socket: 7 was aborted, whatever later message
    the word holds. An abort of no message (the writer gave up its channel, ``abandon``) over a
    word that holds 7 or later: 7 is whole, the abort left for the next call; over an older
    word 7 never completes: the reader raises the leader's text and closes the channel."""
    from strategies.core.contract import LeaderFailed

    reader, writer = polling_reader(8)
    writer.send(ns.SIGNAL.pack(ns.ABORT_MAGIC, 0, 0, 7, 0))
    assert reader._polled_complete(7) is False
    reader, writer = polling_reader(8)
    writer.send(ns.SIGNAL.pack(ns.ABORT_MAGIC, 0, 0, 0, 0))
    assert reader._polled_complete(7) is True
    reader, writer = polling_reader(6)
    writer.send(ns.SIGNAL.pack(ns.ABORT_MAGIC, 0, 0, 0, 0))
    writer.send(b"RuntimeError: boom")
    reader.pending = 7
    with pytest.raises(LeaderFailed, match="failed to send its batch: RuntimeError: boom"):
        reader.wait_complete()
    assert reader.closed and "could not be shipped: RuntimeError: boom" in reader.closed_why
