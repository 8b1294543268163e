"""Tier 3 (real gloo worlds): every selectable strategy ends with the leader's batch, bit for
bit, on every rank of every replica, for random batches and growing/shrinking call sequences;
a corrupting strategy is caught, and bad or oversized batches fail loudly without a hang.
"""

from __future__ import annotations

import ctypes
import time

import pytest
import torch
from batchgen import BatchSpec, LeafSpec, batch_problems, batch_specs, build_batch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import strategies
from harness.job.verification import compare, digest
from harness.payload import generated
from harness.worlds.forked import ForkedWorld as World
from harness.worlds.protocol import WorldError
from strategies.core.layout import SEED_ORDER, Layout
from strategies.header import HeaderStrategy

OURS = (
    "pickled",
    "pickled_pickle5",
    "pickled_verl_numpy",
    "header",
    "flat",
    "direct",
    "scatter_allgather",
)
"""Strategies that must carry every valid batch. Others (peer reproductions) may refuse a
layout or a batch they document as out of reach, if they do so on every rank."""

TEST_OPTIONS = {"direct": {"direct_min_bytes": 64}}
"""Options the contract tests build a strategy with: ``direct``'s default threshold (1 MiB)
would leave every small test batch on the packed path, so here most leaves travel alone."""


class Refused(strategies.Unsupported):
    """A strategy declined a layout (NotImplementedError) or a batch (ContractError). An
    Unsupported raised on every rank keeps the world alive (harness.worlds.forked), which is how
    run_contract tells an all-rank refusal from a failure on some ranks."""


LAYOUTS_4 = [Layout(tp=2, pp=2), Layout(tp=2, cp=2), Layout(pp=4), Layout(pp=2, cp=2)]
LAYOUTS_8 = [
    Layout(dp=2, pp=2, tp=2),
    Layout(dp=2, pp=2, tp=2, order=SEED_ORDER),
    Layout(dp=2, tp=2, cp=2),
    Layout(dp=2, tp=2, cp=2, order=SEED_ORDER),
]
CASES = [
    pytest.param(layout, name, id=f"{name}-{layout.describe().replace(' ', '')}")
    for layout in LAYOUTS_4 + LAYOUTS_8  # layout-major: each world rebuilds its groups rarely
    for name in strategies.names_for_world()
]

FEW = settings(
    max_examples=3,
    deadline=None,
    # No shrinking: a failing example that leaves a rank blocked costs seconds per retry.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # only `request`, which no example changes
    ],
)


def world_for(layout: Layout, request) -> World:
    return request.getfixturevalue("world4" if layout.world_size == 4 else "world8")


# -- jobs run on every rank (module level, so they pickle by reference) -----------------------
def batch_seed(seed: int, layout: Layout, rank: int, call: int) -> int:
    """Every replica gets its own data, and every call new data (stale buffers show)."""
    return seed + 1000 * layout.coords(rank)["dp"] + 17 * call


def contract_job(ctx, name: str, layout: Layout, spec: BatchSpec, sizes, seed: int, options):
    """Call ``get_data_input`` once per size with fresh data; each rank checks its exit state
    against its own regenerated copy of its leader's batch."""
    groups = ctx.groups_for(layout)
    try:
        strategy = strategies.get(name, groups, **options)
    except NotImplementedError as exc:
        raise Refused(f"layout: {type(exc).__name__}: {exc}") from exc
    problems = []
    for call, b in enumerate(sizes):
        s = batch_seed(seed, layout, ctx.rank, call)
        expected = build_batch(spec, b, s)
        entry = (build_batch(spec, b, s) if groups.is_leader else expected).entry_state(
            groups.is_leader
        )
        if call == 0:
            strategy.prepare(entry)
        ctx.report(f"{name} call {call} (B={b})")
        try:
            out = strategy.get_data_input(entry)
        except strategies.ContractError as exc:
            raise Refused(f"batch: {exc}") from exc
        where = f"{name}: rank {ctx.rank} call {call} (B={b})"
        problems += batch_problems(expected, out, groups.is_leader, where)
    return problems


