"""The pull strategies' store in the cost model: a put and a get at the store's α and β, fetch
contention as more ranks read one store, the crossings of nodes, the plans that declare it and
the fit that finds its constants. Pure arithmetic: no process group, no timing."""

from __future__ import annotations

from dataclasses import replace

import pytest

import strategies
from harness.model.prices import predict_all, predicted_cross_bytes, price_strategy
from harness.model.store_fit import StoreSample, fit_all, fit_store, predict_s
from strategies.core.cluster import (
    ClusterConf,
    ClusterError,
    LinkConf,
    StoreConf,
    cluster_from_dict,
    load_cluster,
    put_share,
)
from strategies.core.layout import Layout
from strategies.core.lazy_fields import fields_bytes
from strategies.core.plan import PayloadSpec, Plan, StoreFetch, plan_of, plan_options
from strategies.core.pricing import price
from strategies.core.store_pricing import crossing_s, fetch_s, readers, store_s
from strategies.independent_fetch import IndependentFetch
from strategies.ray_object_store import RayObjectStore
from strategies.transferqueue import TransferQueue

MB = 10**6
STORE = StoreConf(call_us=1000.0, gbytes_per_s=1.0, fetch_contention=0.5)
SPEC = PayloadSpec(tensor_bytes=4 * MB, n_tensors=4, header_bytes=512, pickle_bytes=4 * MB + 900)


def _cluster(**stores: StoreConf) -> ClusterConf:
    """Two ranks per node, a 1 GB/s inter-node link with no latency, the stores given."""
    return ClusterConf(name="t", gpus_per_node=2, inter=LinkConf(0.0, 1.0), stores=dict(stores))


def test_k_readers_pay_one_get_plus_contention_for_each_other():
    one = 1e-3 + 4 * MB / 1e9
    assert fetch_s(STORE, 4 * MB, 0) == 0.0
    assert fetch_s(STORE, 4 * MB, 1) == pytest.approx(one)
    assert fetch_s(STORE, 4 * MB, 5) == pytest.approx(one * (1 + 0.5 * 4))
    free = StoreConf(call_us=1000.0)  # no rate measured: bytes are not priced
    assert fetch_s(free, 4 * MB, 1) == pytest.approx(1e-3)


def test_readers_are_counted_per_node_or_per_replica():
    cluster = _cluster()
    ranks = (0, 1, 2, 3, 4)  # nodes {0, 1}, {2, 3}, {4}
    assert readers(StoreFetch("ray_object", ranks, MB, "node"), cluster) == 2
    assert readers(StoreFetch("transferqueue", ranks, MB, "replica"), cluster) == 4
    assert readers(StoreFetch("node_shm", (0, 1), MB, "node"), cluster) == 1


def test_crossings_per_other_node_or_per_remote_reader_share_the_writers_port():
    cluster = _cluster()
    ranks = (0, 1, 2, 3, 4)
    per_node = StoreFetch("ray_object", ranks, MB, "node")
    per_reader = StoreFetch("transferqueue", ranks, MB, "replica")
    assert crossing_s(per_node, cluster) == pytest.approx(2 * MB / 1e9)  # 2 other nodes
    assert crossing_s(per_reader, cluster) == pytest.approx(3 * MB / 1e9)  # 3 remote readers
    assert crossing_s(replace(per_node, crosses=False), cluster) == 0.0
    assert crossing_s(StoreFetch("ray_object", (0, 1), MB), cluster) == 0.0
    plan = Plan("t", stores=[per_node])
    assert predicted_cross_bytes(plan, 2) == 2 * MB
    assert predicted_cross_bytes(Plan("t", stores=[per_reader]), 2) == 3 * MB


def test_the_slowest_replica_is_the_receivers_store_term():
    cluster = _cluster(ray_object=STORE)
    small = StoreFetch("ray_object", (0, 1), MB)
    big = StoreFetch("ray_object", (2, 3), 4 * MB)
    plan = Plan("t", stores=[small, big])
    assert store_s(plan, cluster) == pytest.approx(fetch_s(STORE, 4 * MB, 1))
    pred = price(plan, cluster, Layout(tp=2, dp=2))
    receiver = {w.role: w for w in pred.local}["receiver"]
    assert receiver.store_s == pytest.approx(store_s(plan, cluster))
    assert pred.dominant().startswith("store put/get")


def test_pull_plans_declare_their_store_per_replica():
    layout = Layout(tp=2, pp=2, dp=2)
    for cls, store, scope, crosses in (
        (RayObjectStore, "ray_object", "node", True),
        (TransferQueue, "transferqueue", "replica", True),
        (IndependentFetch, "node_shm", "node", False),
    ):
        plan = plan_of(cls, layout, SPEC)
        assert [f.ranks for f in plan.stores] == [tuple(r) for r in layout.replica_groups()]
        assert {(f.store, f.scope, f.crosses) for f in plan.stores} == {(store, scope, crosses)}
    assert plan_of(RayObjectStore, Layout(tp=1), SPEC).stores == []  # nothing to fetch


