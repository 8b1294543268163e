"""Tier 2 (real gloo worlds): whatever the replica leader holds or raises, every rank of the
replica finishes the call within seconds: it either ends with the leader's batch, exact, or
raises an error naming the leader's. No rank waits in a collective for a leader that failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from batchgen import raw_bytes
from tensordict import TensorDict

import strategies
from strategies.core.layout import Layout

LAYOUTS = {"tp2pp2": Layout(tp=2, pp=2), "tp2pp2dp2": Layout(dp=2, tp=2, pp=2)}
FAIL_WITHIN_S = 5.0
"""The job's no-progress limit: a rank still waiting after this is a hang."""


@dataclass
class ForeignProto:
    """DataProto-shaped (verl's and ROLL's attribute names), not our class."""

    batch: Any
    non_tensor_batch: dict
    meta_info: dict


class BatchRaises:
    """A leader object whose ``.batch`` raises an exception type the project never handles."""

    non_tensor_batch: dict = {}
    meta_info: dict = {}

    @property
    def batch(self):
        raise RuntimeError("the batch is gone")


def good_td(b: int = 3) -> TensorDict:
    return TensorDict({"x": torch.arange(b * 4, dtype=torch.float32).view(b, 4)}, [b])


def with_leaf(name: str, value: torch.Tensor):
    td = good_td()
    td._tensordict[name] = value  # bypasses TensorDict's own checks, as a buggy producer might
    return strategies.DataProto(td, {}, {"step": 1})


CASES = {
    # case: (what the leader holds, text every rank's error must contain; None: may succeed)
    "foreign_proto_bad_batch": (
        lambda: ForeignProto({"x": torch.zeros(3)}, {}, {"step": 1}),
        "batch must be a tensordict.TensorDict, got dict",
    ),
    "plain_tensordict": (good_td, "got TensorDict, which lacks"),
    "dict": (lambda: {"batch": good_td()}, "got dict, which lacks"),
    "none": (lambda: None, "got NoneType, which lacks"),
    "leading_dims_disagree": (
        lambda: with_leaf("bad", torch.zeros(2, 5)),
        "batch['bad'] has shape [2, 5]; expected leading dim B=3",
    ),
    "non_tensor_wrong_length": (
        lambda: strategies.DataProto(good_td(), {"uid": np.array(["a"], dtype=object)}, {}),
        "non_tensor_batch['uid'] has length 1; expected B=3",
    ),
    "meta_device": (
        lambda: with_leaf("m", torch.empty(3, 2, device="meta")),
        "batch['m'] is on device meta",
    ),
    "batch_property_raises": (BatchRaises, "RuntimeError: the batch is gone"),
    "float8": (lambda: with_leaf("f8", torch.ones(3, 2).to(torch.float8_e4m3fn)), None),
    "uint16": (lambda: with_leaf("u16", torch.arange(6).view(3, 2).to(torch.uint16)), None),
    "uint32": (lambda: with_leaf("u32", torch.arange(6).view(3, 2).to(torch.uint32)), None),
    "uint64": (lambda: with_leaf("u64", torch.arange(6).view(3, 2).to(torch.uint64)), None),
}


VARIANTS = {
    "shm:stage": ("shm", {"stage": True}),
    "shm:whole": ("shm", {"early_min_bytes": None}),
    "independent_fetch:fields": ("independent_fetch", {"fields": ["x"]}),
    "self_load:fields": ("self_load", {"fields": ["x"]}),
    "ray_object_store:fields": ("ray_object_store", {"fields": ["x"]}),
    "transferqueue:fields": ("transferqueue", {"fields": ["x"]}),
}
"""Leader paths a strategy takes only under an option, run through the same cases: shm's
staged (GPU) path packs into the leader's own buffer and copies it into the segment; its
``early_min_bytes=None`` signals every message once, whole (by default the header and blob go
before the leaves); lazy fetch (``fields``: the readers read ``good_td``'s one field, the leader
checks the batch has it, ``ray_object_store`` puts each leaf on its own, ``transferqueue``'s
readers get only that field's column)."""
FORKED_VARIANTS = [v for v, (name, _) in VARIANTS.items() if name in strategies.names_for_world()]
"""The variants the forked world runs (the Ray stores' run on a Ray world)."""


def build_strategy(name: str, groups):
    """``name`` from the registry, or a ``VARIANTS`` entry with its options."""
    name, options = VARIANTS.get(name, (name, {}))
    return strategies.get(name, groups, **options)


