"""A local Ray world (harness.worlds.ray_world): ranks as actors in a placement group run the forked world's
rank-side job unchanged, both dispatch modes deliver every replica's chunk bit for bit, a
crashing rank fails the job by name, and closing leaves no process Ray started behind.

One private Ray cluster of 2 CPUs for the module (starting it and 4 actors that import torch
and megatron-core is most of the time), also serving the ``bcastbench run world=ray`` jobs
(the run path's Ray world is this one); skipped when ray is not installed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

ray = pytest.importorskip("ray", reason='ray is an optional extra: pip install "ray==2.60.0"')
pytestmark = pytest.mark.ray  # a private Ray cluster per test: make test runs these apart
if not hasattr(ray, "init"):  # tests/verl_support.py registers a bare stand-in without Ray
    pytest.skip(
        'only a test stand-in for ray is loaded: pip install "ray==2.60.0"', allow_module_level=True
    )

# Read at collection, before this thread moves into a private cluster's network namespace.
from test_nothing_left import HOST_NETNS, is_loopback, listeners  # noqa: E402

import strategies  # noqa: E402
from harness.job.broadcast import run_job_on_rank  # noqa: E402
from harness.job.dispatch import DispatchMode, _Driver, _verify  # noqa: E402
from harness.job.dispatch_modes import FLOORS  # noqa: E402
from harness.job.execute import run_job  # noqa: E402
from harness.job.fault import Fault  # noqa: E402
from harness.job.label import Label  # noqa: E402
from harness.job.spec import JobSpec  # noqa: E402
from harness.worlds.protocol import WorldError  # noqa: E402
from harness.worlds.ray_cluster import RayConf  # noqa: E402
from strategies.core.layout import Layout  # noqa: E402

TP2PP2 = Layout(pp=2, tp=2)
SMALL = {"batch_size": 4, "seq_len": 64}


CONF = RayConf(num_cpus=3, object_store_mb=256)
"""The module's Ray world; the Hydra jobs below ask for the same (ray.num_cpus=3
ray.object_store_mb=256). 3 CPUs: the 4 ranks reserve 1, TransferQueue's controller and
storage unit 2 (logical CPUs: the host may have fewer cores)."""


@pytest.fixture(scope="module")
def _ray_worlds():
    """The module's Ray worlds, closed at its end (one, unless a test tore it down)."""
    from harness.worlds import launcher

    worlds: list = []
    try:
        yield worlds
    finally:
        launcher.close_ray()
        for world in worlds:
            world.close(kill=True)


@pytest.fixture
def ray_world(_ray_worlds):
    """The registry's live Ray world, as the run path opens it (its jobs reuse this one); a
    test after one that failed or closed the world gets a fresh world, not a dead one."""
    from harness.worlds import opening

    world = opening.ray_world(4, CONF)
    if not any(w is world for w in _ray_worlds):
        _ray_worlds.append(world)
    return world


def test_a_private_cluster_talks_over_loopback_only(ray_world):
    import ipaddress

    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert addresses and all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses
    assert ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback


def dispatch_spec(layout: Layout, modes=("leader:header", "all_ranks"), **kw) -> JobSpec:
    """A dispatch job comparing ``modes`` (the first under test), as ``bcastbench run
    target=dispatch`` makes one."""
    first = DispatchMode.parse(modes[0])
    return JobSpec(first.strategy or "", layout, dispatch=first.kind, modes=modes, **kw)


def test_modes_parse_and_floors_join():
    spec = dispatch_spec(TP2PP2)
    assert spec.scope == "dispatch+broadcast" and spec.under_test == "leader:header"
    assert [m.name for m in spec.dispatch_modes()] == [
        "leader:header",
        "all_ranks",
        "leader:floor",
        "all_ranks:raw",
    ]
    for bad, says in [
        ("leader:nope", "unknown strategy 'nope'"),
        ("broadcast", "expected 'leader:<strategy>'"),
        ("all_ranks:fast", "expected 'leader:<strategy>'"),
    ]:
        with pytest.raises(ValueError, match=says):
            DispatchMode.parse(bad)