def test_more_readers_of_one_store_cost_more():
    cluster = load_cluster("local")
    for name in ("ray_object_store", "transferqueue", "independent_fetch"):
        two, four = (price_strategy(name, Layout(tp=t), SPEC, cluster).total_s for t in (2, 4))
        assert four > two, name


def test_one_replica_pricing_of_a_big_dp_keeps_the_store():
    cluster = load_cluster("h200_ib")
    layout = Layout(tp=8, pp=2, dp=4)
    for name in ("ray_object_store", "transferqueue", "independent_fetch"):
        fast = price_strategy(name, layout, SPEC, cluster)
        full = price(plan_of(strategies.get_class(name), layout, SPEC, "cuda"), cluster, layout)
        assert fast.total_s == pytest.approx(full.total_s), name
    preds = predict_all(Layout(tp=8, pp=8, dp=256), SPEC, cluster, ["transferqueue"])
    assert {w.role: w for w in preds["transferqueue"].local}["receiver"].store_s > 0


def test_a_store_not_measured_is_free_but_a_node_store_still_copies():
    cluster = ClusterConf(name="t", memcpy_gbytes_per_s=2.0, h2d_gbytes_per_s=20.0)
    assert cluster.store("ray_object") == StoreConf()
    assert cluster.store("node_shm").gbytes_per_s == 2.0
    on_gpu = replace(cluster, device_copy_gbytes_per_s=100.0)
    assert on_gpu.store("node_shm").gbytes_per_s == 20.0


def test_stores_are_checked_when_the_cluster_loads():
    with pytest.raises(ClusterError, match="unknown store 'redis'; valid stores are"):
        ClusterConf(stores={"redis": StoreConf()})
    with pytest.raises(ClusterError, match=r"stores.ray_object.fetch_contention must be finite"):
        ClusterConf(stores={"ray_object": StoreConf(fetch_contention=-1.0)})
    loaded = cluster_from_dict({"stores": {"transferqueue": {"call_us": 5.0}}})
    assert loaded.store("transferqueue") == StoreConf(call_us=5.0)


def _samples(conf: StoreConf, store: str = "ray_object") -> list[StoreSample]:
    """Exact samples of ``conf`` on top of a fixed rest of the plan."""
    out = []
    for k in (1, 3):
        for n in (100_000, 1_000_000, 10_000_000):
            s = StoreSample(store, n, k, 1e-3, 0.0)
            out.append(replace(s, measured_s=predict_s(conf, s)))
    return out


def test_the_fit_recovers_the_store_it_was_made_from():
    truth = StoreConf(call_us=3000.0, gbytes_per_s=1.2, fetch_contention=0.3)
    fit = fit_store(_samples(truth))
    assert fit.conf.call_us == pytest.approx(3000.0, rel=1e-6)
    assert fit.conf.gbytes_per_s == pytest.approx(1.2, rel=1e-6)
    assert fit.conf.fetch_contention == pytest.approx(0.3)
    assert fit.median_abs_err == pytest.approx(0.0, abs=1e-9)
    one_reader = [s for s in _samples(truth) if s.readers == 1]
    assert fit_store(one_reader).conf.fetch_contention == 0.0  # nothing shows contention
    both = fit_all(_samples(truth) + _samples(truth, "transferqueue"))
    assert list(both) == ["ray_object", "transferqueue"]


def test_a_recalibration_keeps_the_fitted_stores(tmp_path):
    from harness.commands.calibrate import _kept_stores
    from harness.model.calibration_fit import write_cluster_yaml

    path = tmp_path / "local.yaml"
    assert _kept_stores(path) == {}
    write_cluster_yaml(_cluster(transferqueue=STORE), path, "a header")
    assert _kept_stores(path) == {"transferqueue": STORE}


def test_validate_states_the_pull_target_only_where_pull_records_are():
    from harness.commands.validate import _pull_row

    assert _pull_row({"pull_records": 0, "pull_median_abs_err": float("nan")}) == []
    (met,) = _pull_row({"pull_records": 18, "pull_median_abs_err": 0.12})
    assert "pull strategies (18 records) | 12.0% (met)" in met and "≤ 15 %" in met
    (missed,) = _pull_row({"pull_records": 18, "pull_median_abs_err": 0.165})
    assert "16.5% (**missed**)" in missed


LAZY = replace(
    SPEC,
    n_tensors=3,
    leaf_bytes=(MB, MB, 2 * MB),
    leaf_names=("input_ids", "nested.mask", "nested.pos"),
    non_tensor_bytes=1000,
    broadcast_non_tensor=True,
)


def test_a_reader_of_some_fields_gets_their_bytes_and_the_non_tensor_batch():
    assert fields_bytes(LAZY, ()) is None
    assert fields_bytes(LAZY, ["input_ids"]) == MB + 1000
    assert fields_bytes(LAZY, ["nested"]) == 3 * MB + 1000  # a container covers its leaves
    assert fields_bytes(LAZY, "input_ids+nested.pos") == 3 * MB + 1000  # a label's form
    assert fields_bytes(LAZY, ["nested.mask"], header=True) == MB + 1000 + 512
    with pytest.raises(ValueError, match=r"\['values'\] are not in the batch.*input_ids"):
        fields_bytes(LAZY, ["input_ids", "values"])
    with pytest.raises(ValueError, match="leaf names"):
        fields_bytes(SPEC, ["input_ids"])


