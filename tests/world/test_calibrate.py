"""Calibration on a real two-rank world: the written preset loads and prices what was fitted."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from strategies.core.cluster import load_cluster
from strategies.core.formulas import coefficients

MIB = 2**20


@pytest.mark.world
def test_calibrate_short_world_of_two(tmp_path: Path):
    from harness.commands.calibrate import SHORT_SIZES, calibrate

    out = tmp_path / "local.yaml"
    cluster, fits, samples = calibrate(
        world_size=2, sizes=SHORT_SIZES, reps=5, out=out, host_bytes=2 * MIB, verbose=False
    )
    loaded = load_cluster(out)  # written, loads, validates
    assert loaded.name == "local" and set(loaded.intra_by_kind) == {
        "broadcast",
        "scatter",
        "all_gather",
    }
    assert "bcastbench calibrate" in out.read_text().splitlines()[0]
    # The calibration world is recorded as fields (the oversubscription factor's reference),
    # and the per-call host costs were measured in it.
    import os

    assert loaded.calibrated_ranks == 2 and loaded.cpu_cores == (os.cpu_count() or 1)
    assert loaded.pickle_call_s > 0 and loaded.unpickle_call_s > 0 and loaded.pack_call_s > 0
    assert loaded.signal_s > 0  # shm's node-local signal, timed in the same world
    assert not list(tmp_path.glob(".local.yaml.*")), "temp file left behind"
    assert len(samples) == 3 * len(SHORT_SIZES)
    for kind, fit in fits.items():
        assert fit.link.alpha_s >= 0 and math.isfinite(fit.link.beta_s_per_byte), kind
        # prediction = model: the written file prices each measured shape as the fit does
        for s in (s for s in samples if s.kind == kind):
            a, b = coefficients(kind, s.group_size, s.nbytes, **loaded.algorithms())
            link = loaded.link(kind, crosses_nodes=False)
            fitted = a * fit.link.alpha_s + b * fit.link.beta_s_per_byte
            assert a * link.alpha_s + b * link.beta_s_per_byte == pytest.approx(fitted, rel=1e-3)