def test_verification_names_rank_and_key():
    """The driver-side check fails a rank whose bytes differ, naming it and the key."""
    drv = _Driver.build(dispatch_spec(Layout(dp=2, pp=2, tp=2), **SMALL))
    meta = drv.global_batch.meta_info
    out = [(0, (drv.expected[d], meta)) for d in drv.replica_of]
    assert _verify(drv, DispatchMode.parse("all_ranks"), out) == []
    wrong = dict(drv.expected[0], keys=dict(drv.expected[0]["keys"]))
    wrong["keys"]["advantages"] = (*wrong["keys"]["advantages"][:2], "0" * 32)
    out[5] = (0, (wrong, meta))  # rank 5: replica 0, stage 1, tp rank 1
    problems = _verify(drv, DispatchMode.parse("all_ranks"), out)
    assert problems and all("rank 5" in p for p in problems)
    assert any("'advantages'" in p for p in problems)
    raw = [(0, h) for h in (drv.expected_raw[d] for d in drv.replica_of)]
    raw[2] = (0, "f" * 32)
    assert _verify(drv, DispatchMode.parse("all_ranks:raw"), raw) == [
        "all_ranks:raw: rank 2: received bytes differ from chunk 1"  # rank 2: replica 1
    ]


def test_dispatch_modes_deliver_every_chunk(ray_world):
    """The driver runs the broadcast job's own phases (rounds, verification) through the
    dispatch scope's Job, and the one record builder writes its record: every family's."""
    modes = ("leader:header", "all_ranks", "rdt", "edge_stages", "chain")
    spec = dispatch_spec(TP2PP2, modes, iters=2, warmup=1, **SMALL)
    record = run_job(ray_world, spec)  # raises VerificationError on any wrong byte
    assert record["floor_method"] == "leader:floor"
    assert record["scope"] == "dispatch+broadcast" and record["correct"]
    assert record["mode"] == "leader:header" and record["vs_floor"] > 0
    assert set(record["modes"]) == {*modes, *(FLOORS[DispatchMode.parse(m).kind] for m in modes)}
    for name, row in record["modes"].items():
        assert row["p50_us"] > 0 and row["rank_skew_us"] is None, name
        assert row["floor_mode"] == FLOORS[DispatchMode.parse(name).kind]
    assert record["modes"]["leader:floor"]["vs_floor"] == 1.0


def test_cgraph_delivers_every_chunk_beside_the_leader_path(ray_world):
    """A Compiled Graph (``cgraph``) carries each replica's chunk through its leader to every
    rank, verified bit for bit, beside modes that submit tasks while it is compiled; the
    graph goes with the job, and the world's next job runs tasks as before."""
    modes = ("cgraph", "leader:header")
    spec = dispatch_spec(Layout(tp=2, dp=2), modes, iters=2, warmup=1, **SMALL)
    record = run_job(ray_world, spec)
    assert record["correct"] and set(record["modes"]) == {*modes, "cgraph:raw", "leader:floor"}
    assert ray_world.run(run_job_on_rank, JobSpec("header", Layout(tp=2, dp=2), iters=1,
                                                  warmup=0, **SMALL))  # fmt: skip
    with pytest.raises(ValueError, match="rdt and cgraph cannot run in one job"):
        dispatch_spec(TP2PP2, ("rdt", "cgraph")).dispatch_modes()


def test_edge_stages_leave_the_middle_stages_empty_and_chain_fills_them(ray_world):
    """pp=4: stages 1, 2 hold nothing (edge_stages), chain makes three hops; all verified."""
    spec = dispatch_spec(Layout(pp=4), ("edge_stages", "chain"), iters=1, warmup=0, **SMALL)
    record = run_job(ray_world, spec)
    assert record["correct"] and record["mode"] == "edge_stages" and record["strategy"] is None
    assert set(record["modes"]) == {"edge_stages", "chain", "edge_stages:raw", "chain:raw"}


