"""Each strategy's memory on the node, measured in a real 4-rank world: every record carries
the node's figures, the shared segment counts once, and the copies agree with each strategy's
declared footprint (``strategies.core.footprint``) within what sampling and the heap allow."""

from __future__ import annotations

import pytest

import strategies
from harness.job.execute import run_job
from harness.job.label import Label
from harness.job.node_memory import NodeMemory
from harness.job.spec import JobSpec
from harness.model import memory
from strategies.core.layout import Layout


@pytest.mark.parametrize("warmup", [0, 2], ids=["own_calls", "in_warm_up"])
def test_every_record_carries_the_nodes_memory_and_the_copies_match_the_footprints(world4, warmup):
    """Read in calls of the phase's own (every strategy dropped and built alone) or in the
    warm-up rounds (``NodeMemory.in_rounds``: the others built beside it, their memory
    subtracted): the same figures."""
    spec = JobSpec(
        strategy="shm", layout=Layout(tp=2, pp=2), batch_size=512, seq_len=2048,  # ≈ 46 MiB
        iters=1 if warmup == 0 else 2, warmup=warmup, references=("floor", "flat", "direct"),
    )  # fmt: skip
    assert NodeMemory.in_rounds(spec) == (warmup == 2)
    record = run_job(world4, spec)
    node = memory.busiest_node(spec.layout)
    assert record["node_ranks"] == 4 and record["memory_sample_ms"] > 0
    measured = []
    for name, figures in [("shm", record), *record["references"].items()]:
        if "node_peak_bytes" not in figures:
            # A raw method that holds what one broadcast holds is not measured again.
            assert Label.parse(name).is_floor and Label.parse(name).method not in (None, "shm")
            continue
        measured.append(name)
        assert figures["node_peak_bytes"] >= figures["node_idle_bytes"] > 0, name
        assert figures["rank_peak_bytes"] > 0, name
        # The harness's own footprint is the batch and little else (fingerprints, meta).
        assert 0.8 <= figures["harness_copies"] <= 2.0, (name, figures["harness_copies"])
        label = Label.parse(name)
        cls = strategies.get_class(label.strategy)
        options = {"method": "shm"} if label.method == "shm" else {}
        declared = cls.footprint_for(**options).node_copies(node.leaders, node.receivers)
        assert abs(figures["node_copies"] - declared) <= 0.35 * declared + 0.5, (
            name, figures["node_copies"], declared
        )  # fmt: skip
    assert {"floor", "floor:shm", "flat", "direct"} <= set(measured), measured
    # shm's readers view the segment: its slots are counted once on the node, not per reader.
    assert record["node_shm_bytes"] <= 2.5 * record["payload_bytes"]