def failure_job(ctx, name: str, layout: Layout, case: str):
    """One call with the case's object on the leader and the ordinary entry state elsewhere;
    returns ("raised", "Type: message") or ("exact", problems) for this rank."""
    groups = ctx.groups_for(layout)
    strategy = build_strategy(name, groups)
    make, _ = CASES[case]
    expected = make()
    entry = make() if groups.is_leader else strategies.DataProto(None, {}, {"step": 1})
    if isinstance(expected, strategies.DataProto):
        entry.meta_info = dict(expected.meta_info)
    ctx.report(f"{name} {case}")
    try:
        out = strategy.get_data_input(entry)
    except Exception as exc:  # noqa: BLE001 -- the test looks at what every rank raised
        return "raised", f"{type(exc).__name__}: {exc}"
    problems = []
    for key, want in expected.batch.items(include_nested=True, leaves_only=True):
        path = key if isinstance(key, tuple) else (key,)
        if not groups.is_leader and not strategy.delivers(path):
            continue  # a reader of some fields (``fields``) gets only those
        have = out.batch.get(key)
        if have.dtype != want.dtype or not torch.equal(raw_bytes(have), raw_bytes(want)):
            problems.append(f"rank {ctx.rank}: {key!r} differs")
    return "exact", problems


@pytest.mark.world
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", [*strategies.names_for_world(), *FORKED_VARIANTS])
def test_every_rank_raises_the_leaders_error_or_ends_exact(world4, name, case):
    layout = LAYOUTS["tp2pp2"]
    results, outcome = run_within_limit(world4, failure_job, name, layout, case)
    _, must_name = CASES[case]
    if outcome == "exact":
        assert must_name is None, f"{name} {case}: carried what the leader should refuse"
        assert [p for _, problems in results for p in problems] == []
        return
    check_leader_error_everywhere(results, layout, name, case, must_name)


def run_within_limit(world, job, name: str, layout: Layout, case: str):
    """Warm the strategy's groups, then run ``job`` for ``case`` on every rank: it must end
    within FAIL_WITHIN_S with one outcome on every rank; returns (results, outcome)."""
    world.run(failure_job, name, layout, "leading_dims_disagree")  # groups built, warmed up
    t0 = time.monotonic()
    results = world.run(job, name, layout, case, timeout_s=FAIL_WITHIN_S)
    elapsed = time.monotonic() - t0
    assert elapsed < FAIL_WITHIN_S, f"{name} {case}: took {elapsed:.1f} s"
    outcomes = {outcome for outcome, _ in results}
    assert len(outcomes) == 1, f"{name} {case}: ranks disagree: {results}"
    return results, outcomes.pop()


def check_leader_error_everywhere(results, layout: Layout, name: str, case: str, must_name):
    """The leader's error names ``must_name`` (when given); every receiver raised LeaderFailed
    naming itself and the leader, carrying the leader's error as it was."""
    leader = layout.leaders()[0]
    leader_error = results[leader][1]
    assert must_name is None or must_name in leader_error, f"{name} {case}: {leader_error}"
    for rank, (_, message) in enumerate(results):
        if rank != leader:
            assert message.startswith(f"LeaderFailed: rank {rank}: "), message
            assert f"replica leader (rank {leader})" in message, message
            assert leader_error in message, f"{name} {case} rank {rank}: {message}"


def dp_failure_job(ctx, name: str, layout: Layout):
    """DP > 1: replica 0's leader holds None, replica 1's a good batch."""
    groups = ctx.groups_for(layout)
    try:
        strategy = strategies.get(name, groups)
    except NotImplementedError:
        return "refused layout", ""
    dp = layout.coords(ctx.rank)["dp"]
    if groups.is_leader:
        entry = None if dp == 0 else strategies.DataProto(good_td(), {}, {})
    else:
        entry = strategies.DataProto(None, {}, {})
    try:
        out = strategy.get_data_input(entry)
    except Exception as exc:  # noqa: BLE001
        return "raised", f"{type(exc).__name__}: {exc}"
    return "exact", str(torch.equal(out.batch["x"], good_td()["x"]))


@pytest.mark.world
@pytest.mark.parametrize("name", strategies.names_for_world())
def test_a_failing_replica_leaves_the_other_replica_exact(world8, name):
    layout = LAYOUTS["tp2pp2dp2"]
    results = world8.run(dp_failure_job, name, layout, timeout_s=FAIL_WITHIN_S)
    if {r for r, _ in results} == {"refused layout"}:
        pytest.skip(f"{name} refuses {layout.describe()}")
    for rank, (outcome, detail) in enumerate(results):
        if layout.coords(rank)["dp"] == 0:
            assert outcome == "raised" and "got NoneType" in detail, (rank, detail)
        else:
            assert (outcome, detail) == ("exact", "True"), (rank, detail)