def test_forked_worlds_rank_job_runs_unchanged(ray_world):
    spec = JobSpec("header", TP2PP2, iters=2, warmup=1, references=("floor",), **SMALL)
    record = run_job(ray_world, spec)
    # A floor reference is timed as every raw method the layout allows (floor, floor:<method>).
    assert {Label.parse(n).strategy for n in record["references"]} == {"floor"}
    assert "floor" in record["references"] and record["floor_method"]
    assert record["strategy"] == "header" and record["collectives_leader"] >= 1


def test_bcastbench_run_world_ray_broadcast_and_dispatch(ray_world, tmp_path):
    """One Hydra sweep, in process: the broadcast alone and one dispatch job of each mode on
    the module's Ray world (reused, not restarted), each verified and recorded with its scope."""
    import json

    from harness.commands import cli
    from harness.worlds.protocol import REGISTRY

    status = cli.main(
        ["-m", "ray_job=broadcast,leader_header,all_ranks", "payload.batch_size=4",
         "payload.seq_len=64", "iters=2", "warmup=1", "references=[floor]",
         "ray.num_cpus=3", "ray.object_store_mb=256", f"hydra.sweep.dir={tmp_path}"]
    )  # fmt: skip
    assert status == 0
    assert [w for k, w in REGISTRY.worlds.items() if k[0] == "ray"] == [ray_world], (
        "the sweep must reuse the running Ray world"
    )
    recs = [json.loads(p.read_text()) for p in sorted(tmp_path.rglob("result.json"))]
    by_scope = {(r["scope"], r.get("dispatch")): r for r in recs}
    assert set(by_scope) == {
        ("broadcast", None),
        ("dispatch+broadcast", "leader"),
        ("dispatch+broadcast", "all_ranks"),
    }
    for rec in recs:
        assert rec["status"] == "ok" and rec["correct"] is True and rec["world"] == "ray", rec
        assert rec["p50_us"] > 0
    # The world's start is charged to the first job that ran on it, never again.
    assert [r["world_start_s"] for r in recs][1:] == [0.0, 0.0]
    assert by_scope[("broadcast", None)]["strategy"] == "header"
    leader = by_scope[("dispatch+broadcast", "leader")]
    assert leader["mode"] == "leader:header" and set(leader["modes"]) == {
        "leader:header",
        "leader:floor",
    }
    every = by_scope[("dispatch+broadcast", "all_ranks")]
    assert every["mode"] == "all_ranks" and set(every["modes"]) == {"all_ranks", "all_ranks:raw"}
    from harness.report.dispatch_records import load_dispatch_records

    (merged,) = load_dispatch_records(tmp_path)  # one setting: the report's single record
    assert set(merged["modes"]) == {"leader:header", "leader:floor", "all_ranks", "all_ranks:raw"}


def test_ray_dispatch_sweep_shares_one_world(ray_world, tmp_path):
    """``bcastbench run target=dispatch``, a two-job sweep on the module's Ray world (the jobs
    start nothing): each record verified, written to its job directory (``result.json``) and
    ``out``, with the command that reruns that job."""
    import json
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from harness.commands import cli
    from harness.worlds.protocol import REGISTRY

    def values(overrides: list[str]) -> dict:
        parsed = OverridesParser.create().parse_overrides(overrides)
        return {o.key_or_group: o.value() for o in parsed}

    job = ["layout=tp2pp2", "payload.seq_len=64", "iters=2", "warmup=1"]
    job += ["modes=[leader:header,all_ranks]", "ray.num_cpus=3", "ray.object_store_mb=256"]
    out = tmp_path / "all.json"
    argv = ["-m", *job, "payload.batch_size=2,4", f"out={out}", f"hydra.sweep.dir={tmp_path}"]
    assert cli.main(["run", "target=dispatch", *argv]) == 0
    assert [w for k, w in REGISTRY.worlds.items() if k[0] == "ray"] == [ray_world], (
        "the sweep must reuse the running Ray world"
    )
    records = json.loads(out.read_text())
    assert [r["batch_size"] for r in records] == [2, 4]
    for rec, path in zip(records, sorted(tmp_path.glob("*/result.json"))):
        assert json.loads(path.read_text()) == rec
        assert rec["correct"] and rec["world_size"] == 4
        assert set(rec["modes"]) == {"leader:header", "all_ranks", "leader:floor", "all_ranks:raw"}
        # Hydra writes a sweep job's values in its own escaped form (leader\:header): they
        # parse back to this job's values.
        this_job = [*job, f"payload.batch_size={rec['batch_size']}", f"out={out}"]
        command = shlex.split(rec["command"])
        assert command[:3] == ["bcastbench", "run", "target=dispatch"], rec["command"]
        assert values(command[3:]) == values(this_job), rec["command"]
    assert [r["world_start_s"] for r in records] == [0.0, 0.0]


