"""The emulated table compares ``auto`` beside the fixed strategies: its row names the strategy
it chose, and records written before auto joined the table still render."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from harness.cluster import table

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference_emulated"


def test_auto_is_compared_and_its_choice_named(tmp_path):
    root = tmp_path / "emulated"
    shutil.copytree(REFERENCE, root)
    for links, choice in (("node", "pp_first"), ("gpu", "scatter_allgather")):
        path = root / links / "result.json"
        rec = json.loads(path.read_text())
        # The job as run_jobs now runs it: auto under test, the old job's strategy a reference.
        refs = rec["references"]
        refs[rec["strategy"]] = {k: rec[k] for k in ("p50_us", "cross_node_bytes_per_call")}
        refs.pop("floor", None)
        rec.update(strategy="auto", auto_choice=choice, p50_us=refs[choice]["p50_us"])
        rec["cross_node_bytes_per_call"] = refs[choice]["cross_node_bytes_per_call"]
        path.write_text(json.dumps(rec))
    text = table.table(root)
    assert "| auto → pp_first |" in text and "| auto → scatter_allgather |" in text
    assert text.count("ranking (pairs within") == 2 and "same as measured" in text


def test_records_without_auto_still_render():
    text = table.table(REFERENCE)
    assert "| pp_first |" in text and "auto" not in text