def _unpicklable_texts(b: int = 3) -> np.ndarray:
    texts = np.empty(b, dtype=object)
    texts[:] = [lambda: None] * b  # a lambda cannot be pickled
    return texts


AFTER_GOOD = {
    # A leader path that skips work once a batch structure passed (the header family validates
    # a structure once) must still fail on every rank when the next object breaks the contract.
    "foreign_same_batch_non_tensor_list": (
        lambda: ForeignProto(good_td(), ["a", "b", "c"], {"step": 1}),
        "non_tensor_batch is list",
    ),
    "same_batch_non_tensor_wrong_length": (
        lambda: strategies.DataProto(good_td(), {"uid": np.array(["a"], dtype=object)}, {}),
        "non_tensor_batch['uid'] has length 1; expected B=3",
    ),
    "same_batch_unpicklable_non_tensor": (
        lambda: strategies.DataProto(
            good_td(), {"fn": _unpicklable_texts()}, {strategies.NON_TENSOR_FLAG: True}
        ),
        None,
    ),
}


def after_good_job(ctx, name: str, layout: Layout, case: str):
    """A good call, then the case's object on the leader, on the same strategy instance."""
    groups = ctx.groups_for(layout)
    strategy = build_strategy(name, groups)
    good = strategies.DataProto(good_td(), {}, {"step": 1})
    strategy.get_data_input(good if groups.is_leader else strategies.DataProto(None, {}, {}))
    make, _ = AFTER_GOOD[case]
    entry = make() if groups.is_leader else strategies.DataProto(None, {}, {})
    entry.meta_info = dict(make().meta_info)  # meta_info is on every rank before the call
    ctx.report(f"{name} after a good call: {case}")
    try:
        out = strategy.get_data_input(entry)
    except Exception as exc:  # noqa: BLE001 -- the test looks at what every rank raised
        return "raised", f"{type(exc).__name__}: {exc}"
    return "exact", str(torch.equal(out.batch["x"], good_td()["x"]))


@pytest.mark.world
@pytest.mark.parametrize("case", sorted(AFTER_GOOD))
@pytest.mark.parametrize("name", strategies.names_for_world())
def test_a_failure_after_a_good_call_reaches_every_rank(world4, name, case):
    layout = LAYOUTS["tp2pp2"]
    results, outcome = run_within_limit(world4, after_good_job, name, layout, case)
    _, must_name = AFTER_GOOD[case]
    if outcome == "exact":
        assert must_name is None, f"{name} {case}: carried what it should refuse"
        assert {detail for _, detail in results} == {"True"}, results
        return
    check_leader_error_everywhere(results, layout, name, case, must_name)


# -- every leaf kind, after a good call of the same structure ----------------------------------
class TaggedTensor(torch.Tensor):
    """A user's tensor subclass: its class (and whatever it carries) has no wire format."""


def kinds_td(b: int = 3) -> TensorDict:
    """The structure every kind's call shares: each odd leaf takes the place of one of these
    with its dtype and shape, so a leader that caches checks per structure meets it too."""
    x = torch.arange(b * 4, dtype=torch.float32).view(b, 4)
    return TensorDict({"x": x, "z": torch.complex(x, -x)}, [b])


def _replace(key: str, make) -> strategies.DataProto:
    td = kinds_td()
    td._tensordict[key] = make(td[key])  # bypasses TensorDict's own checks, as a producer might
    return strategies.DataProto(td, {}, {"step": 1})