def test_a_varying_workload_on_uneven_replicas_is_dispatched_call_by_call(ray_world, tmp_path):
    """A dispatch job is the broadcast job in the other scope, so it moves a real step too:
    seq_len cycled per call, replicas handed 3 and 1 rows, steady rounds after the sequence;
    each shape's record entry beside its own floor, every rank verified on every shape."""
    import json

    from cli_support import check_uneven_cycle_shapes

    from harness.commands import cli

    status = cli.main(
        ["-m", "ray_job=leader_header,all_ranks", "layout=tp2pp2", "layout.pp=1",
         "layout.dp=2", "iters=4", "warmup=1", "steady_iters=2", "payload.seq_len=64",
         "payload.cycle=[{seq_len:64},{seq_len:32}]", "payload.dp_split=[3,1]",
         "ray.num_cpus=3", "ray.object_store_mb=256", f"hydra.sweep.dir={tmp_path}"]
    )  # fmt: skip
    assert status == 0
    recs = [json.loads(p.read_text()) for p in sorted(tmp_path.rglob("result.json"))]
    assert {r["mode"] for r in recs} == {"leader:header", "all_ranks"}
    for rec in recs:
        check_uneven_cycle_shapes(rec)
        assert rec["scope"] == "dispatch+broadcast" and rec["dp_split"] == [3, 1]


def test_the_limit_is_on_silence_not_on_the_job(ray_world):
    """timeout_s means what it means in a forked world: a job far longer than the limit passes
    while its ranks report progress."""
    # The limit follows how fast this host answers now (under another session's load a rank
    # actor took over 6 s to answer a poll): a short job on warm ranks bounds an answer's time,
    # with room for the load to grow while the long job runs.
    spec = JobSpec("header", TP2PP2, iters=2, warmup=0, references=("floor",), **SMALL)
    ray_world.run(run_job_on_rank, spec)  # the ranks started and warm
    t0 = time.monotonic()
    ray_world.run(run_job_on_rank, spec)
    limit = max(6.0, 3 * (time.monotonic() - t0))
    # The job outlasts the limit by construction, whatever the load: rank 0 adds a quarter of
    # the limit to each of its 8 timed calls, which every rank's next call waits for, while
    # every rank reports each call.
    long = replace(spec, iters=8, fault=Fault(0, kind="delay", delay_us=int(limit / 4 * 1e6)))
    t0 = time.monotonic()
    ray_world.run(run_job_on_rank, long, timeout_s=limit)
    took = time.monotonic() - t0
    assert took > limit, f"the job ({took:.1f} s) must outlast the limit ({limit:.1f} s) to test it"


