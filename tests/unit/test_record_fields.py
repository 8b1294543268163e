"""One record shape: ``records.FIELDS`` is the list docs/records.md documents, and ``complete``
gives any record every field, in that order, without dropping one it does not list."""

from __future__ import annotations

import json
import re

from harness.job import phases
from harness.job.record_fields import FIELDS, Record, complete, type_problems
from harness.paths import REPO


def test_docs_list_exactly_the_record_fields():
    page = (REPO / "docs" / "records.md").read_text()
    section = page.split("## Record fields (`result.json`)", 1)[1].split("\n- ", 1)[0]
    (listed,) = re.findall(r"`([a-z_0-9,\s]+)`", section.replace("\n", " "))
    assert [name.strip() for name in listed.split(",")] == list(FIELDS)


def test_every_field_is_documented():
    assert all(isinstance(doc, str) and doc for doc in FIELDS.values())


def test_complete_fills_orders_and_keeps_extras():
    rec = complete({"status": "failed", "strategy": "header", "extra_ms": 1})
    assert list(rec)[: len(FIELDS)] == list(FIELDS)
    assert rec["status"] == "failed" and rec["p50_us"] is None and rec["extra_ms"] == 1
    assert complete(rec) == rec


def test_every_measured_phase_is_listed_and_its_fields_documented():
    """A measured phase is one class in one list: each subclass of Phase is in PHASES once, and
    every field it hands the record is a documented record field."""
    classes = [
        c for c in vars(phases).values() if isinstance(c, type) and issubclass(c, phases.Phase)
    ]
    listed = [type(p) for p in phases.PHASES]
    assert sorted(c.__name__ for c in classes if c is not phases.Phase) == sorted(
        c.__name__ for c in listed
    )
    assert len(set(listed)) == len(listed)
    for phase in phases.PHASES:
        assert phase.__doc__, type(phase).__name__
        assert set(phase.record_fields) <= set(FIELDS), type(phase).__name__


def test_the_collected_table_shows_only_fields_a_record_has():
    """``bcastbench collect`` prints a chosen subset of the record (``collect.COLUMNS``, kept
    apart because the report imports no torch): every column is a documented field, so a
    renamed or removed field cannot leave the table printing an empty column."""
    from harness.report.collect import COLUMNS

    assert set(COLUMNS) <= set(FIELDS), sorted(set(COLUMNS) - set(FIELDS))


def test_the_typed_record_names_every_field_in_order():
    assert list(Record.__annotations__) == list(FIELDS)


def test_every_committed_record_is_of_its_type():
    """The reference runs' records (every job kind they hold: ok, unsupported, varying
    workloads, emulated clusters) conform to ``Record``, field by field."""
    paths = sorted((REPO / "results").rglob("result.json"))
    assert paths, "no committed record"
    problems = {str(p.relative_to(REPO)): type_problems(json.loads(p.read_text())) for p in paths}
    assert {p: v for p, v in problems.items() if v} == {}


def test_a_value_of_the_wrong_type_is_named():
    rec = {"status": "ok", "p50_us": "fast", "correct": 1, "world_size": True}
    assert type_problems(rec) == [
        "world_size: True is bool, not <class 'int'>",
        "correct: 1 is int, not bool | None",
        "p50_us: 'fast' is str, not float | None",
    ]
    assert type_problems({"p50_us": 3, "status": "ok", "vs_floor": None}) == []  # JSON's 3.0
