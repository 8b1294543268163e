"""Tier 2 (real gloo worlds): a fault at every point of the leader's collective path, for every
strategy (the example package's ``per_key`` included): before each collective the leader
posts and after it. Whatever it is, every rank finishes the call within the limit, the leader
raises the fault, and the next call on the same instance is exact on every rank.

What the receivers see follows from where the fault struck (``strategies.Strategy``): before
the leader's first collective, a failure batch takes the batch's place and every receiver
raises ``LeaderFailed`` naming the fault; after it, the leader finishes the collectives it
announced with the batch's own bytes, so every receiver ends with the leader's batch, exact.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.distributed as dist
from batchgen import raw_bytes
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import strategies
from harness.paths import REPO
from strategies.auto import CANDIDATES
from strategies.core.layout import Layout
from strategies.core.trace import PG_KINDS

try:
    from torch._C._distributed_c10d import ProcessGroup
except ImportError:  # a torch built without distributed support
    ProcessGroup = None

pytestmark = pytest.mark.world

LAYOUT = Layout(tp=2, pp=2)
FAIL_WITHIN_S = 5.0
"""The no-progress limit: a rank still in a call after this is a hang."""
EXAMPLE_SRC = REPO / "examples" / "bcastbench_example_strategy" / "src"
EXAMPLE = "bcastbench_example_strategy.per_key.PerKeyBroadcast"
NAMES = strategies.names_for_world() + (
    [] if "per_key" in strategies.names_for_world() else [EXAMPLE]
)
OPTIONS = {
    "direct": {"direct_min_bytes": 1},
    "auto": {"candidates": [c for c in CANDIDATES if c != "shm"]},
}
"""direct with the lowest threshold: every leaf leaves the message, so the leader's path has
one collective per leaf to fault. auto among the collective strategies: on one host it would
choose shm, whose leader posts none (faulted in tests/world/test_shm.py)."""
DTYPES = ("float32", "int64", "bfloat16", "bool", "complex64")
SIGNALLED = {"shm", "vllm_shm_broadcast", "independent_fetch"}
"""Strategies whose leader posts no collective on one node in steady state (a socket message or
a shared flag per rank instead): nothing here to fault; tests/world/test_shm.py faults shm's
signal (independent_fetch's is the same channel's)."""


class Injected(Exception):
    """A fault of a type no receiver's code knows."""


FAULTS = {"RuntimeError": RuntimeError, "ValueError": ValueError, "Injected": Injected}


class Fault:
    """On this rank, the ``at``-th collective call (counted at the ProcessGroup methods every
    eager collective ends in) raises ``exc``: before it is posted, or (``posted``) once it has
    completed. With ``at=0`` it only counts."""

    def __init__(self, at: int = 0, posted: bool = False, exc: Exception | None = None):
        self.at, self.posted, self.exc = at, posted, exc
        self.calls = 0
        self._saved: dict = {}

    def __enter__(self) -> Fault:
        for method in PG_KINDS:
            raw = vars(ProcessGroup).get(method)
            if raw is not None:
                self._saved[method] = raw
                setattr(ProcessGroup, method, self._wrap(getattr(ProcessGroup, method)))
        return self

    def __exit__(self, *exc) -> None:
        for method, raw in self._saved.items():
            setattr(ProcessGroup, method, raw)

    def _wrap(self, original):
        def faulty(pg, *args, **kwargs):
            self.calls += 1
            strikes = self.calls == self.at
            if strikes and not self.posted:
                raise self.exc
            work = original(pg, *args, **kwargs)
            if strikes:
                work.wait()  # the collective is done, then its caller sees the fault
                raise self.exc
            return work

        return faulty


def example_importable() -> None:
    """The example package, where it is not installed (a rank imports it by path)."""
    if str(EXAMPLE_SRC) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_SRC))