LEAF_KINDS = {
    # kind: (what the leader holds, None: carried exactly, else text every error must contain)
    "conjugate_view": (lambda: _replace("z", lambda z: z.conj()), None),
    "negative_view": (lambda: _replace("x", torch._neg_view), None),
    "negative_strided_view": (
        lambda: _replace("x", lambda x: torch.complex(x, x).conj().imag),
        None,
    ),
    "zero_tensor": (lambda: _replace("x", lambda x: torch._efficientzerotensor(x.shape)), None),
    "sparse_coo": (lambda: _replace("x", lambda x: x.to_sparse()), "is a sparse COO tensor"),
    "sparse_csr": (lambda: _replace("x", lambda x: x.to_sparse_csr()), "is a sparse CSR tensor"),
    "sparse_csc": (lambda: _replace("x", lambda x: x.to_sparse_csc()), "is a sparse CSC tensor"),
    "sparse_bsr": (lambda: _replace("x", lambda x: x.to_sparse_bsr((1, 2))), "sparse BSR"),
    "sparse_bsc": (lambda: _replace("x", lambda x: x.to_sparse_bsc((1, 2))), "sparse BSC"),
    "quantized": (
        lambda: _replace("x", lambda x: torch.quantize_per_tensor(x, 0.5, 0, torch.qint8)),
        "is a quantized tensor (torch.qint8)",
    ),
    "meta_device": (lambda: _replace("x", lambda x: x.to("meta")), "is on device meta"),
    "parameter": (lambda: _replace("x", torch.nn.Parameter), "torch.nn.parameter.Parameter"),
    "user_subclass": (
        lambda: _replace("x", lambda x: x.as_subclass(TaggedTensor)),
        "TaggedTensor, a tensor subclass",
    ),
    "strided_nested": (
        lambda: _replace("x", lambda x: torch.nested.nested_tensor(list(x))),
        "nested tensor with layout torch.strided",
    ),
}
if torch.backends.mkldnn.is_available():
    LEAF_KINDS["mkldnn"] = (lambda: _replace("x", lambda x: x.to_mkldnn()), "torch._mkldnn")


def _values(t: torch.Tensor) -> torch.Tensor:
    """A leaf's values as bytes (a lazy view resolved first)."""
    if t._is_zerotensor():
        t = torch.zeros(t.shape, dtype=t.dtype)
    return raw_bytes(t.resolve_conj().resolve_neg())


def leaf_kinds_job(ctx, name: str, layout: Layout, kinds: list[str]):
    """Per kind: a good call, then the kind's leaf on the leader, on one strategy instance;
    returns per kind this rank's ("raised", text, seconds) or ("exact", problems, seconds)."""
    groups = ctx.groups_for(layout)
    strategy = strategies.get(name, groups)
    receiver = strategies.DataProto(None, {}, {"step": 1})
    out = {}
    for kind in kinds:
        good = strategies.DataProto(kinds_td(), {}, {"step": 1})
        ctx.report(f"{name}: a good call before {kind}")
        strategy.get_data_input(good if groups.is_leader else receiver)
        make, _ = LEAF_KINDS[kind]
        entry = make() if groups.is_leader else strategies.DataProto(None, {}, {"step": 1})
        ctx.report(f"{name}: {kind}")
        t0 = time.monotonic()
        try:
            got = strategy.get_data_input(entry)
        except Exception as exc:  # noqa: BLE001 -- the test looks at what every rank raised
            out[kind] = ("raised", f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
            continue
        seconds = time.monotonic() - t0
        want = make()
        problems = [
            f"rank {ctx.rank}: {key!r} differs"
            for key, leaf in want.batch.items()
            if got.batch[key].dtype != leaf.dtype
            or got.batch[key].shape != leaf.shape
            or not torch.equal(_values(got.batch[key]), _values(leaf))
        ]
        out[kind] = ("exact", problems, seconds)
    return out


@pytest.mark.world
@pytest.mark.parametrize("name", strategies.names_for_world())
def test_every_leaf_kind_is_carried_exactly_or_refused_on_every_rank(world4, name):
    """After a good call of the same structure, every leaf kind of LEAF_KINDS either arrives
    exact on every rank or is refused on every rank within the limit, naming key and kind."""
    layout = LAYOUTS["tp2pp2"]
    kinds = sorted(LEAF_KINDS)
    results = world4.run(leaf_kinds_job, name, layout, kinds, timeout_s=FAIL_WITHIN_S)
    for kind in kinds:
        per_rank = [(r[kind][0], r[kind][1]) for r in results]
        assert max(r[kind][2] for r in results) < FAIL_WITHIN_S, f"{name} {kind}: too slow"
        outcomes = {outcome for outcome, _ in per_rank}
        assert len(outcomes) == 1, f"{name} {kind}: ranks disagree: {per_rank}"
        _, must_name = LEAF_KINDS[kind]
        if must_name is None:
            assert outcomes == {"exact"}, f"{name} {kind}: {per_rank}"
            assert [p for _, problems in per_rank for p in problems] == []
            continue
        assert outcomes == {"raised"}, f"{name} {kind}: carried what it must refuse"
        check_leader_error_everywhere(per_rank, layout, name, kind, must_name)
        leader_error = per_rank[layout.leaders()[0]][1]
        key = "'z'" if kind.startswith("conj") else "'x'"
        assert f"batch[{key}]" in leader_error, f"{name} {kind}: {leader_error}"
