"""The cost model's Ray dispatch pricing (harness.model.dispatch_prices), pure: no Ray, no process
group. What crosses between nodes, how the phases add up, which preset values are read, and
that bad inputs are named."""

from __future__ import annotations

import pytest

from harness.model.dispatch_prices import (
    RayCostConf,
    example_answer,
    load_ray_costs,
    price_all_ranks,
    price_leader,
    replica_nodes,
)
from strategies.core.cluster import ClusterConf, ClusterError, LinkConf, load_cluster
from strategies.core.layout import Layout

MIB = 2**20
RAY = RayCostConf(
    name="t", put_call_us=1000, put_gbytes_per_s=1.0, put_raw_call_us=500,
    put_raw_gbytes_per_s=2.0, get_call_us=2000, get_gbytes_per_s=0.5, get_raw_call_us=100,
    get_raw_gbytes_per_s=0.0, call_us=300, call_per_actor_us=100, transfer_call_us=50,
    calibrated_ranks=4, calibrated_cores=2,
)  # fmt: skip
TWO_NODES = ClusterConf(name="two", gpus_per_node=2, inter=LinkConf(500, 0.125), cpu_cores=0)


def test_all_ranks_crosses_once_per_far_node_of_each_replica():
    lay = Layout(pp=2, tp=2)  # ranks 0,1 on node 0; 2,3 (stage 1) on node 1
    assert replica_nodes(lay, 2) == [{0, 1}]
    cost = price_all_ranks(lay, 16 * MIB, TWO_NODES, RAY)
    assert cost.cross_node_bytes == 16 * MIB
    assert cost.transfer_s == pytest.approx(50e-6 + 16 * MIB / 0.125e9)
    dp2 = price_all_ranks(Layout(dp=2, pp=2, tp=2), 16 * MIB, TWO_NODES, RAY)
    # dp2 on 4 nodes: each replica spans two nodes, node 0 serves the three it is not.
    assert dp2.cross_node_bytes == 3 * 16 * MIB
    one_node = price_all_ranks(lay, 16 * MIB, load_cluster("local"), RAY)
    assert one_node.cross_node_bytes == 0 and one_node.transfer_s == 0


def test_phases_add_up_and_sharing_follows_the_calibration():
    n = 8 * MIB
    cost = price_all_ranks(Layout(pp=2, tp=2), n, TWO_NODES, RAY, raw=False, host_cores=2)
    assert cost.put_s == pytest.approx(1e-3 + n / 1e9)
    assert cost.call_s == pytest.approx(300e-6 + 4 * 100e-6)
    # Calibrated with 4 getters on 2 cores (2× sharing): one node's 2 getters on 2 cores run
    # at the single-getter rate, half the fitted figure.
    assert cost.get_s == pytest.approx((2e-3 + n / 0.5e9) / 2)
    assert cost.total_s == pytest.approx(cost.put_s + cost.call_s + cost.transfer_s + cost.get_s)
    raw = price_all_ranks(Layout(pp=2, tp=2), n, TWO_NODES, RAY, raw=True, host_cores=2)
    assert raw.get_s == pytest.approx(100e-6 / 2)  # rate 0: read in place, no per-byte cost


def test_leader_pays_the_broadcast_and_only_far_leaders_cross():
    lay = Layout(dp=2, pp=2, tp=2)  # leaders 0 (node 0) and 4 (node 2)
    cost = price_leader(lay, 4 * MIB, TWO_NODES, RAY, "header", broadcast_s=0.25)
    assert cost.mode == "leader:header" and cost.broadcast_s == 0.25
    assert cost.cross_node_bytes == 4 * MIB
    floor = price_leader(lay, 4 * MIB, TWO_NODES, RAY, "floor", broadcast_s=0.1)
    assert floor.put_s == pytest.approx(2 * (500e-6 + 4 * MIB / 2e9))  # the raw put


def test_gpu_clusters_add_a_host_to_device_copy_per_receiver():
    h200 = load_cluster("h200_ib")
    lay = Layout(pp=2, tp=8)
    cost = price_all_ranks(lay, 64 * MIB, h200, RAY)
    assert cost.get_s == pytest.approx(RAY.get_s(64 * MIB, False) + 64 * MIB / h200.h2d_bytes_per_s)