def run_contract(world: World, name: str, layout: Layout, *args) -> list[str]:
    """Problems on all ranks; a refusal a peer makes on every rank counts as no problem."""
    try:
        per_rank = world.run(contract_job, name, layout, *args)
    except WorldError as exc:
        first = str(exc).splitlines()[0]
        every_rank = world.alive  # a world survives only if every rank answered
        if name not in OURS and every_rank and ": Refused: " in first:
            if ": Refused: layout: " in first:
                pytest.skip(f"{name} refuses {layout.describe()}: {first}")
            return []
        raise
    return [p for problems in per_rank for p in problems]


# -- bit-exact on every rank -------------------------------------------------------------------
@pytest.mark.world
@pytest.mark.parametrize("layout,name", CASES)
@FEW
@given(
    spec=batch_specs(),
    lo=st.integers(0, 3),
    hi_extra=st.integers(1, 3),
    seed=st.integers(0, 2**20),
)
def test_every_rank_ends_with_the_leaders_batch(request, layout, name, spec, lo, hi_extra, seed):
    """First call, steady state, then a growing and a shrinking batch."""
    hi = lo + hi_extra
    sizes = (lo, lo, hi, hi, lo, lo)
    world = world_for(layout, request)
    assert run_contract(world, name, layout, spec, sizes, seed, TEST_OPTIONS.get(name, {})) == []


FIXED = BatchSpec(
    leaves=(
        LeafSpec(("input_ids",), "int64", (5,)),
        LeafSpec(("int16",), "int16", (3,)),  # gloo itself cannot broadcast int16
        LeafSpec(("bf16",), "bfloat16", (3, 2), "strided"),
        LeafSpec(("c64",), "complex64", (2,), "view"),
        LeafSpec(("mask", "bool"), "bool", (4,), "transposed"),
        LeafSpec(("mask", "empty"), "float32", (0,)),
        LeafSpec(("payload_big",), "float32", (8192,)),
    ),
    non_tensor=(("text", "str"), ("extra", "mixed")),
    meta=(("nested", {"a": [1, {"b": None}]}),),
)


@pytest.mark.world
@pytest.mark.parametrize("flag", [True, False], ids=["non_tensor", "tensors_only"])
@pytest.mark.parametrize("name", strategies.names_for_world())
def test_non_tensor_flag_both_ways(world8, name, flag):
    """Flagged: object arrays arrive everywhere; not flagged: receivers keep an empty dict."""
    layout = LAYOUTS_8[1]  # the seed's DP2×PP2×TP2
    spec = BatchSpec(FIXED.leaves, FIXED.non_tensor, FIXED.meta, broadcast_non_tensor=flag)
    assert run_contract(world8, name, layout, spec, (3, 3, 1), 7, TEST_OPTIONS.get(name, {})) == []


@pytest.mark.world
@pytest.mark.parametrize("name", [n for n in strategies.names_for_world() if n in OURS])
def test_realistic_payloads_with_small_first_message(world4, name):
    """The rl_rollout and multimodal payloads, with a 4 KiB first message so every call of
    the wire-based strategies needs its second broadcast until the size is announced."""
    options = {"initial_bytes": 4096} if name in ("header", "flat", "direct") else {}
    options |= {"direct_min_bytes": 1024} if name == "direct" else {}
    layout = LAYOUTS_4[0]
    results = world4.run(payload_job, name, layout, options)
    assert [p for r in results for p in r] == []


def payload_job(ctx, name: str, layout: Layout, options) -> list[str]:
    groups = ctx.groups_for(layout)
    strategy = strategies.get(name, groups, **options)
    problems = []
    for call, (payload, b, s) in enumerate(
        [("rl_rollout", 2, 64), ("multimodal", 2, 64), ("multimodal", 4, 128), ("pretrain", 1, 32)]
    ):
        expected = generated.make(payload, b, s, seed=call)
        entry = generated.make(payload, b, s, seed=call) if groups.is_leader else expected
        out = strategy.get_data_input(entry.entry_state(groups.is_leader))
        problems += batch_problems(expected, out, groups.is_leader, f"{name}: rank {ctx.rank}")
    return problems


