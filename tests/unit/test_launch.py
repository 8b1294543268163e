"""Tier 1: which launcher runs a job, read from plain environment dicts (nothing exported), and
the name a record gives a layout."""

from __future__ import annotations

import pytest

from harness.run.launch import EMULATED, FORKED, JOINED, Launch, detect
from harness.run.records import layout_name
from strategies.core.layout import SEED_ORDER, Layout


@pytest.mark.parametrize(
    "env, emulate, expected",
    [
        ({}, False, Launch(FORKED, "local")),
        ({}, True, Launch(EMULATED, "emulated")),
        (
            {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4"},
            False,
            Launch(JOINED, "torchrun", 3, 4),
        ),
        # A bare env:// world (RANK, WORLD_SIZE, MASTER_ADDR) is joined the same way, and an
        # emulated job's workers are ranks of such a world, not drivers of another cluster.
        (
            {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"},
            True,
            Launch(JOINED, "torchrun", 1, 2),
        ),
        ({"RANK": "1", "WORLD_SIZE": "2"}, False, Launch(FORKED, "local")),
        (
            {
                "SUBMITIT_EXECUTOR": "slurm",
                "SLURM_NTASKS": "8",
                "SLURM_PROCID": "5",
                "SLURM_STEP_ID": "0",
                "SLURM_STEP_NUM_TASKS": "8",
            },
            False,
            Launch(JOINED, "submitit", 5, 8),
        ),  # fmt: skip
        (
            {
                "SUBMITIT_EXECUTOR": "local",
                "SUBMITIT_LOCAL_NTASKS": "4",
                "SUBMITIT_LOCAL_GLOBALID": "2",
            },
            False,
            Launch(JOINED, "submitit", 2, 4),
        ),  # fmt: skip
        ({"SUBMITIT_EXECUTOR": "slurm", "SLURM_NTASKS": "1"}, False, Launch(FORKED, "local")),
        (
            {"SLURM_STEP_ID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"},
            False,
            Launch(JOINED, "srun", 3, 4),
        ),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}, True, Launch(EMULATED, "emulated")),
    ],
)
def test_detect(env, emulate, expected):
    assert detect(env, emulate=emulate) == expected
    assert detect(env, emulate=emulate).writes_records == (expected.rank == 0)


@pytest.mark.parametrize(
    "layout, name",
    [
        (Layout(pp=2, tp=2), "tp2pp2"),
        (Layout(pp=2, tp=1), "pp2"),  # `layout=tp2pp2 layout.tp=1` is not tp2pp2
        (Layout(dp=2, pp=2, tp=2), "tp2pp2dp2"),
        (Layout(tp=2, cp=2), "tp2cp2"),
        (Layout(pp=2, cp=2), "pp2cp2"),
        (Layout(), "tp1"),
        (Layout(dp=2, pp=2, tp=2, order=SEED_ORDER), f"tp2pp2dp2@{SEED_ORDER}"),
    ],
)
def test_layout_name_describes_the_shape(layout, name):
    assert layout_name(layout) == name


def test_record_of_an_overridden_preset_names_its_shape():
    """The record path itself (records.build), for a preset overridden to another shape."""
    from harness.run import records
    from harness.run.runner import JobSpec

    spec = JobSpec("header", Layout(pp=2, tp=1, order=SEED_ORDER))
    rec = records.build(spec, {"unsupported": "header: not here"})
    assert (rec["layout"], rec["world_size"], rec["order"]) == (f"pp2@{SEED_ORDER}", 2, SEED_ORDER)
    assert rec["status"] == "unsupported" and rec["supported"] is False
    failed = records.failed(spec, RuntimeError("rank 1 exited\n--- traceback ---"))
    assert failed["status"] == "failed" and failed["error"] == "rank 1 exited"
    assert {k: failed[k] for k in ("layout", "tp", "pp")} == {
        "layout": f"pp2@{SEED_ORDER}",
        "tp": 1,
        "pp": 2,
    }
