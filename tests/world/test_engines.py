"""Tier 2 (real gloo worlds) and unit checks: what the one-sided engine strategies (``mooncake``,
``nixl``: ``strategies.core.engine_store``) promise beyond the contract every strategy's tests
check. Their engines listen only inside the job's own loopback-only network namespace
(Mooncake's TCP transport binds every interface, UCX the host's), and they refuse on every rank
where the network is the host's; one engine per process however many instances; the leader's
registered buffer is withdrawn when the instance goes; nothing listens after a kill -9.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tensordict import TensorDict
from test_nothing_left import HOST_NETNS, interfaces, listeners

import strategies
from harness.job.execute import run_job
from harness.job.spec import JobSpec
from harness.paths import REPO
from harness.worlds.forked import STACKS_PREFIX, orphaned, world_directory
from strategies.core import engine_store
from strategies.core.layout import Layout


def where_available(*names: str) -> list:
    """``names`` as parameters, each skipped with its strategy's own reason where it cannot run
    here (a missing package, no network namespace of the job's own)."""
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                strategies.get_class(name).unavailable() is not None,
                reason=str(strategies.get_class(name).unavailable()),
            ),
        )
        for name in names
    ]


ENGINES = where_available("mooncake", "nixl")


def test_refused_where_the_network_has_more_than_loopback(monkeypatch):
    monkeypatch.setattr(engine_store.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    problem = engine_store.private_network_problem()
    assert "eth0" in problem and "loopback-only network namespace" in problem
    monkeypatch.setattr(engine_store.socket, "if_nameindex", lambda: [(1, "lo")])
    assert engine_store.private_network_problem() is None


def _pid(ctx) -> int:
    return os.getpid()


@pytest.mark.parametrize("name", ENGINES)
def test_engines_listen_inside_the_jobs_own_network_only(world4, name):
    if not world4.private_network:
        pytest.skip("the forked world has no network of its own here (not root)")
    spec = JobSpec(
        name, Layout(tp=2, pp=2), batch_size=8, seq_len=64, iters=2, warmup=1,
        references=("floor", "shm"),
    )  # fmt: skip
    record = run_job(world4, spec)
    assert record["correct"] and record["collectives_per_call"] == 3
    pids = set(world4.run(_pid, what="pids"))
    found = listeners(pids)
    print(f"{name} job on tp2pp2, listening sockets:", *found, sep="\n  ")
    assert found, f"{name}'s engines listen nowhere: the check below would check nothing"
    if name == "mooncake":
        wide = [f for f in found if f[2] in ("0.0.0.0", "::")]
        assert wide, "Mooncake's TCP transport listens on every interface (the namespace's why)"
    for pid, _, _, port, netns in found:
        assert netns != HOST_NETNS, f"rank pid {pid} listens on {port} in the host's network"
        assert interfaces(pid) == ["lo"], (pid, interfaces(pid))


def _instances(ctx, name: str) -> tuple[int, int, bool]:
    """Two instances of ``name`` built and called one after the other on this rank: the
    identity of the engine each used, and whether the first's registered buffer was withdrawn
    when it went."""
    import gc

    cls = strategies.get_class(name)
    groups = ctx.groups_for(Layout(tp=2, pp=2))
    td = TensorDict({"x": torch.arange(4096.0).reshape(8, 512)}, [8])
    batch = strategies.DataProto(td, {}, {})
    engines, withdrawn = [], []
    original = vars(cls)["withdraw"]  # the staticmethod itself, put back as it was

    def withdraw(engine, address):
        withdrawn.append(address)
        original.__func__(engine, address)

    cls.withdraw = staticmethod(withdraw)
    try:
        for _ in range(2):
            s = cls(groups)
            out = s.get_data_input(batch.entry_state(groups.is_leader))
            assert torch.equal(out.batch["x"], batch.batch["x"])
            engines.append(id(s.engine))
            del s, out
            gc.collect()
    finally:
        cls.withdraw = original
    return engines[0], engines[1], len(withdrawn) == (2 if groups.is_leader else 0)


@pytest.mark.parametrize("name", ENGINES)
def test_one_engine_per_process_and_the_leaders_buffer_withdrawn(world4, name):
    if not world4.private_network:
        pytest.skip("the forked world has no network of its own here (not root)")
    for first, second, withdrawn in world4.run(_instances, name, what="two instances"):
        assert first == second, "a second instance started a second engine"
        assert withdrawn, "the leader's registered buffer outlived its instance"


DRIVER = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
from harness.worlds.forked import ForkedWorld
from harness.job.execute import run_job
from harness.job.spec import JobSpec
from strategies.core.layout import Layout
def pid(ctx):
    return os.getpid()
world = ForkedWorld(2).start()
spec = JobSpec({name!r}, Layout(tp=2), iters=2, warmup=1, batch_size=4, seq_len=64,
               references=("floor",))
assert run_job(world, spec)["correct"]
pids = world.run(pid)
print(json.dumps({{"ranks": pids, "private": world.private_network}}), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("name", ENGINES)
def test_kill_9_of_the_driver_leaves_no_engine_listening(tmp_path, name):
    """The driver of a forked world that ran an engine's job is killed with SIGKILL: its ranks
    (and with them every engine and its listening ports) are gone within 15 s."""
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(repo=str(REPO), name=name)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line, "the driver printed nothing (its job failed: see its stderr)"
        ranks = json.loads(line)["ranks"]
        if not json.loads(line)["private"]:
            pytest.skip("the forked world has no network of its own here (not root)")
        assert listeners(set(ranks)), "the ranks' engines listen while the driver lives"
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while any(os.path.exists(f"/proc/{pid}") for pid in ranks):
            assert time.monotonic() < deadline, "a rank outlived its killed driver"
            time.sleep(0.1)
        assert listeners(set(ranks)) == []
        # Its world's directory outlived it (a SIGKILL removes nothing); the next world's
        # start removes it. Reaped first: a zombie's pid still answers.
        proc.wait(timeout=30)
        mine = [p for p in orphaned() if f"{STACKS_PREFIX}{proc.pid}-" in p]
        assert mine, "the killed driver's world directory was not found"
        fresh = world_directory()
        os.rmdir(fresh)
        assert not any(os.path.exists(p) for p in mine)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _expose_fails(ctx, name: str) -> str:
    """One call of ``name`` whose leader's engine refuses to expose any buffer: what each rank
    raised (the failure must reach the readers in the signal's place, not strand them)."""
    cls = strategies.get_class(name)
    groups = ctx.groups_for(Layout(tp=2, pp=2))
    batch = strategies.DataProto(TensorDict({"x": torch.ones(4, 8)}, [4]), {}, {})
    s = cls(groups)

    def refuse(address, nbytes):
        raise RuntimeError(f"engine refused {nbytes} bytes")

    s.expose = refuse
    try:
        s.get_data_input(batch.entry_state(groups.is_leader))
    except Exception as exc:  # noqa: BLE001 -- what each rank raised is the answer
        return f"{type(exc).__name__}: {exc}"
    return "returned"


@pytest.mark.parametrize("name", ENGINES)
def test_a_leader_that_cannot_expose_fails_every_rank_at_once(world4, name):
    if not world4.private_network:
        pytest.skip("the forked world has no network of its own here (not root)")
    said = world4.run(_expose_fails, name, what="exposing fails", timeout_s=60)
    assert all("engine refused" in line for line in said), said
    assert said[0].startswith("RuntimeError"), said[0]
    assert all("rank 0" in line for line in said[1:]), said


AGENT_PROCESS = """
import os, sys, time
sys.path.insert(0, {repo!r})
import strategies.nixl as nixl
agent = nixl.start_agent("exit-check")
start = time.process_time()
time.sleep(0.5)
print(time.process_time() - start, flush=True)
"""


@pytest.mark.skipif(
    strategies.get_class("nixl").missing_package() is not None, reason="NIXL not installed"
)
def test_a_process_with_a_nixl_agent_idles_and_exits_cleanly():
    """An agent as every rank starts one costs no CPU while the process idles (NIXL's progress
    thread would spin a core) and the process exits with 0 (UCX's InfiniBand modules, left
    loaded, make it end in SIGSEGV)."""
    done = subprocess.run(
        [sys.executable, "-c", AGENT_PROCESS.format(repo=str(REPO))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    # CPU time of this process over half a second of sleep: a spinning thread adds whatever
    # share of a core it got, which is never zero; an idle process uses next to none.
    assert float(done.stdout.strip()) < 0.05, done.stdout