def build(spec: tuple, seed: int) -> strategies.DataProto:
    """The same batch on every rank: ``spec`` = (B, ((key, dtype, cols), ...), texts)."""
    b, leaves, texts = spec
    gen = torch.Generator().manual_seed(seed)
    td = TensorDict({}, [b])
    for key, dtype, cols in leaves:
        values = torch.randint(0, 100, (b, cols), generator=gen)
        td.set(key, values.to(getattr(torch, dtype)))
    non_tensor = {}
    if texts:
        non_tensor["prompt"] = np.array([f"p{seed}-{i}" for i in range(b)], dtype=object)
    meta = {"step": 1, strategies.NON_TENSOR_FLAG: texts}
    return strategies.DataProto(td, non_tensor, meta)


def problems(out, want: strategies.DataProto, where: str) -> list[str]:
    found = [
        f"{where}: {key!r} differs"
        for key, leaf in want.batch.items(include_nested=True, leaves_only=True)
        if out.batch.get(key).dtype != leaf.dtype
        or not torch.equal(raw_bytes(out.batch.get(key)), raw_bytes(leaf))
    ]
    if want.meta_info[strategies.NON_TENSOR_FLAG]:
        if list(out.non_tensor_batch["prompt"]) != list(want.non_tensor_batch["prompt"]):
            found.append(f"{where}: non_tensor_batch differs")
    return found


def call(ctx, strategy, spec, seed: int, fault) -> tuple[str, object, float]:
    """One call, ``fault`` (a context manager) around it; (outcome, detail, seconds)."""
    groups = strategy.groups
    want = build(spec, seed)
    entry = build(spec, seed) if groups.is_leader else want.entry_state(False)
    t0 = time.monotonic()
    try:
        with fault:
            out = strategy.get_data_input(entry)
    except Exception as exc:  # noqa: BLE001 -- the test looks at what every rank raised
        return "raised", f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    seconds = time.monotonic() - t0
    return "exact", problems(out, want, f"rank {ctx.rank} seed {seed}"), seconds


def injection_job(ctx, name: str, spec: tuple, fault_type: str, text: str):
    """A good call, a count of the leader's collectives in a second one, then for every
    collective of the leader (before it is posted, and after) a faulty call followed by a
    good one, on one strategy instance. Returns (n, [(at, posted, faulty, next good), ...])."""
    example_importable()
    groups = ctx.groups_for(LAYOUT)
    strategy = strategies.get(name, groups, **OPTIONS.get(name, {}))
    leader = groups.is_leader
    ctx.report(f"{name}: warm-up")
    call(ctx, strategy, spec, 0, nullcontext())
    # A second one: a strategy that sets itself up on its first call (auto's choice serves
    # from the second call on) is in steady state when the leader's collectives are counted.
    call(ctx, strategy, spec, 0, nullcontext())
    counter = Fault()
    ctx.report(f"{name}: counting the leader's collectives")
    call(ctx, strategy, spec, 1, counter if leader else nullcontext())
    box = [counter.calls]
    dist.broadcast_object_list(box, src=groups.leader)  # every rank runs as many cases
    n = box[0]
    cases = []
    for at in range(1, n + 1):
        for posted in (False, True):
            seed = 10 * at + posted
            fault = Fault(at, posted, FAULTS[fault_type](f"{text} #{at}/{int(posted)}"))
            ctx.report(f"{name}: fault at collective {at} of {n}, posted={posted}")
            faulty = call(ctx, strategy, spec, seed, fault if leader else nullcontext())
            ctx.report(f"{name}: the good call after it")
            after = call(ctx, strategy, spec, seed + 5, nullcontext())
            cases.append((at, posted, faulty, after))
    return n, cases