def test_a_hung_rank_is_named_with_its_phase_and_the_next_job_revives_the_ranks(ray_world):
    """One rank stops answering (outside any collective) while the others wait for it in one:
    the job fails within the limit and a few polls, naming that rank alone and its phase. The
    ranks are torn down (their processes gone) and the next job starts new ones on the same
    cluster, not a new cluster."""
    from harness.worlds import opening

    healthy = JobSpec("header", TP2PP2, iters=2, warmup=0, **SMALL)
    t0 = time.monotonic()
    ray_world.run(run_job_on_rank, healthy)
    healthy_s = time.monotonic() - t0  # what the job takes on this machine, now
    spec = replace(healthy, fault=Fault(1, 0, "hang"))
    old_ranks = list(ray_world.rank_pids)
    t0 = time.monotonic()
    with pytest.raises(WorldError) as err:
        ray_world.run(run_job_on_rank, spec, timeout_s=4)
    took = time.monotonic() - t0
    message = str(err.value)
    assert "rank 1 stopped responding for 4 s while 'timed iteration 0 of header'" in message
    assert "outside any collective" in message
    assert "rank 0" not in message and "rank 2" not in message, message
    assert took < healthy_s + 4 + 15, (took, healthy_s)
    assert not ray_world.alive
    assert not [
        p for p in old_ranks if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
    ]
    cluster = ray_world._cluster_dir
    again = opening.ray_world(4, CONF)
    assert again is ray_world and again.alive and again._cluster_dir == cluster
    assert not set(again.rank_pids) & set(old_ranks)
    again.run(run_job_on_rank, healthy)


# -- strategies that need a Ray world: the tests every strategy passes on a gloo world ---------
RAY_ONLY = [n for n in strategies.names() if strategies.get_class(n).world == "ray"]
"""The strategies the gloo-world suites leave out (``strategies.names_for_world()``): each runs
their jobs here, on the module's Ray world."""


@pytest.fixture(scope="module")
def by_value():
    """The gloo suites' rank jobs, sent to the Ray actors by value: the actors' path holds the
    repository, not tests/ (a forked rank inherits the test process's modules instead)."""
    import batchgen
    import test_fault_injection
    import test_interop
    import test_leader_failure
    import test_strategies_world
    import verl_support

    modules = (batchgen, verl_support, test_interop, test_leader_failure, test_strategies_world,
               test_fault_injection)  # fmt: skip
    for module in modules:
        ray.cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        for module in modules:
            ray.cloudpickle.unregister_pickle_by_value(module)


def ray_only(name: str) -> None:
    """Skip a Ray-only strategy this installation cannot run (its optional package)."""
    missing = strategies.get_class(name).unavailable()
    if missing is not None:
        pytest.skip(missing)


@pytest.mark.parametrize("flag", [True, False], ids=["non_tensor", "tensors_only"])
@pytest.mark.parametrize("name", RAY_ONLY)
def test_ray_only_strategies_end_with_the_leaders_batch(ray_world, by_value, name, flag):
    """The gloo suite's contract job: growing and shrinking batches of every dtype and view
    kind, non-tensor arrays both ways, bit for bit on every rank; two replicas apart."""
    ray_only(name)
    from batchgen import BatchSpec
    from test_strategies_world import FIXED, contract_job

    spec = BatchSpec(FIXED.leaves, FIXED.non_tensor, FIXED.meta, broadcast_non_tensor=flag)
    for layout in (TP2PP2, Layout(dp=2, tp=2)):
        per_rank = ray_world.run(contract_job, name, layout, spec, (3, 3, 5, 1), 7, {})
        assert [p for problems in per_rank for p in problems] == []


@pytest.mark.parametrize("name", RAY_ONLY)
def test_ray_only_strategies_carry_verl_objects(ray_world, by_value, name):
    """verl's own DataProto and worker payload (jagged NestedTensors, NonTensorData and
    NonTensorStack leaves) arrive exact, in the class each rank was handed."""
    ray_only(name)
    from test_interop import PAYLOADS, interop_job
    from verl_support import verl_modules

    verl_modules()
    for payload in sorted(PAYLOADS):
        results = ray_world.run(interop_job, name, TP2PP2, payload, timeout_s=60)
        assert {outcome for outcome, _ in results} == {"exact"}, (payload, results)
        assert [p for _, problems in results for p in problems] == [], payload