def test_presets_load_and_bad_values_are_named(tmp_path):
    local = load_ray_costs("local")
    assert local.calibrated_ranks >= 1 and local.call_per_actor_us > 0
    with pytest.raises(ClusterError, match="put_call_us"):
        RayCostConf(put_call_us=-1)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nput_us: 3\n")
    with pytest.raises(ClusterError, match="unknown keys \\['put_us'\\]"):
        load_ray_costs(bad)
    with pytest.raises(ClusterError, match="no Ray cost file"):
        load_ray_costs("nope")


def test_example_answer_names_node_counts_or_never():
    rows = [
        {"batch_size": 8, "payload_bytes": MIB, "nodes": n, "all_ranks_wins": n == 16, "tie": False}
        for n in (16, 32)
    ] + [
        {"batch_size": 64, "payload_bytes": 8 * MIB, "nodes": n, "all_ranks_wins": False,
         "tie": n == 16}
        for n in (16, 32)
    ]  # fmt: skip
    text = example_answer(rows).splitlines()
    assert text[0].endswith("all_ranks wins at [16] nodes only")
    assert "never overtakes" in text[1] and "even, at [16] nodes" in text[1]


def _record(p50_ms: dict[str, float], batch_size: int = 48) -> dict:
    """A dispatch record as harness.commands.ray_emulated writes it (two nodes, one link each)."""
    modes = {
        m: {"p50_us": v * 1e3, "p90_us": v * 1.1e3, "cross_node_bytes_per_call": 1e6}
        for m, v in p50_ms.items()
    }
    return {
        "scope": "dispatch+broadcast", "layout": "dp1×pp2×tp2×cp1 (tp-cp-ep-dp-pp)", "dp": 1,
        "pp": 2, "tp": 2, "cp": 1, "order": "tp-cp-ep-dp-pp", "payload": "rl_rollout",
        "batch_size": batch_size, "seq_len": 512, "payload_bytes": batch_size * 23_000,
        "iters": 3, "modes": modes, "emulate_nodes": 2, "emulate_links": "node",
        "emulate_rate_mbit": 1000, "emulate_ranks_per_node": 2, "command": "python -m x",
    }  # fmt: skip


def test_compare_prices_every_measured_mode():
    from harness.report.dispatch_model import compare

    rec = _record({"leader:header": 40, "all_ranks": 30, "leader:floor": 30, "all_ranks:raw": 25})
    rows = compare([rec], RAY)
    assert [r["mode"] for r in rows] == list(rec["modes"])
    assert all(r["cluster"] == "emulated" and r["predicted_ms"] > 0 for r in rows)
    by_mode = {r["mode"]: r for r in rows}
    assert (
        by_mode["all_ranks"]["predicted_cross_mb"] < by_mode["leader:header"]["predicted_cross_mb"]
    )


def test_ray_report_names_the_winner_and_draws_the_figure(tmp_path):
    import json

    from harness.report.ray_report import write_ray_report

    recs = [
        _record({"leader:header": 40, "leader:pp_first": 31, "all_ranks": 30,
                 "leader:floor": 20, "all_ranks:raw": 25}),
        _record({"leader:header": 300, "all_ranks": 200, "leader:floor": 250,
                 "all_ranks:raw": 150}, batch_size=704),
    ]  # fmt: skip
    (tmp_path / "emulated_node.json").write_text(json.dumps(recs))
    text = write_ray_report(tmp_path).read_text()
    assert (tmp_path / "ray_dispatch_p50_vs_payload.png").stat().st_size > 10_000
    # No paired interval between modes: the fastest is named, no winner claimed.
    assert "no interval: all_ranks fastest, leader:pp_first 1.03× its p50" in text
    assert "no interval: all_ranks fastest, leader:header 1.50× its p50" in text
    assert "**all_ranks**" not in text
    assert "python -m x" in text and "model ms" in text


