"""The two small types every reader of a record asks: an interval and the record keys it is
stored under (``harness.job.interval``), and a strategy label parsed in one place
(``harness.job.label``). The folder's conftest marks them ``unit``."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from harness.job.interval import (
    Interval,
    interval_end,
    interval_fields,
    interval_keys,
    interval_of,
)
from harness.job.label import Label


# -- interval -------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "keys"), [
    ("p50_us", ("p50_lo_us", "p50_hi_us")),
    ("vs_floor", ("vs_floor_lo", "vs_floor_hi")),
    ("ref_pickled_vs_strategy", ("ref_pickled_vs_strategy_lo", "ref_pickled_vs_strategy_hi")),
])  # fmt: skip
def test_a_field_names_its_interval_keys_with_its_unit_last(field, keys):
    assert interval_keys(field) == keys
    assert [interval_end(k) for k in keys] == ["lo", "hi"]
    assert interval_end(field) is None


def test_what_a_record_stores_reads_back_as_the_same_interval():
    interval = Interval(110.0, 130.0)
    stored = interval_fields("p50_us", interval)
    assert stored == {"p50_lo_us": 110.0, "p50_hi_us": 130.0}
    assert interval_of(stored, "p50_us") == interval
    assert interval_of(pd.Series(stored), "p50_us") == interval  # a pandas row reads the same


def test_no_interval_is_none_in_both_keys_and_reads_back_as_none():
    stored = interval_fields("vs_floor", None)
    assert stored == {"vs_floor_lo": None, "vs_floor_hi": None}
    assert interval_of(stored, "vs_floor") is None
    assert interval_of({}, "vs_floor") is None
    assert interval_of({"vs_floor_lo": 1.0, "vs_floor_hi": math.nan}, "vs_floor") is None
    assert interval_of(pd.Series({"vs_floor_lo": math.nan, "vs_floor_hi": 2.0}), "vs_floor") is None


def test_an_inverted_interval_swaps_its_ends_and_a_scaled_one_keeps_them():
    ratio = Interval(0.5, 0.8)
    assert ratio.inverted() == Interval(1 / 0.8, 1 / 0.5)
    assert ratio.inverted().inverted() == pytest.approx(ratio)
    assert Interval(1e-6, 2e-6).scaled(1e6) == pytest.approx(Interval(1.0, 2.0))
    assert ratio.contains(0.5) and ratio.contains(0.8) and not ratio.contains(1.0)


def test_an_interval_unpacks_as_its_pair_and_wraps_one():
    lo, hi = Interval(1.0, 2.0)
    assert (lo, hi) == (1.0, 2.0) and Interval(1.0, 2.0) == pytest.approx((1.0, 2.0))
    assert Interval.of((1, 2)) == Interval(1.0, 2.0)
    assert Interval.of(None) is None and Interval.of((None, 2.0)) is None


# -- label ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "label"), [
    ("header", Label("header")),
    ("floor", Label("floor")),
    ("floor:chunks2", Label("floor", "chunks2")),
    ("probe:broadcast:4:1048576", Label("probe", "broadcast:4:1048576")),
])  # fmt: skip
def test_a_label_parses_and_prints_back_as_its_text(text, label):
    assert Label.parse(text) == label
    assert str(label) == text


def test_a_probe_label_is_built_from_its_parts_and_gives_them_back():
    label = Label.of("probe", "broadcast", 4, 1048576)
    assert str(label) == "probe:broadcast:4:1048576"
    assert label.method_parts() == ("broadcast", "4", "1048576")
    assert Label.parse("header").method_parts() == ()


@pytest.mark.parametrize(("text", "floor", "probe", "competes"), [
    ("header", False, False, True),
    ("floor", True, False, False),
    ("floor:shm", True, False, False),
    ("probe:broadcast:4:1048576", False, True, False),
])  # fmt: skip
def test_only_a_strategy_a_user_could_pick_competes(text, floor, probe, competes):
    label = Label.parse(text)
    assert (label.is_floor, label.is_probe, label.competes) == (floor, probe, competes)
