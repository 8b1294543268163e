"""Tier 2 (real gloo worlds): what ``shm`` promises beyond the contract every strategy's tests
check. A receiver's batch is its own (writing into it reaches nobody else, and a batch held
across calls is never overwritten); the hierarchical path across nodes is exact; a signal that
cannot be sent strands no rank; no segment is ever left anywhere, kill -9 of the leader
included (``vllm_shm_broadcast`` too), and the readers learn of that death at once.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import strategies
import strategies.core.node_channel as shm_core
from strategies.core.layout import Layout
from strategies.core.segment_ring import REUSE_MIN_BYTES

pytestmark = pytest.mark.world

LAYOUT = Layout(tp=2, pp=2)
FAIL_WITHIN_S = 5.0


def batch(seed: int, b: int = 4) -> strategies.DataProto:
    gen = torch.Generator().manual_seed(seed)
    td = TensorDict(
        {
            "x": torch.randn(b, 1000, generator=gen),
            "ids": torch.randint(0, 50_000, (b, 17), generator=gen),
            "nested": {"mask": torch.rand(b, 9, generator=gen) > 0.5},
        },
        [b],
    )
    texts = np.array([f"prompt {seed}-{i}" for i in range(b)], dtype=object)
    return strategies.DataProto(td, {"prompt": texts}, {strategies.NON_TENSOR_FLAG: True})


def same(out, want) -> bool:
    keys = want.batch.keys(include_nested=True, leaves_only=True)
    return all(torch.equal(out.batch.get(k), want.batch.get(k)) for k in keys) and list(
        out.non_tensor_batch["prompt"]
    ) == list(want.non_tensor_batch["prompt"])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shared_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's shared mappings (memfds and /dev/shm files)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            cols = line.split(maxsplit=5)
            if len(cols) == 6 and cols[5].startswith(("/memfd:", "/dev/shm/")):
                lo, hi = (int(x, 16) for x in cols[0].split("-"))
                out.append((lo, hi))
    return out


def views_shared_memory(out) -> bool:
    """Whether any tensor of ``out`` lies in a shared mapping (a view of a segment)."""
    ranges = shared_ranges()
    ptrs = [t.data_ptr() for t in out.batch.values(include_nested=True, leaves_only=True)]
    return any(lo <= p < hi for p in ptrs for lo, hi in ranges)


def ownership_job(ctx, node_of, calls: int, options: dict, name: str = "shm", words: bool = True):
    """``calls`` calls; every rank keeps the first batch, rank 2 writes into every later one;
    ``words`` False: readers report on their sockets (as on a machine whose store order does
    not allow report words). Returns (every call exact, the held batch still exact, fds opened
    meanwhile, segments the leader made, stripes written per reader as this rank's channel
    counted them, calls whose batch viewed shared memory on a receiver)."""
    if not words:
        shm_core.report_words_allowed = lambda: False
    try:
        return ownership_calls(ctx, node_of, calls, options, name)
    finally:  # a world's ranks outlive the test
        shm_core.report_words_allowed = REPORT_WORDS_ALLOWED


REPORT_WORDS_ALLOWED = shm_core.report_words_allowed


def ownership_calls(ctx, node_of, calls: int, options: dict, name: str):
    groups = ctx.groups_for(LAYOUT)
    if node_of is not None:
        groups = dataclasses.replace(groups, node_of=tuple(node_of))
    strategy = strategies.get(name, groups, **options)
    exact, held = [], None
    fds = None
    viewed = 0
    for seed in range(calls):
        want = batch(seed)
        entry = batch(seed) if groups.is_leader else want.entry_state(False)
        out = strategy.get_data_input(entry)
        exact.append(same(out, want))
        viewed += not groups.is_leader and views_shared_memory(out)
        if seed == 0:
            held = out
            fds = open_fds()
        if ctx.rank == 2 and seed > 0:  # the first batch is checked again at the end
            out.batch["x"].add_(1.0)  # the rank's own copy: nobody else may see it
            out.batch["nested", "mask"].logical_not_()
        del out
        # Every release is reported before the leader's next turn (the leader never waits for
        # one), so the segments it makes are the ring's count, not the scheduler's.
        torch.distributed.barrier()
    held_exact = same(held, batch(0))
    del held
    grew = open_fds() - fds
    made = strategy.channel.segments_made
    return all(exact), held_exact, grew, made, dict(strategy.channel.striped_upto), viewed


OWNERSHIP = [
    (None, {}),
    ((0, 0, 1, 1), {}),
    ((0, 1, 0, 1), {}),
    (None, {"views": False}),
    # Every message signalled once, whole (by default: header and blob first, the leaves
    # while readers decode).
    (None, {"early_min_bytes": None}),
    (None, {"early_min_bytes": None, "views": False}),
    # The GPU path's staging (the leader's own packed buffer copied into the segment, every
    # receiver's copy out of it), run on host groups.
    (None, {"stage": True}),
    ((0, 0, 1, 1), {"stage": True}),
    # Striped crossings (every message of these batches is two pages or more): rank 1 sends
    # the second stripe to rank 3, which writes it into rank 2's segment.
    ((0, 0, 1, 1), {"stripe_min_bytes": 0}),
    ((0, 1, 0, 1), {"stripe_min_bytes": 0}),
    ((0, 0, 1, 1), {"stage": True, "stripe_min_bytes": 0}),
]


@pytest.mark.parametrize(
    "node_of,options,words",
    [(*case, True) for case in OWNERSHIP] + [(None, {}, False), ((0, 0, 1, 1), {}, False)],
    ids=str,
)
def test_a_receivers_batch_is_its_own_and_a_held_one_is_never_overwritten(
    world4, node_of, options, words
):
    """Readers report in words (where the machine allows) and, forced, on their sockets."""
    calls = 12
    results = world4.run(ownership_job, node_of, calls, options, "shm", words, timeout_s=60)
    for rank, (exact, held_exact, grew, *_) in enumerate(results):
        assert exact, f"rank {rank}: a call was not exact"
        assert held_exact, f"rank {rank}: the batch held since the first call changed"
        # The ring's other two slots: a memfd each, and on a writer its mapping's own copy.
        assert grew <= 4, f"rank {rank}: {grew} file descriptors more after {calls} calls"
    made = results[0][3]
    # The ring serves: the held batch retires its slot once, and a release that arrives after
    # the leader's turn (the leader never waits for one) retires another; never one per call.
    assert made <= 3 + calls // 2, f"the leader made {made} segments in {calls} calls"
    striped = {rank: res[4] for rank, res in enumerate(results) if res[4]}
    if node_of is not None and options.get("stripe_min_bytes") == 0:
        # The other node's leader heard every call's stripe from its other rank.
        other = [r for r in range(4) if node_of[r] != node_of[0]]
        assert striped == {other[0]: {other[1]: calls}}, striped
    else:
        assert striped == {}, striped


@pytest.mark.parametrize(
    "node_of,options",
    [(None, {}), ((0, 0, 1, 1), {}), ((0, 1, 0, 1), {}), ((0, 0, 1, 1), {"stripe_min_bytes": 0})],
    ids=str,
)
def test_independent_fetch_gives_every_rank_an_owned_copy_on_a_node_and_across(
    world4, node_of, options
):
    """Every receiver's batch is its own copy (no tensor of it in a shared mapping, and rank 2's
    writes reach nobody), on one node and across two (a store per node, fed once: the other
    node's leader receives, its other rank fetches from that node's store). Readers release a
    slot as soon as they have copied it, so the ring never makes a segment beyond its three."""
    calls = 8
    results = world4.run(ownership_job, node_of, calls, options, "independent_fetch", timeout_s=60)
    for rank, (exact, held_exact, _, _, _, viewed) in enumerate(results):
        assert exact and held_exact, f"rank {rank}: a call, or the held batch, was not exact"
        assert viewed == 0, f"rank {rank}: {viewed} calls' batches viewed shared memory"
    assert results[0][3] <= 3, f"the leader made {results[0][3]} segments in {calls} calls"
    striped = {rank: res[4] for rank, res in enumerate(results) if res[4]}
    if options.get("stripe_min_bytes") == 0:
        assert striped == {2: {3: calls}}, striped


def guess_job(ctx, sizes: list[int], options: dict):
    """A call per size, fixed-width prompts (so a repeated size repeats the header bytes);
    returns (every call exact, calls whose batch a receiver built while it waited)."""
    strategy = strategies.get("shm", ctx.groups_for(LAYOUT), **options)
    exact = []
    for call, b in enumerate(sizes):
        want = batch(call % 10, b)
        entry = batch(call % 10, b) if strategy.groups.is_leader else want.entry_state(False)
        out = strategy.get_data_input(entry)
        exact.append(same(out, want))
        del out
        torch.distributed.barrier()  # the releases are in before the leader's next turn
    return exact, strategy.guessed


def run_ahead_job(ctx, calls: int, words: bool):
    """The leader calls ``calls`` times in a row with no barrier; every reader takes each batch
    a few milliseconds late, so the leader runs a ring ahead and waits for the slowest read
    (``_wait_behind``). Returns (calls exact, the leader's segments made)."""
    if not words:
        shm_core.report_words_allowed = lambda: False
    try:
        strategy = strategies.get("shm", ctx.groups_for(LAYOUT))
        exact = 0
        for seed in range(calls):
            want = batch(seed)
            entry = batch(seed) if strategy.groups.is_leader else want.entry_state(False)
            if not strategy.groups.is_leader:
                time.sleep(0.005)  # pacing only: no verdict reads a clock
            out = strategy.get_data_input(entry)
            exact += same(out, want)
            del out
        torch.distributed.barrier()
        return exact, strategy.channel.segments_made
    finally:  # a world's ranks outlive the test
        shm_core.report_words_allowed = REPORT_WORDS_ALLOWED


@pytest.mark.parametrize("words", [True, False], ids=["words", "sockets"])
def test_a_leader_that_runs_a_ring_ahead_waits_for_its_readers_and_every_call_is_exact(
    world4, words
):
    """Readers that report in words wake no waiting leader: it looks again after short pauses;
    a leader left waiting for a word it cannot see would hang the world (its limit fails the
    test)."""
    calls = 12
    results = world4.run(run_ahead_job, calls, words, timeout_s=60)
    assert [exact for exact, _ in results] == [calls] * 4, results
    # Held slots are retired, never overwritten: at most a segment per call past the ring's.
    assert results[0][1] <= 3 + calls, results[0][1]


@pytest.mark.parametrize("options", [{}, {"early_min_bytes": 0}], ids=str)
def test_a_receiver_builds_a_repeated_shape_while_it_waits_and_never_a_wrong_one(world4, options):
    # A change of shape (4 -> 6 rows, and back) is a guess that fails on the header bytes:
    # that call is unpacked from its own header. The first calls have no segment to guess.
    sizes = [4, 4, 4, 4, 6, 6, 6, 4, 4, 4]
    results = world4.run(guess_job, sizes, options, timeout_s=60)
    for rank, (exact, guessed) in enumerate(results):
        assert all(exact), f"rank {rank}: calls {[i for i, e in enumerate(exact) if not e]} inexact"
        if rank == 0:
            assert guessed == 0, "the leader guesses nothing"
        else:
            # 3 slots: calls 3 on (the ring's segments all delivered), less the two changes.
            assert guessed >= 4, f"rank {rank}: only {guessed} of {len(sizes)} calls guessed"


def test_a_receiver_guesses_the_next_shape_of_a_cycle(world4):
    """Shapes in turn (4, 6, 4, 6, ...): each call's guess is the header that followed the last
    one the last time (a guess of the last header again would fail on every call)."""
    sizes = [4, 6] * 8
    for rank, (exact, guessed) in enumerate(world4.run(guess_job, sizes, {}, timeout_s=60)):
        assert all(exact), f"rank {rank}: calls {[i for i, e in enumerate(exact) if not e]} inexact"
        if rank:
            # 3 slots: no segment to guess in before call 3; every call from there on holds.
            assert guessed >= len(sizes) - 5, f"rank {rank}: {guessed} of {len(sizes)} guessed"


def refusal_job(ctx) -> str:
    """shm told not to stage on groups that live on a device: the error it raises."""
    groups = dataclasses.replace(ctx.groups_for(LAYOUT), device=torch.device("meta"))
    try:
        strategies.get("shm", groups, stage=False)
    except ValueError as exc:
        return str(exc)
    return "built"


def test_views_of_the_segment_are_refused_for_groups_on_a_device(world4):
    """A segment is host memory: on a device shm stages (its default there); stage=False is
    refused on every rank, naming the rank, the device and the option that works."""
    for rank, message in enumerate(world4.run(refusal_job)):
        assert message.startswith(f"rank {rank}: shm: stage=False"), message
        assert "meta" in message and "need stage=True" in message, message


def size_option_job(ctx, option: str, value) -> str:
    """shm built with a byte-count option that is not one: the error it raises."""
    try:
        strategies.get("shm", ctx.groups_for(LAYOUT), **{option: value})
    except ValueError as exc:
        return str(exc)
    return "built"


@pytest.mark.parametrize("value", ["1MiB", -1, 1.5, True], ids=repr)
@pytest.mark.parametrize("option", ["early_min_bytes", "stripe_min_bytes"])
def test_a_byte_count_option_that_is_not_one_is_refused_by_name(world4, option, value):
    """On every rank, in one line: a value of another type by its field's type, a negative
    count by the strategy's own check."""
    want = (
        f"shm: {option} must be a byte count (an int >= 0) or None, got {value!r}"
        if value == -1
        else f"shm: option {option!r} must be an int or null, got {value!r}"
    )
    for message in world4.run(size_option_job, option, value):
        assert message == want, message


def signal_fault_job(ctx, fail_at: int, options: dict):
    """A good call, then one where the leader's ``fail_at``-th signal send raises, then a
    call after it. (outcome per call, seconds of the faulty one) on this rank."""
    groups = ctx.groups_for(LAYOUT)
    strategy = strategies.get("shm", groups, **options)
    outcomes = []
    sent = 0
    real = shm_core.socket.send_fds

    def faulty(sock, buffers, fds, *args):
        nonlocal sent
        sent += 1
        if sent == fail_at:
            raise OSError("injected signal failure")
        return real(sock, buffers, fds, *args)

    seconds = 0.0
    for seed in range(3):
        want = batch(seed)
        entry = batch(seed) if groups.is_leader else want.entry_state(False)
        patch = seed == 1 and groups.is_leader
        if patch:
            shm_core.socket.send_fds = faulty
        t0 = time.monotonic()
        try:
            out = strategy.get_data_input(entry)
            outcomes.append("exact" if same(out, want) else "wrong")
        except Exception as exc:  # noqa: BLE001 -- the test looks at every rank's outcome
            outcomes.append(f"{type(exc).__name__}: {exc}")
        finally:
            shm_core.socket.send_fds = real
        if seed == 1:
            seconds = time.monotonic() - t0
    return outcomes, seconds, strategy.channel.readers


@pytest.mark.parametrize("early_min_bytes", [0, None], ids=["early", "whole"])
def test_a_signal_that_cannot_be_sent_strands_no_rank(world4, early_min_bytes):
    """The reader whose signal failed raises at once (its socket is closed); the readers that
    were told get the whole message when it was signalled whole, and the leader's error when
    it was signalled early (the leaves are never copied: the call is aborted for all)."""
    options = {"early_min_bytes": early_min_bytes}
    results = world4.run(signal_fault_job, 2, options, timeout_s=3 * FAIL_WITHIN_S)
    readers = list(results[0][2])
    missed = readers[1]  # the second signal of the call goes to the second reader
    leader_out = results[0][0]
    assert leader_out[0] == "exact" and "injected signal failure" in leader_out[1], leader_out
    assert f"rank {missed}" in leader_out[1], leader_out
    for rank in readers:
        outcomes, seconds, _ = results[rank]
        assert outcomes[0] == "exact", (rank, outcomes)
        assert seconds < FAIL_WITHIN_S, (rank, seconds)
        if rank == missed:
            assert outcomes[1].startswith(f"ShmError: rank {rank}: shm: node leader rank 0"), (
                outcomes
            )
        elif early_min_bytes is None:
            assert outcomes[1] == "exact", (rank, outcomes)
        else:
            assert outcomes[1].startswith(f"LeaderFailed: rank {rank}: the replica leader"), (
                outcomes
            )
            assert f"node-local rank {missed}" in outcomes[1], outcomes
    # The broken channel says so on every later call instead of waiting.
    assert results[missed][0][2].startswith("ShmError"), results[missed][0]
    assert f"rank {missed}" in leader_out[2], leader_out


def mismatched_stripes_job(ctx):
    """Rank 3 builds shm with another ``stripe_min_bytes`` than the rest, across two nodes;
    every rank's outcome of the first call, and how long it took."""
    groups = dataclasses.replace(ctx.groups_for(LAYOUT), node_of=(0, 0, 1, 1))
    strategy = strategies.get("shm", groups, stripe_min_bytes=0 if ctx.rank == 3 else None)
    want = batch(0)
    t0 = time.monotonic()
    try:
        strategy.get_data_input(batch(0) if groups.is_leader else want.entry_state(False))
        outcome = "returned"
    except Exception as exc:  # noqa: BLE001 -- the test reads every rank's outcome
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, time.monotonic() - t0


def test_ranks_that_disagree_on_stripes_all_refuse_at_set_up(world4):
    """A stripe receiver built with another threshold would wait for a slice nobody sends:
    the set-up's one gather carries every rank's, and every rank refuses, naming them."""
    for rank, (outcome, seconds) in enumerate(world4.run(mismatched_stripes_job, timeout_s=60)):
        assert outcome.startswith(f"ShmError: rank {rank}: shm: stripe_min_bytes differs"), outcome
        assert "rank 0: None" in outcome and "rank 3: 0" in outcome, outcome
        assert seconds < FAIL_WITHIN_S, (rank, seconds)


KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, datetime
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from tensordict import TensorDict
    import strategies
    from strategies.core.process_groups import ProcessGroups

    def main(rank, world, port, out_dir, name):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        ranks = tuple(range(world))
        g = dist.new_group(list(ranks))
        groups = ProcessGroups(g, g, g, ranks, ranks, ranks, 0, rank, rank=rank)
        s = strategies.get(name, groups)
        td = TensorDict({"x": torch.arange(4 << 20, dtype=torch.uint8).view(4, -1)}, [4])
        entry = strategies.DataProto(td if rank == 0 else None, {}, {})
        held = s.get_data_input(entry)
        assert torch.equal(held.batch["x"], td["x"])
        open(os.path.join(out_dir, f"ready{rank}"), "w").close()
        if rank == 0:
            time.sleep(600)  # killed here
        t0 = time.monotonic()
        try:
            s.get_data_input(strategies.DataProto(None, {}, {}))
            what = "returned"
        except Exception as exc:
            what = f"{type(exc).__name__}: {exc}"
        # Written aside and renamed: the test reads the file as soon as it exists.
        path = os.path.join(out_dir, f"rank{rank}")
        with open(path + ".part", "w") as f:
            f.write(f"{time.monotonic() - t0:.3f}\\n{what}\\n{int(torch.equal(held.batch['x'], td['x']))}")
        os.rename(path + ".part", path)
        os._exit(0)

    if __name__ == "__main__":
        world, port, out_dir, name = 3, int(sys.argv[1]), sys.argv[2], sys.argv[3]
        mp.start_processes(main, args=(world, port, out_dir, name), nprocs=world, start_method="fork",
                           join=False)
        print(os.getpid(), flush=True)
        time.sleep(600)
    """
)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _shm_listing() -> list[str]:
    return sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []


def _mapped_shm(pid: int) -> set[str]:
    """The shared segments process ``pid`` maps: /dev/shm names (``(deleted)`` once
    unlinked, dropped here) and memfds (``memfd:<name>``, never in /dev/shm)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            fields = [line.split(maxsplit=5) for line in f]
        paths = {cols[5].strip() for cols in fields if len(cols) == 6}
    except OSError:
        return set()
    return {
        p.removeprefix("/dev/shm/").removeprefix("/").removesuffix(" (deleted)")
        for p in paths
        if p.startswith(("/dev/shm/", "/memfd:"))
    }


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


@pytest.mark.parametrize("name", ["shm", "vllm_shm_broadcast", "independent_fetch"])
def test_kill_9_of_the_leader_reaches_every_reader_at_once_and_leaves_no_segment(tmp_path, name):
    before = _shm_listing()
    script = tmp_path / "kill_job.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(_free_port()), str(tmp_path), name],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in range(3)):
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            assert time.monotonic() < deadline, "the job never got ready"
            time.sleep(0.1)
        during = _shm_listing()
        ranks = sorted(_children(proc.pid))
        assert len(ranks) == 3, ranks
        ours = sorted({name for rank in ranks for name in _mapped_shm(rank)})
        leader = ranks[0]  # forked first: rank 0
        time.sleep(0.5)  # the readers are waiting for their second batch
        os.kill(leader, signal.SIGKILL)
        while not all((tmp_path / f"rank{r}").exists() for r in (1, 2)):
            assert time.monotonic() < deadline + 60, "a reader never learnt of the leader's death"
            time.sleep(0.05)
        for r in (1, 2):
            seconds, what, held = (tmp_path / f"rank{r}").read_text().splitlines()
            assert float(seconds) < FAIL_WITHIN_S, (r, seconds, what)
            assert what.startswith(f"ShmError: rank {r}: {name}: "), what
            assert "rank 0" in what, what
            assert held == "1", f"rank {r}: its held batch changed after the leader died"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    after = _shm_listing()
    print(
        f"\n{name}: /dev/shm before {before}, while running {during}, after kill -9 {after}; "
        f"the ranks mapped {ours}"
    )
    # The job's own segments (what its ranks mapped): shm's (and independent_fetch's store) are
    # memfds, which no name in /dev/shm can ever hold; vllm's named ones are unlinked once every
    # rank has them open, so none is listed while the job runs or after the kill.
    named = [n for n in ours if not n.startswith("memfd:")]
    if name in ("shm", "independent_fetch"):
        assert ours and not named, ours
    else:
        assert named, f"the ranks mapped no named segment: nothing was checked ({ours})"
    assert [n for n in named if n in set(during) | set(after)] == []
    # Nor is any other name of ours left (multiprocessing.shared_memory's prefix, and ours).
    assert [n for n in after if n not in before and n.startswith(("psm_", "bcastbench"))] == []


LARGE_ROWS = REUSE_MIN_BYTES // 4000 + 64  # batch(): ≈ 4.15 kB a row


def large_reuse_job(ctx, name: str, calls: int, hold_first: bool):
    """``calls`` calls of a batch past ``REUSE_MIN_BYTES``, each let go before the next
    (``hold_first``: a reader keeps the first one to the end). Returns (calls exact, the first
    batch still exact, segments the leader made)."""
    strategy = strategies.get(name, ctx.groups_for(LAYOUT))
    exact, held = 0, None
    for seed in range(calls):
        want = batch(seed, LARGE_ROWS)
        entry = want if strategy.groups.is_leader else want.entry_state(False)
        out = strategy.get_data_input(entry)
        exact += same(out, batch(seed, LARGE_ROWS))
        if seed == 0 and hold_first and ctx.rank == 3:
            held = out
        del out, entry
        torch.distributed.barrier()  # every release is in before the leader's next turn
    still = held is None or same(held, batch(0, LARGE_ROWS))
    made = strategy.channel.segments_made if strategy.groups.is_leader else None
    return exact, still, made


@pytest.mark.parametrize("name", ["shm", "independent_fetch"])
@pytest.mark.parametrize("hold_first", [False, True], ids=["let-go", "held"])
def test_a_large_message_reuses_its_slot_once_let_go(world4, name, hold_first):
    """Past REUSE_MIN_BYTES the leader writes the next message into the same slot when every
    reader let it go: one segment (one copy of the batch) on the node, not one per slot. A shm
    reader still holding the first batch keeps it whole: its slot is not written while held
    (independent_fetch's readers copy theirs out, so they hold no slot)."""
    calls = 5
    results = world4.run(large_reuse_job, name, calls, hold_first, timeout_s=120)
    assert [r[:2] for r in results] == [(calls, True)] * 4, results
    made = results[0][2]
    assert made == (2 if hold_first and name == "shm" else 1), made


class Foreign:
    """A leaf no framework's batch holds and no strategy can carry: the leader refuses it."""

    def __reduce__(self):
        raise TypeError("Foreign leaves do not pickle")


def foreign_after_large_job(ctx, name: str):
    """A large call (its slot reused from then on), then the leader is handed a batch the
    project did not make (a non-tensor batch entry that cannot be encoded), then a large call
    again. Returns each call's outcome on this rank and the failed call's seconds."""
    strategy = strategies.get(name, ctx.groups_for(LAYOUT))
    leader = strategy.groups.is_leader
    outcomes, seconds = [], None
    for call in range(3):
        want = batch(call, LARGE_ROWS)
        if call == 1 and leader:
            want.non_tensor_batch["prompt"][0] = Foreign()
        entry = want if leader else want.entry_state(False)
        t0 = time.monotonic()
        try:
            out = strategy.get_data_input(entry)
            outcomes.append("exact" if same(out, batch(call, LARGE_ROWS)) else "wrong")
            del out
        except Exception as exc:  # noqa: BLE001 -- the test looks at every rank's outcome
            outcomes.append(f"{type(exc).__name__}: {exc}")
        if call == 1:
            seconds = time.monotonic() - t0
        del entry
        torch.distributed.barrier()
    return outcomes, seconds


@pytest.mark.parametrize("name", ["shm", "independent_fetch"])
def test_a_foreign_batch_after_a_reused_slot_fails_every_rank_at_once(world4, name):
    """The leader's failure on a batch it cannot encode, after a large message whose slot it
    reuses, reaches every reader within seconds (none waits for a message that will not come),
    and the next large call is exact on every rank."""
    results = world4.run(foreign_after_large_job, name, timeout_s=3 * FAIL_WITHIN_S + 60)
    for rank, (outcomes, seconds) in enumerate(results):
        assert outcomes[0] == "exact" and outcomes[2] == "exact", (rank, outcomes)
        assert outcomes[1] != "exact" and "Foreign" in outcomes[1], (rank, outcomes)
        assert seconds < FAIL_WITHIN_S, (rank, seconds)