@pytest.mark.parametrize("name", [*RAY_ONLY, "ray_object_store:fields", "transferqueue:fields"])
def test_ray_only_strategies_take_the_leaders_failure_to_every_rank(ray_world, by_value, name):
    """Every leader failure case of the gloo suite (a foreign object, None, bad shapes,
    unpicklable values, after a good call too, every hostile leaf kind): each rank ends with
    the leader's batch exact, or raises an error naming the leader's, within the limit."""
    ray_only(name.partition(":")[0])  # a variant: the strategy under an option of its own
    import test_leader_failure as lf

    layout = lf.LAYOUTS["tp2pp2"]
    for case in sorted(lf.CASES):
        results, outcome = lf.run_within_limit(ray_world, lf.failure_job, name, layout, case)
        if outcome == "exact":
            assert lf.CASES[case][1] is None, f"{name} {case}: carried what it should refuse"
            assert [p for _, problems in results for p in problems] == []
        else:
            lf.check_leader_error_everywhere(results, layout, name, case, lf.CASES[case][1])
    for case in sorted(lf.AFTER_GOOD):
        results, outcome = lf.run_within_limit(ray_world, lf.after_good_job, name, layout, case)
        if outcome == "exact":
            assert {detail for _, detail in results} == {"True"}, results
        else:
            lf.check_leader_error_everywhere(results, layout, name, case, lf.AFTER_GOOD[case][1])
    if ":" in name:  # the leaf kinds' batches lack the variant's field
        return
    kinds = sorted(lf.LEAF_KINDS)
    per_kind = ray_world.run(lf.leaf_kinds_job, name, layout, kinds, timeout_s=30)
    for kind in kinds:
        per_rank = [(r[kind][0], r[kind][1]) for r in per_kind]
        must_name = lf.LEAF_KINDS[kind][1]
        if must_name is None:
            assert {o for o, _ in per_rank} == {"exact"}, (kind, per_rank)
            assert [p for _, problems in per_rank for p in problems] == [], kind
        else:
            assert {o for o, _ in per_rank} == {"raised"}, (kind, per_rank)
            lf.check_leader_error_everywhere(per_rank, layout, name, kind, must_name)


@pytest.mark.parametrize("name", RAY_ONLY)
def test_ray_only_strategies_survive_a_fault_at_every_leader_collective(ray_world, by_value, name):
    """The gloo suite's fault injection: a fault before and after each collective the leader
    posts; every rank finishes within the limit (exact, or LeaderFailed before the first), and
    the next call on the same instance is exact everywhere."""
    ray_only(name)
    import test_fault_injection as fi

    # TransferQueue's first init starts its actors (seconds): not within the 5 s limit's job.
    run_job(ray_world, JobSpec(name, TP2PP2, iters=1, warmup=0, **SMALL))
    spec = (3, (("k0", "bfloat16", 2), ("k1", "int64", 3), ("k2", "bool", 1)), True)
    for fault_type in sorted(fi.FAULTS):
        results = ray_world.run(
            fi.injection_job, name, spec, fault_type, "boom", timeout_s=fi.FAIL_WITHIN_S
        )
        fi.check(results, name, fault_type, "boom")


def plasma_objects() -> int:
    """Objects in the cluster's object store now (Ray's own memory summary)."""
    import re

    import ray
    from ray._private.internal_api import memory_summary

    # This cluster's own: another test session's may run beside it.
    summary = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    found = re.search(r"Plasma memory usage \d+ MiB, (\d+) objects", summary)
    assert found, "Ray's memory summary no longer states the object count"
    return int(found.group(1))


