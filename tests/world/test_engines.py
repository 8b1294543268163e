"""Tier 2 (real gloo worlds) and unit checks: what ``mooncake`` promises beyond the contract every
strategy's tests check. Its engines listen only inside the job's own loopback-only network
namespace (Mooncake's TCP transport binds every interface), and it refuses on every rank where
the network is the host's; one engine per process however many instances; the leader's
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
from strategies.core import engine_store
from strategies.core.layout import Layout

MISSING = strategies.get_class("mooncake").unavailable()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


def test_refused_where_the_network_has_more_than_loopback(monkeypatch):
    monkeypatch.setattr(engine_store.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    problem = engine_store.private_network_problem()
    assert "eth0" in problem and "loopback-only network namespace" in problem
    monkeypatch.setattr(engine_store.socket, "if_nameindex", lambda: [(1, "lo")])
    assert engine_store.private_network_problem() is None


def _engine_ports(ctx) -> tuple[int, str, int]:
    """This rank's pid, its network namespace and its engine's RPC port, after a call."""
    from strategies.mooncake import _ENGINE

    return os.getpid(), os.readlink("/proc/self/ns/net"), _ENGINE.get_rpc_port()


def test_engines_listen_inside_the_jobs_own_network_only(world4):
    if not world4.private_network:
        pytest.skip("the forked world has no network of its own here (not root)")
    spec = JobSpec(
        "mooncake", Layout(tp=2, pp=2), batch_size=8, seq_len=64, iters=2, warmup=1,
        references=("floor", "shm"),
    )  # fmt: skip
    record = run_job(world4, spec)
    assert record["correct"] and record["collectives_per_call"] == 3
    ranks = world4.run(_engine_ports, what="engine ports")
    pids = {pid for pid, _, _ in ranks}
    found = listeners(pids)
    print("mooncake job on tp2pp2, listening sockets:", *found, sep="\n  ")
    wide = [f for f in found if f[2] in ("0.0.0.0", "::")]
    assert wide, "Mooncake's TCP transport listens on every interface (what the namespace is for)"
    for pid, _, _, port, netns in found:
        assert netns != HOST_NETNS, f"rank pid {pid} listens on {port} in the host's network"
        assert interfaces(pid) == ["lo"], (pid, interfaces(pid))
    assert {port for _, _, port in ranks} <= {f[3] for f in found}


def _instances(ctx) -> tuple[int, int, bool]:
    """Two instances built and called one after the other on this rank: the engine's RPC port
    each used, and whether the first's registered buffer was withdrawn when it went."""
    import gc

    import strategies.mooncake as mc

    groups = ctx.groups_for(Layout(tp=2, pp=2))
    td = TensorDict({"x": torch.arange(4096.0).reshape(8, 512)}, [8])
    batch = strategies.DataProto(td, {}, {})
    ports, withdrawn = [], []
    original = vars(mc.Mooncake)["withdraw"]  # the staticmethod itself, put back as it was

    def withdraw(engine, address):
        withdrawn.append(address)
        original.__func__(engine, address)

    mc.Mooncake.withdraw = staticmethod(withdraw)
    try:
        for _ in range(2):
            s = mc.Mooncake(groups)
            out = s.get_data_input(batch.entry_state(groups.is_leader))
            assert torch.equal(out.batch["x"], batch.batch["x"])
            ports.append(s.engine.get_rpc_port())
            del s, out
            gc.collect()
    finally:
        mc.Mooncake.withdraw = original
    return ports[0], ports[1], len(withdrawn) == (2 if groups.is_leader else 0)


def test_one_engine_per_process_and_the_leaders_buffer_withdrawn(world4):
    if not world4.private_network:
        pytest.skip("the forked world has no network of its own here (not root)")
    for first, second, withdrawn in world4.run(_instances, what="two instances"):
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
spec = JobSpec("mooncake", Layout(tp=2), iters=2, warmup=1, batch_size=4, seq_len=64,
               references=("floor",))
assert run_job(world, spec)["correct"]
pids = world.run(pid)
print(json.dumps({{"ranks": pids, "private": world.private_network}}), flush=True)
time.sleep(600)
"""


def test_kill_9_of_the_driver_leaves_no_engine_listening(tmp_path):
    """The driver of a forked world that ran a mooncake job is killed with SIGKILL: its ranks
    (and with them every engine and its listening ports) are gone within 15 s."""
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(repo=str(REPO))],
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
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
