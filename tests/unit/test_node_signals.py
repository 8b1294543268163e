"""Tier 1: the node channel's option and platform rules (``strategies.core.node_signals``):
when readers poll the completion word, and the cores a process may use."""

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
