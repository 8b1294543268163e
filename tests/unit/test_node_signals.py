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


@pytest.mark.parametrize("readers,slots", [(1, 1), (3, 3), (63, 3), (64, 3), (511, 7), (9, 40)])
def test_every_readers_report_words_have_cache_lines_of_their_own_on_the_page(readers, slots):
    """The completion word's line, then each reader's read word and a release word per slot on
    lines no other rank writes, all on a page of whole memory pages."""
    size = ns.completion_page_bytes(readers, slots)
    assert size % ns.COMPLETION_PAGE_BYTES == 0
    lines = {0: "completion"}
    for i in range(readers):
        at = ns.report_at(i, slots)
        for word in [at] + [ns.release_at(at, k) for k in range(slots)]:
            assert lines.setdefault(word // ns.CACHE_LINE_BYTES, i) == i, (i, word)
            assert word % ns.REPORT.size == 0 and word + ns.REPORT.size <= size


def test_a_report_word_only_rises():
    """A message released after a later one of its slot leaves the later one's word (the
    writer compares the word with the slot's current message)."""
    import mmap

    page = mmap.mmap(-1, ns.COMPLETION_PAGE_BYTES)
    words = ns.ReportWords()
    words.page, words.at = page, {5: ns.report_at(0, 3)}
    ns.write_report(page, words.at[5], 4)
    ns.write_report(page, ns.release_at(words.at[5], 2), 9)
    ns.write_report(page, ns.release_at(words.at[5], 2), 6)
    assert words.read(5) == 4 and words.released(5, 2) == 9 and words.released(5, 0) == 0


def test_the_writer_frees_a_slot_only_for_a_reader_whose_word_reached_its_message():
    """``RingWriter._read_words``: a holder whose release word is below the slot's current
    message (it let go of an older one of that slot) keeps holding; one whose word reached it
    lets go; the node leader's own hold (not a reader: no words) is left to its own report;
    the read words become ``read_upto``."""
    import mmap

    from strategies.core.node_channel import NodeChannel
    from strategies.core.segment_ring import Slot

    writer = object.__new__(NodeChannel)  # only the writer's state: no process group
    writer.slots = [Slot(0), Slot(1)]
    writer.words = ns.ReportWords()
    writer.words.page = mmap.mmap(-1, ns.completion_page_bytes(2, 2))
    writer.words.at = {3: ns.report_at(0, 2), 4: ns.report_at(1, 2)}
    writer.socks, writer.read_upto = {3: None, 4: None}, {}
    writer.slots[0].sequence, writer.slots[0].holders = 7, {0, 3, 4}
    writer.slots[1].sequence, writer.slots[1].holders = 8, {3, 4}
    page = writer.words.page
    ns.write_report(page, ns.release_at(writer.words.at[3], 0), 7)
    ns.write_report(page, ns.release_at(writer.words.at[4], 0), 4)  # an older message of slot 0
    ns.write_report(page, ns.release_at(writer.words.at[4], 1), 8)
    ns.write_report(page, writer.words.at[3], 8)
    writer._read_words()
    assert writer.slots[0].holders == {0, 4} and writer.slots[1].holders == {3}
    assert writer.read_upto == {3: 8, 4: 0}


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