def test_ray_object_store_leaves_no_object_behind(ray_world):
    """Every call's object is freed when the call returns: a job of many calls (a 17 MiB batch
    each) leaves no more objects in the store than it found (earlier tests' own task results
    may still be there, or freed meanwhile; the store deletes a freed object within moments)."""
    before = plasma_objects()
    spec = JobSpec("ray_object_store", TP2PP2, iters=4, warmup=1, batch_size=768, seq_len=512)
    record = run_job(ray_world, spec)
    assert record["correct"] and record["status"] == "ok", record
    assert record["payload_bytes"] > 16 << 20
    deadline = time.monotonic() + 60  # freed objects go asynchronously, slower under load
    while plasma_objects() > before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert plasma_objects() <= before


@pytest.mark.parametrize("name", RAY_ONLY)
def test_every_port_a_pull_job_opens_is_on_loopback_or_the_clusters_own_network(ray_world, name):
    """A job of the strategy, then every listening TCP socket of every process the cluster
    runs (TransferQueue's controller and storage unit serve their ZMQ ports for as long as the
    world lives, and accept pickled data from any peer): each on a loopback address, or inside
    the cluster's own loopback-only network namespace (as root)."""
    ray_only(name)
    spec = JobSpec(name, TP2PP2, iters=2, warmup=1, **SMALL)
    assert run_job(ray_world, spec)["correct"]
    # The cluster's processes, not every child of this one: a Slurm test cluster of the same
    # session runs beside it, on ports of its own.
    cluster = [p for p in map(_process, sorted(ray_world.started_pids)) if p is not None]
    found = listeners({p.pid for p in cluster})
    print(f"{name}: listening sockets of the Ray cluster:", *found, sep="\n  ")
    assert found, "the cluster listens somewhere (GCS, raylet, workers)"
    for pid, process, address, port, netns in found:
        assert is_loopback(address) or netns != HOST_NETNS, (pid, process, address, port)
    if name == "transferqueue":
        # TransferQueue's processes: the controller and the storage unit. Each is a Ray worker
        # whose own gRPC server (one per process) binds every interface, Ray's as in every
        # worker; every other port there is TransferQueue's ZMQ, bound to Ray's node address.
        tq = [p.pid for p in cluster if _title(p).removeprefix("ray::") in TQ_ACTORS]
        assert len(tq) == 2, f"TransferQueue's controller and storage unit not found: {cluster}"
        for pid in tq:
            ports = [f for f in found if f[0] == pid]
            zmq = [f for f in ports if is_loopback(f[2])]
            assert len(zmq) >= 1 and len(ports) - len(zmq) <= 1, ports


TQ_ACTORS = {"TransferQueueController", "SimpleStorageUnit"}
"""TransferQueue's actors' process titles (``ray::<class>``)."""


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _title(proc) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


@pytest.mark.parametrize("name", ["ray_object_store", "transferqueue"])
def test_a_ray_store_lazy_fetch_of_verl_objects(ray_world, by_value, name):
    """verl's own DataProto and worker payload (jagged and non-tensor leaves) through a Ray
    store's lazy fetch: a reader of two fields gets exactly them, with the rest whole."""
    ray_only(name)
    import test_lazy_fetch as lf
    from verl_support import verl_modules

    verl_modules()
    ray.cloudpickle.register_pickle_by_value(lf)
    try:
        for payload in ("verl_dataproto_flag", "verl_worker_payload"):
            fields = ["input_ids", "position_ids"]
            said = ray_world.run(lf.verl_lazy_calls, name, payload, fields, timeout_s=60)
            assert [p for problems in said for p in problems] == [], payload
    finally:
        ray.cloudpickle.unregister_pickle_by_value(lf)