def test_lazy_fetch_prices_every_byte_put_and_only_the_bytes_read():
    whole = StoreFetch("ray_object", (0, 1), 4 * MB)
    lazy = replace(whole, read_bytes=MB)
    assert whole.priced_bytes(0.5) == 4 * MB and lazy.priced_bytes(0.5) == 2.5 * MB
    assert lazy.priced_bytes(0.0) == MB  # a store whose put the plan prices apart
    cluster = _cluster(ray_object=STORE, transferqueue=STORE, node_shm=STORE)
    for cls in (RayObjectStore, TransferQueue, IndependentFetch):
        full = price(cls.plan(Layout(tp=2), LAZY), cluster, Layout(tp=2)).total_s
        some = price(cls.plan(Layout(tp=2), LAZY, fields=("input_ids",)), cluster, Layout(tp=2))
        every = cls.plan(Layout(tp=2), LAZY, fields=("input_ids", "nested"))
        assert some.total_s < full, cls.name
        assert price(every, cluster, Layout(tp=2)).total_s == pytest.approx(full, rel=1e-3)


def test_a_records_options_reach_its_plan_where_the_plan_takes_them():
    assert plan_options(RayObjectStore, {"fields": ["x"], "max_bytes": 9}) == {"fields": ["x"]}
    assert plan_options(RayObjectStore, None) == {} and plan_options(RayObjectStore, "nan") == {}


def test_readers_of_some_fields_let_the_fit_split_the_put_from_the_get():
    truth = StoreConf(call_us=2000.0, gbytes_per_s=0.8, fetch_contention=0.5, put_share=0.2)
    samples = _samples(truth, "mooncake")
    lazy = [replace(s, read_bytes=s.nbytes // 5) for s in samples]
    lazy = [replace(s, measured_s=predict_s(truth, s)) for s in lazy]
    fit = fit_store(samples + lazy).conf
    assert fit.put_share == pytest.approx(0.2, rel=1e-6)
    assert fit.gbytes_per_s == pytest.approx(0.8, rel=1e-6)
    assert fit_store(samples).conf.put_share is None  # whole reads cannot tell them apart
    with pytest.raises(ClusterError, match=r"put_share must be a share between 0 and 1"):
        StoreConf(put_share=1.5).check("stores.mooncake")
    with pytest.raises(ClusterError, match=r"put_share must be a number"):
        StoreConf(put_share="half").check("stores.mooncake")


def test_a_store_whose_calls_make_no_put_prices_only_the_bytes_read():
    """The page cache's record is written when the batch changes, not by a call: a reader of
    some fields pays for those alone, and the fit keeps that share at 0 (a free share would
    take the noise of the calibration as a put no call makes)."""
    truth = StoreConf(call_us=300.0, gbytes_per_s=4.0, fetch_contention=0.5)
    samples = _samples(truth, "page_cache")
    lazy = [replace(s, read_bytes=s.nbytes // 5) for s in samples]
    lazy = [replace(s, measured_s=predict_s(truth, s)) for s in lazy]
    assert predict_s(truth, lazy[2]) - lazy[2].rest_s == pytest.approx(
        300e-6 + lazy[2].got_bytes / 4e9
    )
    fit = fit_store(samples + lazy).conf
    assert fit.put_share == 0.0
    assert fit.gbytes_per_s == pytest.approx(4.0, rel=1e-6)
    assert fit.call_us == pytest.approx(300.0, rel=1e-6)
    assert put_share("page_cache", StoreConf(put_share=None)) == 0.0
    with pytest.raises(ClusterError, match=r"stores.page_cache.put_share must be 0 or null"):
        _cluster(page_cache=StoreConf(put_share=0.25))


def test_torch_shared_pays_its_stores_alpha_per_storage():
    from strategies.torch_shared import TorchShared

    plan = TorchShared.plan(Layout(tp=2, pp=2), SPEC)
    (fetch,) = plan.stores
    assert (fetch.store, fetch.ranks, fetch.nbytes, fetch.calls) == ("torch_shared", (0, 1, 2, 3),
                                                                    SPEC.tensor_bytes, 4)  # fmt: skip
    assert not fetch.crosses and plan.leader.copied_bytes == 0  # the copy is the store's
    cluster = replace(_cluster(torch_shared=STORE), gpus_per_node=4)  # one node: 3 readers
    assert store_s(plan, cluster) == pytest.approx(fetch_s(STORE, SPEC.tensor_bytes, 3, calls=4))
    assert fetch_s(STORE, 0, 1, calls=4) == pytest.approx(4 * fetch_s(STORE, 0, 1))
    assert TorchShared.plan(Layout(tp=1, pp=1, dp=2), SPEC).stores == []  # nobody to hand to
