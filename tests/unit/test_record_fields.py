"""One record shape: ``records.FIELDS`` is the list the README documents, and ``complete``
gives any record every field, in that order, without dropping one it does not list."""

from __future__ import annotations

import re

from harness.paths import REPO
from harness.run.records import FIELDS, complete


def test_readme_lists_exactly_the_record_fields():
    readme = (REPO / "README.md").read_text()
    section = readme.split("### Record fields (`result.json`)", 1)[1].split("\n- ", 1)[0]
    (listed,) = re.findall(r"`([a-z_0-9,\s]+)`", section.replace("\n", " "))
    assert [name.strip() for name in listed.split(",")] == list(FIELDS)


def test_every_field_is_documented():
    assert all(isinstance(doc, str) and doc for doc in FIELDS.values())


def test_complete_fills_orders_and_keeps_extras():
    rec = complete({"status": "failed", "strategy": "header", "extra_ms": 1})
    assert list(rec)[: len(FIELDS)] == list(FIELDS)
    assert rec["status"] == "failed" and rec["p50_us"] is None and rec["extra_ms"] == 1
    assert complete(rec) == rec