@pytest.mark.parametrize("name", ["ray_object_store", "transferqueue"])
def test_a_ray_store_lazy_fetch_gets_each_stage_only_its_fields(ray_world, name):
    """ROLL's ``RemoteBatch`` on Ray's object store (``fields``: each leaf its own object) and
    on TransferQueue (``select_fields``): a reader gets only the leaves it names, bit for bit,
    with the non-tensor batch, and moves fewer bytes than a reader of every field; the leader
    keeps its whole batch; a field the batch lacks fails every rank, naming it."""
    ray_only(name)
    import ray.cloudpickle
    import test_lazy_fetch as lf

    ray.cloudpickle.register_pickle_by_value(lf)  # the actors' path holds no tests/
    try:
        full = ray_world.run(lf.lazy_calls, name, [])
        some = ray_world.run(lf.lazy_calls, name, ["log_probs", "nested.mask"])
        said = ray_world.run(lf.unknown_field, name, what="an unknown field")
    finally:
        ray.cloudpickle.unregister_pickle_by_value(lf)
    everything = ["input_ids", "log_probs", "nested.mask", "nested.pos", "rewards"]
    assert some[0]["keys"] == everything, "the leader keeps its whole batch"
    picked = 4 * 512 * 4 + 4 * 512  # log_probs (float32) and the mask (bool)
    for rank in range(1, 4):
        assert full[rank]["keys"] == everything and full[rank]["exact"]
        assert some[rank]["keys"] == ["log_probs", "nested.mask"], some[rank]
        assert some[rank]["exact"] and some[rank]["prompt"] == [f"prompt {i}" for i in range(4)]
        assert picked <= some[rank]["copied"] < full[rank]["copied"] - 4 * 512 * 8 + picked
    for line in said:
        assert "'values'" in line and "input_ids" in line, said


# -- last: these end the module's world (the rdt failure drops its ranks, the crash closes
# the cluster), so no test after them pays for a new one -----------------------------------
def _lend_fails(ctx, data):
    raise RuntimeError(f"rank {ctx.rank}: the chunk cannot be lent")


def test_rdt_a_leader_that_cannot_lend_fails_its_receivers_by_name(ray_world):
    """The leader's lend raises: every rank handed its ref fails at once with the leader's own
    error (no rank waits for tensors that never come), and the world is torn down."""
    import ray.cloudpickle

    from harness.job.dispatch import _all_ranks_call

    here = sys.modules[__name__]  # the actors' path holds the repository, not tests/
    ray.cloudpickle.register_pickle_by_value(here)
    try:
        lent = ray_world.lend(0, _lend_fails, None)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(here)
    # A receiver left waiting would be named as silent after 60 s, not with the leader's error.
    with pytest.raises(WorldError, match="rank 0: the chunk cannot be lent"):
        ray_world.collect(
            ray_world.submit(_all_ranks_call, [(lent, False)] * 4), "rdt", timeout_s=60
        )
    assert not ray_world.alive


def _semaphores(pids) -> list[Path]:
    """The named semaphores Ray's processes of ``pids`` made (a compiled graph's channels)."""
    return [
        p for pid in pids for k in ("hdr", "obj") for p in Path("/dev/shm").glob(f"sem.{k}{pid}-*")
    ]


def test_crashing_rank_fails_by_name_and_close_leaves_nothing(ray_world):
    """After a compiled graph ran and a rank crashed, close() leaves no process the cluster
    started and none of the named semaphores its channels made (Ray unlinks those only when
    its raylet exits in order, which a stopped cluster's does not)."""
    graph = dispatch_spec(Layout(tp=2, dp=2), ("cgraph",), iters=1, warmup=0, **SMALL)
    assert run_job(ray_world, graph)["correct"]
    pids = set(ray_world.started_pids)
    assert set(ray_world.rank_pids) <= pids, "the rank actors must be among the tracked pids"
    assert _semaphores(pids), "the graph made no named semaphore: nothing here to check"
    spec = JobSpec("header", TP2PP2, iters=2, warmup=0, fault=Fault(1, 0), **SMALL)
    with pytest.raises(WorldError, match="rank 1"):
        ray_world.run(run_job_on_rank, spec, timeout_s=60)
    assert not ray_world.alive
    ray_world.close()
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert left == [], f"processes the Ray world started are still running: {left}"
    assert _semaphores(pids) == [], "the cluster's named semaphores are left in /dev/shm"