def test_the_calibrations_fits_recover_what_made_their_points():
    from harness.commands.ray_calibrate import fitted
    from harness.model.least_squares import nonneg_lstsq, relative_fit

    sizes = [1e5, 1e6, 1e7, 1e8]
    points = {
        "put": [(n, 1e-3 + n / 1e9) for n in sizes],
        "call": [(k, 2e-4 + k * 1e-4) for k in (1, 2, 3, 4)],
        # α + (k − 1)·(α_r + n·β): 4 ms, 1 ms a more rank, 2 GB/s
        "lend": [(n, k, 4e-3 + (k - 1) * (1e-3 + n / 2e9)) for n in sizes for k in (2, 4)],
        # α + n·β_w + n·β_r·max(1, k / 2 cores): 0.5 ms, 0.25 and 4 GB/s
        "channel": [
            (n, k, 5e-4 + n / 2.5e8 + n / 4e9 * max(1, k / 2)) for n in sizes for k in (2, 4)
        ],  # fmt: skip
    }
    for term in ("put_raw", "get", "get_raw"):
        points[term] = points["put"]
    for term in ("lend", "channel"):
        points[f"{term}_raw"] = points[term]
    conf = fitted(points, cores=2)
    assert conf["put_call_us"] == pytest.approx(1000.0) and conf["put_gbytes_per_s"] == 1.0
    assert conf["lend_call_us"] == pytest.approx(4000.0)
    assert conf["lend_per_rank_us"] == pytest.approx(1000.0)
    assert conf["lend_gbytes_per_s"] == pytest.approx(2.0)
    assert conf["channel_call_us"] == pytest.approx(500.0)
    assert conf["channel_write_gbytes_per_s"] == pytest.approx(0.25)
    assert conf["channel_read_gbytes_per_s"] == pytest.approx(4.0)
    # A negative term is noise: the best non-negative fit drops it.
    assert relative_fit([[1, 1, 1], [1, 2, 3]], [3, 2, 1])[1] == 0.0
    coef, _ = nonneg_lstsq([[1, 1], [1, 1]], [2, 2])  # copies: the later one stays 0
    assert list(coef) == pytest.approx([2.0, 0.0])


def test_rdt_and_cgraph_use_their_fits_and_fall_back_without_them():
    from dataclasses import replace

    from harness.model.dispatch_prices import price_cgraph, price_rdt
    from harness.payload import generated
    from strategies.core.plan import spec_of

    cluster = load_cluster("local")
    spec = spec_of(generated.make("rl_rollout", 8, 64, 0, None))
    n = spec.tensor_bytes + spec.non_tensor_bytes
    bare = RayCostConf(put_call_us=100.0, get_call_us=100.0, call_us=50.0)
    lent = replace(bare, lend_call_us=4000.0, lend_per_rank_us=1000.0, lend_gbytes_per_s=2.0)
    assert bare.lend_s(n, 4, raw=False) is None and bare.channel_s(n, n, 1.0, False) is None
    tp2pp2 = Layout(tp=2, pp=2)
    fitted_cost = price_rdt(tp2pp2, spec, cluster, lent)
    assert fitted_cost.broadcast_s == pytest.approx(4e-3 + 3 * (1e-3 + n / 2e9))
    assert fitted_cost.call_s == 0.0  # the lend's round of tasks is in its fit
    assert price_rdt(tp2pp2, spec, cluster, bare).call_s > 0  # the plan's sends and rounds
    chan = replace(bare, channel_call_us=500.0, channel_write_gbytes_per_s=1.0,
                   channel_read_gbytes_per_s=2.0)  # fmt: skip
    cost = price_cgraph(tp2pp2, n, cluster, chan, host_cores=2)
    assert cost.total_s == pytest.approx(5e-4 + n / 1e9 + n / 2e9 * 2)  # 4 readers, 2 cores


def test_a_ray_cost_file_that_is_not_yaml_is_named(tmp_path):
    from harness.model.dispatch_prices import load_ray_costs

    noise = tmp_path / "noise.yaml"
    noise.write_bytes(bytes(range(128, 256)) * 8)
    with pytest.raises(ClusterError, match="noise.yaml: not a readable Ray cost file"):
        load_ray_costs(noise)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ClusterError, match="list.yaml: a Ray cost file is a mapping"):
        load_ray_costs(listed)