# -- a corrupting strategy is caught -----------------------------------------------------------
class FlipsOneByte(HeaderStrategy):
    """``header``, except receivers flip the first data byte after it arrives."""

    name = "flips_one_byte"

    def finish_receiver(self, batch, buf, header, direct=()):
        at = header.header_len + header.entries[0].offset
        buf[at] ^= 0xFF
        return super().finish_receiver(batch, buf, header, direct)


def broken_job(ctx, layout: Layout) -> list[str]:
    groups = ctx.groups_for(layout)
    expected = generated.make("rl_rollout", 2, 32, seed=5)
    entry = generated.make("rl_rollout", 2, 32, seed=5) if groups.is_leader else expected
    out = FlipsOneByte(groups).get_data_input(entry.entry_state(groups.is_leader))
    return compare(digest(expected, False), digest(out, False), ctx.rank, "flips_one_byte")


@pytest.mark.world
def test_a_corrupting_strategy_is_caught_naming_rank_and_key(world4):
    layout = LAYOUTS_4[0]
    results = world4.run(broken_job, layout)
    leader = layout.leaders()[0]
    assert results[leader] == []
    for rank, problems in enumerate(results):
        if rank != leader:
            first_key = "prompts"  # rl_rollout's first leaf
            assert problems == [
                f"flips_one_byte: rank {rank}: key {first_key!r} values differ from the leader's"
            ]


# -- errors: loud, named, and no rank left behind -----------------------------------------------
@pytest.fixture(scope="module")
def scratch_world():
    """A 2-rank world these tests may tear down (a rank left blocked gets the world killed)."""
    box: list[World] = []

    def get() -> World:
        if not box or not box[0].alive:
            if box:
                box[0].close(kill=True)
            box[:] = [World(2, timeout_s=30).start()]
        return box[0]

    yield get
    if box:
        box[0].close(kill=True)


SIMPLE = BatchSpec(
    leaves=(LeafSpec(("x",), "float32", (4,)), LeafSpec(("n", "y"), "int64", (2,), "strided")),
    non_tensor=(("text", "str"),),
)
ERROR_TIMEOUT_S = 3.0
"""No-progress limit in the error tests: a blocked rank is named and killed this fast."""


def bad_leader_job(ctx, name: str, layout: Layout):
    groups = ctx.groups_for(layout)
    strategy = strategies.get(name, groups)
    dp = build_batch(SIMPLE, 3, seed=1)
    dp.batch._tensordict["bad"] = torch.zeros(2, 5)  # bypasses TensorDict's own shape check
    strategy.get_data_input(dp.entry_state(groups.is_leader))
    return "returned"


@pytest.mark.world
@pytest.mark.parametrize("name", strategies.names_for_world())
def test_wrong_leading_dim_raises_contract_error_without_a_hang(scratch_world, name):
    layout = Layout(tp=2)
    world = scratch_world()
    world.run(contract_job, name, layout, SIMPLE, (1,), 0, {})  # groups built, strategy works
    t0 = time.monotonic()
    with pytest.raises(WorldError) as err:
        world.run(bad_leader_job, name, layout, timeout_s=ERROR_TIMEOUT_S)
    elapsed = time.monotonic() - t0
    first = str(err.value).splitlines()[0]
    assert "ContractError" in first and "rank 0" in first and "batch['bad']" in first, first
    assert "expected leading dim B=3" in first, first
    assert elapsed < ERROR_TIMEOUT_S + 10, f"took {elapsed:.1f} s to surface"


def holds_the_gil_in_native_code(ctx, seconds: int):
    """Rank 1 sleeps in libc with the GIL held (ctypes.PyDLL keeps it), as a rank stuck in a
    native call that never released it; rank 0 waits for it in a collective."""
    if ctx.rank == 1:
        ctypes.PyDLL("libc.so.6").sleep(seconds)
    torch.distributed.barrier()
    return "returned"


