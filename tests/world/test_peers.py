"""The peer reproductions (Megatron ``broadcast_data``, vLLM ``broadcast_tensor_dict``,
tensordict's ``broadcast``, AReaL's ``broadcast_tensor_container``, MindSpeed-RL's per-key
broadcast, PP-first) on real gloo worlds: bit-exact on every rank, plans equal
to the recorded collectives, clear errors where the originals cannot go, and tensordict's bug
pinned where it is.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import strategies
from harness.job.execute import run_job
from harness.job.label import Label
from harness.job.spec import JobSpec
from harness.job.verification import compare, digest
from harness.worlds.forked import ForkedWorld as World
from harness.worlds.protocol import WorldError
from strategies import NON_TENSOR_FLAG, ContractError, DataProto
from strategies.core.layout import SEED_ORDER, Layout
from strategies.core.plan import PayloadSpec, spec_of
from strategies.core.trace import Recorder

PEERS = (
    "megatron_broadcast_data",
    "vllm_tensor_dict",
    "tensordict_broadcast",
    "areal_broadcast",
    "mindspeed_transfer_dock",
    "pp_first",
)
TP2PP2 = Layout(pp=2, tp=2)
PP2CP2 = Layout(pp=2, cp=2)
DP2_SEED = Layout(dp=2, pp=2, tp=2, order=SEED_ORDER)


# -- payloads and plans ------------------------------------------------------------------------
def exotic_batch(seed: int, with_non_tensor: bool = True, zero_size: bool = False) -> DataProto:
    """Every dtype the contract names, a non-contiguous leaf, views of larger storages, a
    nested key, odd byte counts (padding must not leak) and non-tensor object arrays."""
    g = torch.Generator().manual_seed(seed)
    b = 3
    wide = torch.randn(b, 10, generator=g)
    parent = torch.randint(-(2**40), 2**40, (20_000, 7), generator=g)  # 1.1 MB parent
    leaves = {
        "bool": torch.rand(b, 5, generator=g) > 0.5,
        "uint8": torch.randint(0, 256, (b, 3), generator=g).to(torch.uint8),
        "int8": torch.randint(-128, 128, (b, 1, 2), generator=g).to(torch.int8),
        "int32": torch.randint(-(2**31), 2**31 - 1, (b, 2, 2, 2), generator=g).to(torch.int32),
        "int64_view": parent[2 : 2 + b],  # contiguous view: only its rows may travel
        "float16": torch.randn(b, 7, generator=g).half(),
        "bfloat16": torch.randn(b, 4, generator=g).bfloat16(),
        "float32_strided": wide[:, ::3],  # non-contiguous
        "float64_t": torch.randn(5, b, generator=g).double().t(),  # transposed view
        "complex64": torch.randn(b, 3, dtype=torch.complex64, generator=g),
        "nested": {"inner": {"mask": torch.rand(b, 9, generator=g) > 0.2}},
    }
    if zero_size:
        leaves["empty_cols"] = torch.empty(b, 0)
    td = TensorDict(leaves, batch_size=[b])
    rng = np.random.default_rng(seed)
    texts = np.array([f"prompt {i} π {rng.integers(1000)}" for i in range(b)], dtype=object)
    objs = np.empty(b, dtype=object)
    objs[:] = [{"i": i, "tags": ["a", None]} for i in range(b)]
    meta = {"global_step": 7, NON_TENSOR_FLAG: with_non_tensor}
    return DataProto(td, {"prompt_text": texts, "extra": objs}, meta)


def leaf_bytes(dp: DataProto) -> tuple[int, ...]:
    return tuple(
        t.numel() * t.element_size()
        for _, t in dp.batch.items(include_nested=True, leaves_only=True)
    )


def payload_spec(dp: DataProto) -> PayloadSpec:
    return spec_of(dp)  # exact, with per-leaf sizes and the codec's padding folded in


def plan_of(name: str, layout: Layout, dp: DataProto):
    cls = strategies.get_class(name)
    spec = payload_spec(dp)
    if name in ("vllm_tensor_dict", "tensordict_broadcast"):
        return cls.plan(layout, spec, leaf_bytes=leaf_bytes(dp))
    if name == "areal_broadcast":  # its dict nodes follow the keys' nesting
        keys = tuple(k if isinstance(k, tuple) else (k,) for k in dp.batch.keys(True, True))
        return cls.plan(layout, spec, leaf_bytes=leaf_bytes(dp), leaf_keys=keys)
    if name == "mindspeed_transfer_dock":  # B and the shape slots size its small tensors
        ndim = max(2, *(t.dim() for t in dp.batch.values(True, True)))
        return cls.plan(layout, spec, batch_size=dp.batch.batch_size[0], shape_slots=ndim)
    return cls.plan(layout, spec)


def assert_plan_matches(name: str, layout: Layout, dp: DataProto, recorded: list[list]) -> None:
    plan = plan_of(name, layout, dp)
    for rank, comms in enumerate(recorded):
        planned = plan.for_rank(rank)
        assert len(planned) == len(comms), (name, rank, planned, comms)
        for p, (kind, ranks, root, nbytes) in zip(planned, comms):
            assert (p.kind, p.ranks, p.root) == (kind, ranks, root), (name, rank, p, comms)
            if p.exact:
                assert p.nbytes == nbytes, (name, rank, p, nbytes)


# -- rank-side jobs ----------------------------------------------------------------------------
def exotic_job(ctx, name: str, layout: Layout, with_non_tensor: bool) -> dict:
    """Two calls (the first warms pp_first's announced size), the second recorded and checked."""
    groups = ctx.groups_for(layout)
    replica = layout.coords(ctx.rank)["dp"]
    full = exotic_batch(10 + replica, with_non_tensor)
    strategy = strategies.get(name, groups)
    strategy.get_data_input(full.entry_state(groups.is_leader))
    dist.barrier()
    entry = full.entry_state(groups.is_leader)
    with Recorder() as rec:
        out = strategy.get_data_input(entry)
    expected = digest(full, with_non_tensor)
    got = digest(out, with_non_tensor)
    problems = compare(expected, got, ctx.rank, name)
    if not with_non_tensor and not groups.is_leader and out.non_tensor_batch:
        problems.append(f"rank {ctx.rank}: non_tensor_batch arrived although not flagged")
    return {
        "problems": problems,
        "comms": [(c.kind, c.ranks, c.root, c.nbytes) for c in rec.comms],
        "view_kept_parent": _view_result_small(out),
    }


def _view_result_small(out: DataProto) -> bool:
    """A received view must not carry its sender's parent storage (SGLang's 518× bug)."""
    t = out.batch["int64_view"]
    return t.untyped_storage().nbytes() < 20_000 * 7 * 8


def error_job(ctx, name: str, layout: Layout, batch_kind: str) -> str:
    groups = ctx.groups_for(layout)
    full = exotic_batch(1, zero_size=batch_kind == "zero_size")
    if batch_kind == "ndim5":
        full.batch["deep"] = torch.zeros(3, 1, 1, 1, 1)
    strategy = strategies.get(name, groups)
    try:
        strategy.get_data_input(full.entry_state(groups.is_leader))
    except ContractError as exc:
        return str(exc)
    return ""


def tensordict_library_job(ctx, ranks: list[int], src: int) -> tuple[str, str] | None:
    """Call ``TensorDict.broadcast`` directly on a subgroup; what each member saw."""
    key = ("subgroup", tuple(ranks))
    if key not in ctx.cache:
        ctx.cache[key] = dist.new_group(ranks)  # every rank creates every group
    if ctx.rank not in ranks:
        return None
    sent = TensorDict({"a": torch.arange(6.0).reshape(3, 2)}, batch_size=[3])
    td = sent if ctx.rank == ranks[0] else TensorDict()
    try:
        out = td.broadcast(src=src, group=ctx.cache[key])
    except Exception as exc:  # the library's failure is what is being recorded
        return type(exc).__name__, str(exc)
    return "ok", str(torch.equal(out["a"], sent["a"]))


# -- tests: the harness job on 4 ranks ---------------------------------------------------------
@pytest.mark.parametrize("layout", [TP2PP2, PP2CP2], ids=["tp2pp2", "pp2cp2"])
@pytest.mark.parametrize("name", PEERS)
def test_runner_job_bit_exact(world4, name, layout):
    spec = JobSpec(strategy=name, layout=layout, batch_size=4, seq_len=64, iters=2, warmup=1)
    record = run_job(world4, spec)
    # A floor reference is timed as every raw method the layout allows (floor, floor:<method>).
    assert {Label.parse(n).strategy for n in record["references"]} == {"floor", "pickled"}
    assert record["strategy"] == name and record["p50_us"] > 0


@pytest.mark.parametrize("with_non_tensor", [True, False], ids=["non_tensor", "tensors_only"])
@pytest.mark.parametrize("layout", [TP2PP2, PP2CP2], ids=["tp2pp2", "pp2cp2"])
@pytest.mark.parametrize("name", PEERS)
def test_exotic_batch_bit_exact_and_plan(world4, name, layout, with_non_tensor):
    results = world4.run(exotic_job, name, layout, with_non_tensor)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, problems
    assert all(r["view_kept_parent"] for r in results[1:])
    full = exotic_batch(10, with_non_tensor)
    assert_plan_matches(name, layout, full, [r["comms"] for r in results])


def test_collective_counts_follow_the_claims(world4):
    """Count collectives, not just values: per hop megatron is 2 + 1 + dtypes, vLLM 2 + one
    per tensor, tensordict 2 + 1 (+2 for non-tensor data), pp_first 1 per hop; AReaL one hop
    of 2 per dict node + 5 per tensor + 4 (batch size) + 4 (non-tensor data); MindSpeed 2
    (table) + per hop 1 (index) + 6 per key."""
    full = exotic_batch(10, True)
    n_tensors = len(leaf_bytes(full))
    n_dtypes = len(payload_spec(full).dtype_bytes)
    leader = {}
    for name in PEERS:
        leader[name] = len(world4.run(exotic_job, name, TP2PP2, True)[0]["comms"])
    assert leader["megatron_broadcast_data"] == 2 * (3 + n_dtypes)
    assert leader["vllm_tensor_dict"] == 2 * (2 + n_tensors)
    assert leader["tensordict_broadcast"] == 5
    assert leader["pp_first"] == 2
    assert leader["areal_broadcast"] == 2 * 3 + 5 * n_tensors + 4 + 4  # top, nested, inner
    assert leader["mindspeed_transfer_dock"] == 2 + 2 * (1 + 6 * n_tensors)


def test_pp_first_crosses_stages_only_from_the_leader(world4):
    results = world4.run(exotic_job, "pp_first", TP2PP2, False)
    groups = [c[1] for r in results for c in r["comms"]]
    assert (0, 2) in groups and (1, 3) not in groups  # the leader's PP group only
    assert (2, 3) in groups  # stage 1 fans out inside its own TP group


# -- tests: errors ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [TP2PP2, Layout(tp=4)], ids=["tp2pp2", "tp4"])
def test_megatron_refuses_zero_size_dims_on_every_rank(world4, layout):
    messages = world4.run(error_job, "megatron_broadcast_data", layout, "zero_size")
    for rank, msg in enumerate(messages):
        assert "empty_cols" in msg and "zero-size dim" in msg, (rank, msg)
        assert "rank 0:" in msg  # the leader that found it
        if rank:
            prefix = f"rank {rank}: the replica leader (rank 0) failed to send its batch: "
            assert msg.startswith(prefix + "ContractError: rank 0: "), msg
    assert world4.alive


def test_megatron_refuses_five_dims(world4):
    messages = world4.run(error_job, "megatron_broadcast_data", TP2PP2, "ndim5")
    assert all("deep" in m and "5 dims" in m for m in messages), messages


def test_vllm_skips_zero_size_tensors(world4):
    messages = world4.run(error_job, "vllm_tensor_dict", TP2PP2, "zero_size")
    assert messages == [""] * 4


def test_tensordict_library_bug_is_where_the_docstring_says(world4):
    """If this fails, tensordict changed: revisit tensordict_broadcast's refusal."""
    for ranks in ([0, 1], [0, 2], [0, 1, 2, 3]):
        got = world4.run(tensordict_library_job, ranks, 0)
        assert [g for g in got if g is not None] == [("ok", "True")] * len(ranks)
    got = world4.run(tensordict_library_job, [2, 3], 2)  # src as a global rank
    assert [g[0] for g in got[2:]] == ["AttributeError"] * 2
    assert all("'NoneType' object has no attribute 'pop'" in g[1] for g in got[2:])
    got = world4.run(tensordict_library_job, [2, 3], 0)  # src as a group rank
    assert [g[0] for g in got[2:]] == ["ValueError"] * 2
    # [1, 3] src 1 hangs rank 3 (it takes the sending branch); see test_..._hangs below.


def test_tensordict_library_hangs_when_a_receiver_index_equals_src():
    """[1, 2] src 1 in a 3-rank world: rank 2's group index is 1 == src, so it takes the
    sending branch with its empty TensorDict and blocks forever; rank 1 gets None."""
    world = World(3, timeout_s=4).start()
    try:
        with pytest.raises(WorldError) as info:
            world.run(tensordict_library_job, [1, 2], 1, timeout_s=4)
        assert "rank 1 failed" in str(info.value) or "stopped responding" in str(info.value)
        assert "AttributeError" in str(info.value) or "rank 2" in str(info.value)
        assert not world.alive  # torn down: rank 2 was still blocked
    finally:
        world.close(kill=True)


# -- tests: DP > 1 with the seed's order (8 ranks, kept short) --------------------------------
def test_dp2_seed_order(world8):
    for name in PEERS:
        if name == "tensordict_broadcast":
            continue  # refuses DP > 1: checked below
        results = world8.run(exotic_job, name, DP2_SEED, True)
        assert not [p for r in results for p in r["problems"]], name
        assert_plan_matches(name, DP2_SEED, exotic_batch(10, True), [r["comms"] for r in results])
    spec = JobSpec(
        strategy="pp_first", layout=DP2_SEED, batch_size=2, seq_len=32, iters=1, warmup=1
    )
    run_job(world8, spec)
    # tensordict's bug: refused on every rank before any collective, and the world survives.
    with pytest.raises(WorldError, match="TensorDictBroadcastBug.*dp=2 replicas"):
        world8.run(exotic_job, "tensordict_broadcast", DP2_SEED, True)
    assert world8.alive
    with pytest.raises(NotImplementedError, match="group-local"):
        strategies.get_class("tensordict_broadcast").plan(DP2_SEED, payload_spec(exotic_batch(10)))
    # The world still serves jobs after the refusal.
    results = world8.run(exotic_job, "pp_first", DP2_SEED, False)
    assert not [p for r in results for p in r["problems"]]
