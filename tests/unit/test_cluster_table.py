"""The emulated table compares ``auto`` beside the fixed strategies: its row names the strategy
it chose, and records written before auto joined the table still render."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from harness.commands import emulated_table as table

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference_emulated"


def test_auto_is_compared_and_its_choice_named():
    """The committed run: auto (told each link layout's preset) under test, the six fixed
    strategies its references; its row names what it chose on each layout."""
    text = table.table(REFERENCE)
    assert text.count("| auto → shm |") == 2  # shm's stripes win with one link per GPU too
    assert text.count("ranking (pairs within") == 2 and "same as measured" in text


def test_records_without_auto_still_render(tmp_path):
    """Records written before auto joined the table: pickled under test, no auto anywhere."""
    root = tmp_path / "emulated"
    shutil.copytree(REFERENCE, root)
    for links in ("node", "gpu"):
        path = root / links / "result.json"
        rec = json.loads(path.read_text())
        old = rec["references"].pop("pickled")
        rec.pop("auto_choice", None)
        rec.update(strategy="pickled", p50_us=old["p50_us"])
        rec["cross_node_bytes_per_call"] = old["cross_node_bytes_per_call"]
        path.write_text(json.dumps(rec))
    text = table.table(root)
    assert "| pp_first |" in text and "| pickled |" in text and "auto" not in text