@pytest.mark.world
def test_a_rank_stuck_holding_the_gil_is_named_with_its_python_stack(scratch_world):
    """Its status thread cannot answer where it is, so the driver has its faulthandler write
    every thread's stack: the hang names the function it is stuck in."""
    world = scratch_world()
    t0 = time.monotonic()
    with pytest.raises(WorldError) as err:
        world.run(holds_the_gil_in_native_code, 60, timeout_s=ERROR_TIMEOUT_S)
    text = str(err.value)
    assert text.startswith("rank 1 stopped responding for 3 s"), text
    assert "rank 1: 'holds_the_gil_in_native_code', no answer from its status thread" in text
    assert "--- stacks of rank 1 (faulthandler) ---" in text, text
    assert "in holds_the_gil_in_native_code" in text.split("(faulthandler) ---")[1], text
    assert time.monotonic() - t0 < ERROR_TIMEOUT_S + 10 + 5 + 10
    assert not world.alive


def takes_max_bytes(name: str) -> bool:
    """Whether the strategy takes max_bytes (its ``Options`` has the field)."""
    return "max_bytes" in strategies.accepted_options(strategies.get_class(name))


def small_max_bytes_job(ctx, name: str, layout: Layout):
    groups = ctx.groups_for(layout)
    strategy = strategies.get(name, groups, max_bytes=4096)
    td = TensorDict({"x": torch.arange(2 * 4096, dtype=torch.int64).view(2, -1)}, [2])
    dp = strategies.DataProto(td, {}, {"step": 1})
    strategy.get_data_input(dp.entry_state(groups.is_leader))
    return "returned"


@pytest.mark.world
@pytest.mark.parametrize("name", [n for n in strategies.names_for_world() if takes_max_bytes(n)])
def test_receiver_refuses_a_message_over_max_bytes(scratch_world, name):
    world = scratch_world()
    with pytest.raises(WorldError) as err:
        world.run(small_max_bytes_job, name, Layout(tp=2), timeout_s=ERROR_TIMEOUT_S)
    first = str(err.value).splitlines()[0]
    # An engine store's reader sees the leader's announcement of the size before any header.
    assert "HeaderError: rank 1: " in first and " claims " in first, first
    assert "more than the maximum this receiver accepts (4096 bytes" in first, first


def direct_over_max_bytes_job(ctx, layout: Layout):
    groups = ctx.groups_for(layout)
    strategy = strategies.get("direct", groups, max_bytes=64 << 10, direct_min_bytes=1024)
    td = TensorDict({"x": torch.zeros(2, 16 << 10, dtype=torch.int64)}, [2])  # 256 KiB alone
    dp = strategies.DataProto(td, {}, {"step": 1})
    strategy.get_data_input(dp.entry_state(groups.is_leader))
    return "returned"


@pytest.mark.world
def test_direct_refuses_leaves_over_max_bytes_on_every_rank(scratch_world):
    """Leaves sent on their own count against max_bytes on the leader, before it commits to
    sending them: every rank raises (the leader's refusal), none waits in a broadcast."""
    world = scratch_world()
    with pytest.raises(WorldError) as err:
        world.run(direct_over_max_bytes_job, Layout(tp=2), timeout_s=ERROR_TIMEOUT_S)
    text = str(err.value)
    assert "stopped responding" not in text, text
    assert "leaves sent on their own (262144 bytes) exceed max_bytes=65536" in text, text


@pytest.mark.parametrize("name", ["header", "flat", "pp_first"])
def test_large_messages_go_out_pipelined_and_arrive_whole(world4, name):
    """Above PIPELINE_MIN_BYTES the first message is SEGMENTS async broadcasts (packing
    overlaps sending); the runner verifies every rank bit for bit and counts them."""
    from harness.job.execute import run_job
    from harness.job.spec import JobSpec
    from strategies.core.wire import PIPELINE_MIN_BYTES, SEGMENTS

    spec = JobSpec(
        strategy=name,
        layout=Layout(pp=2, tp=2),
        batch_size=220,  # rl_rollout at seq_len 512: ≈5 MiB
        seq_len=512,
        iters=2,
        warmup=1,
        references=("floor",),
    )
    record = run_job(world4, spec)
    assert record["payload_bytes"] > PIPELINE_MIN_BYTES
    mine = record
    hops = 1 if name == "flat" else 2  # tp2pp2: two hops on the ranks that forward
    assert mine["collectives_per_call"] == SEGMENTS * hops