def check(results, name: str, fault_type: str, text: str) -> None:
    leader = LAYOUT.leaders()[0]
    n = results[leader][0]
    counts = [r[0] for r in results]
    assert (n >= 1 or name in SIGNALLED) and all(c == n for c in counts), f"{name}: {counts}"
    for i, (at, posted, *_) in enumerate(results[leader][1]):
        where = f"{name}: fault at collective {at} of {n}, posted={posted}"
        fault = f"{fault_type}: {text} #{at}/{int(posted)}"
        faulty = [r[1][i][2] for r in results]
        after = [r[1][i][3] for r in results]
        assert max(s for *_, s in faulty + after) < FAIL_WITHIN_S, f"{where}: too slow"
        assert faulty[leader][:2] == ("raised", fault), f"{where}: leader {faulty[leader]}"
        nothing_sent = at == 1 and not posted
        for rank, (outcome, detail, _) in enumerate(faulty):
            if rank == leader:
                continue
            if nothing_sent:  # the failure took the batch's place
                assert outcome == "raised", f"{where}: rank {rank} {detail}"
                assert detail.startswith(f"LeaderFailed: rank {rank}: the replica leader "), detail
                assert fault in detail, f"{where}: rank {rank}: {detail}"
            else:  # finished with the batch's bytes
                assert (outcome, detail) == ("exact", []), f"{where}: rank {rank}: {detail}"
        assert {(o, tuple(d)) for o, d, _ in after} == {("exact", ())}, f"{where}: next {after}"


SMALL = settings(
    max_examples=3,
    deadline=None,
    # No shrinking: a failing example that leaves a rank blocked costs seconds per retry.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@st.composite
def batch_specs(draw) -> tuple:
    b = draw(st.integers(1, 4))
    n = draw(st.integers(1, 3))
    leaves = tuple(
        (f"k{i}", draw(st.sampled_from(DTYPES)), draw(st.integers(1, 3))) for i in range(n)
    )
    return b, leaves, draw(st.booleans())


@pytest.mark.parametrize("name", NAMES)
@SMALL
@given(
    spec=batch_specs(),
    fault_type=st.sampled_from(sorted(FAULTS)),
    text=st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=12),
)
def test_a_fault_anywhere_on_the_leaders_path_strands_no_rank(world4, name, spec, fault_type, text):
    results = world4.run(injection_job, name, spec, fault_type, text, timeout_s=FAIL_WITHIN_S)
    check(results, name, fault_type, text)


# -- the worked example, which writes no failure handling of its own --------------------------
def _unpicklable(b: int) -> np.ndarray:
    texts = np.empty(b, dtype=object)
    texts[:] = [lambda: None] * b  # a lambda cannot be pickled
    return texts


def example_job(ctx, case: str):
    """per_key, a good call, then the case's leader batch; (outcome, text) on this rank."""
    example_importable()
    groups = ctx.groups_for(LAYOUT)
    strategy = strategies.get(EXAMPLE, groups, coalesce=case.endswith("coalesced"))
    spec = (3, (("x", "float32", 2),), True)
    call(ctx, strategy, spec, 0, nullcontext())
    entry = build(spec, 1) if groups.is_leader else build(spec, 1).entry_state(False)
    if groups.is_leader:
        entry.non_tensor_batch["fn"] = _unpicklable(3)
    ctx.report(f"per_key: {case}")
    try:
        strategy.get_data_input(entry)
    except Exception as exc:  # noqa: BLE001 -- the test looks at what every rank raised
        return "raised", f"{type(exc).__name__}: {exc}"
    return "returned", ""


@pytest.mark.parametrize("case", ["unpicklable", "unpicklable_coalesced"])
def test_the_example_strategy_ships_its_leaders_failure_without_a_line_for_it(world4, case):
    """per_key pickles its header before its first collective and has no failure code: the
    leader's PicklingError reaches every rank as the leader's error (it used to leave the
    receivers in the size broadcast until gloo's timeout)."""
    t0 = time.monotonic()
    results = world4.run(example_job, case, timeout_s=FAIL_WITHIN_S)
    assert time.monotonic() - t0 < 2 * FAIL_WITHIN_S
    leader = LAYOUT.leaders()[0]
    outcome, said = results[leader]
    assert outcome == "raised" and "pickle" in said.lower(), said
    for rank, (outcome, text) in enumerate(results):
        if rank != leader:
            assert outcome == "raised", (rank, text)
            assert text.startswith(f"LeaderFailed: rank {rank}: the replica leader (rank 0)")
            assert said in text, (rank, text)
