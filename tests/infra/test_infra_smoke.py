"""Smoke tests for the beyond-one-machine infrastructure, independent of the rest of the project:
a real single-node Slurm (srun, sacct, crash handling) and namespace nodes with shaped links.

They skip when the machine cannot host them (not root, no apt/netns); set BCB_REQUIRE_INFRA=1 to
turn those skips into failures (e.g. in CI that is known to be able to run them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.machine import other_cores, snapshot
from harness.worlds.emulated_network import (
    EmulateConf as EmulatedCluster,
)
from harness.worlds.emulated_network import (
    Emulation,
    EmulationUnavailable,
    unavailable_reason,
)

from .slurm import SlurmCluster

HERE = Path(__file__).resolve().parent
PROBE = HERE / "bcast_probe.py"
MIB16 = 16 * 2**20
# Bytes on the wire per payload byte: Ethernet+IP+TCP(+timestamps) headers at MTU 1500.
WIRE = 1514 / 1448
FRAME = 1514  # one full Ethernet frame at MTU 1500
PAYLOAD = 1448 / 1514  # tbf shapes wire bytes; payload gets this fraction of the rate

pytestmark = pytest.mark.world


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("BCB_REQUIRE_INFRA") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


# -- Slurm -------------------------------------------------------------------------------
@pytest.fixture
def slurm(slurm_cluster):
    """The session's cluster (tests/conftest.py), shared with tests/test_slurm.py."""
    slurm_cluster.wait_idle(timeout=60)
    return slurm_cluster


ALLREDUCE = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    # Map Slurm's task variables onto torch's env:// rendezvous.
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ["SLURM_LOCALID"]
    dist.init_process_group("gloo", init_method="env://")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"ALLREDUCE rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item()}")
    dist.destroy_process_group()
    """
)

CRASH = textwrap.dedent(
    """
    import os, sys, time
    if os.environ["SLURM_PROCID"] == "1":
        sys.exit(3)
    time.sleep(300)  # the survivor must be killed by Slurm, not run out its sleep
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sacct_state(slurm: SlurmCluster, job: str, timeout: float = 30.0) -> str:
    # slurmctld sends job records to slurmdbd asynchronously, so poll briefly.
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        res = slurm.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"])
        state = res.stdout.strip()
        if state and not state.startswith(("PENDING", "RUNNING", "COMPLETING")):
            return state
        time.sleep(0.5)
    return state


PORT_TAKEN = "EADDRINUSE"
"""What rank 0's store says when the port picked for it was taken before srun started it."""


def test_slurm_srun_gloo_allreduce_and_sacct(slurm, tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    env = {**os.environ, **slurm.env, "MASTER_ADDR": "127.0.0.1"}
    env["OMP_NUM_THREADS"] = "1"
    # A free port is free only when picked: srun starts rank 0's store seconds later, and the
    # other test session's connections draw from the same ports meanwhile. A step whose store
    # found its port taken (it says so) is run again on another, at most three times.
    for _ in range(3):
        env["MASTER_PORT"] = str(_free_port())
        res = subprocess.run(
            ["srun", "-n", "4", "-t", "2", "--kill-on-bad-exit=1", "-J", "bcb-allreduce"]
            + [sys.executable, str(script)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            check=False,
        )
        if res.returncode == 0 or PORT_TAKEN not in res.stdout + res.stderr:
            break
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("ALLREDUCE"))
    assert lines == [f"ALLREDUCE rank={r} world=4 sum=10.0" for r in range(4)], res.stdout
    # The job must be in the accounting database, completed.
    res = slurm.run(["sacct", "-X", "-n", "-P", "--name", "bcb-allreduce", "-o", "JobID"])
    jobs = res.stdout.split()
    deadline = time.monotonic() + 30
    while not jobs and time.monotonic() < deadline:
        time.sleep(0.5)
        res = slurm.run(["sacct", "-X", "-n", "-P", "--name", "bcb-allreduce", "-o", "JobID"])
        jobs = res.stdout.split()
    assert jobs, f"sacct shows no job: {res.stdout}{res.stderr}"
    assert _sacct_state(slurm, jobs[-1]) == "COMPLETED"
    slurm.wait_idle(timeout=60)


def test_slurm_crashed_task_ends_job(slurm, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    t0 = time.monotonic()
    res = subprocess.run(
        ["sbatch", "--parsable", "--wait", "-n", "2", "-t", "2", "-J", "bcb-crash"]
        + [f"--output={tmp_path / 'crash.out'}", "--wrap"]
        + [f"srun --kill-on-bad-exit=1 {sys.executable} {script}"],
        capture_output=True,
        text=True,
        env={**os.environ, **slurm.env},
        timeout=90,
        check=False,
    )
    elapsed = time.monotonic() - t0
    assert res.returncode != 0, "a job whose task exits 3 must fail"
    assert elapsed < 60, f"crashed job took {elapsed:.0f} s to end"
    job = res.stdout.strip().split(";")[0]
    assert _sacct_state(slurm, job) == "FAILED"
    slurm.wait_idle(timeout=60)


# -- emulated nodes ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def netns_ok():
    reason = unavailable_reason()
    if reason is not None:
        _skip_or_fail(f"network namespaces unavailable: {reason}")


def _ours(emu: Emulation) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [ln.split()[0] for ln in out.stdout.splitlines() if emu.uid in ln.split()[0]]


def _measure(emu: Emulation, group: str, repeats: int, attempts: int = 3) -> tuple[list, float]:
    """Run the probe until its best repeat is within 15 % of the shaped rate (at most
    ``attempts`` runs); return every run's result and the cores other work used meanwhile."""
    expected = emu.cfg.rate_mbit * PAYLOAD
    results = []
    start = snapshot()
    for attempt in range(attempts):
        results.append(_torchrun_probe(emu, group, repeats, attempt))
        if 0.85 <= results[-1]["best_mbit_s"] / expected <= 1.15:
            break
    # ksoftirqd moving our own packets counts as "other work", hence a margin in _check_rate.
    return results, other_cores(start) or 0.0


def _check_rate(results: list, foreign: float, rate_mbit: int) -> float:
    ratios = [r["best_mbit_s"] / (rate_mbit * PAYLOAD) for r in results]
    best = min(ratios, key=lambda x: abs(x - 1))
    if not 0.85 <= best <= 1.15 and best < 1 and foreign > 0.5:
        # Other work on the 2 cores only slows the ranks down; a shaped link cannot.
        pytest.skip(f"machine busy ({foreign:.1f} cores of other work): rate ratios {ratios}")
    assert 0.85 <= best <= 1.15, (ratios, foreign, results)
    return best


def _torchrun_probe(emu: Emulation, group: str, repeats: int, attempt: int = 0) -> dict:
    cfg = emu.cfg
    endpoint = f"{emu.node_ip(0)}:{29511 + attempt}"
    procs = []
    for node in range(cfg.nodes):
        env = {"BCB_NODE": str(node), "OMP_NUM_THREADS": "1"}
        if cfg.links == "node":
            env["GLOO_SOCKET_IFNAME"] = emu.rank_ifname(node * cfg.ranks_per_node)
        else:  # one interface per local rank; the probe picks eth<LOCAL_RANK>
            env["BCB_IFNAME_PATTERN"] = "eth{local_rank}"
        argv = [sys.executable, "-m", "torch.distributed.run"]
        argv += ["--nnodes", str(cfg.nodes), "--nproc-per-node", str(cfg.ranks_per_node)]
        argv += [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            f"smoke{attempt}",
        ]
        # The namespaces share the host's name, which resolves outside them: say who hosts
        # the rendezvous store and which address each agent has (also fixes rank order).
        argv += ["--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", emu.node_ip(node)]
        argv += ["--max-restarts", "0", str(PROBE), "--group", group]
        argv += ["--repeats", str(repeats), "--mib", "16"]
        procs.append(
            emu.popen(node, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        outs.append(out.decode(errors="replace"))
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(o[-3000:] for o in outs)
    lines = [ln for o in outs for ln in o.splitlines() if ln.startswith("BCAST_PROBE ")]
    assert len(lines) == 1, outs
    return json.loads(lines[0].split(" ", 1)[1])


def test_emulated_two_nodes_torchrun_shaped_link(netns_ok):
    cfg = EmulatedCluster(nodes=2, rate_mbit=1000, links="node", ranks_per_node=2)
    repeats = 5
    with Emulation(cfg) as emu:
        assert [emu.node_of_rank(r) for r in range(4)] == [0, 0, 1, 1]
        assert emu.rank_ip(0) == emu.rank_ip(1) != emu.rank_ip(2)
        before, resent = emu.link_bytes(), emu.retransmitted_segments()
        results, foreign = _measure(emu, "0,2", repeats)
        after = emu.link_bytes()
        resent = emu.retransmitted_segments()["n0"] - resent["n0"]
        names = _ours(emu)
    assert len(names) == 3  # two nodes and the hub
    assert not [n for n in subprocess.getoutput("ip netns list").split() if n in names]

    broadcasts = repeats * len(results)
    sent = (after["n0"] - before["n0"]) / broadcasts
    back = (after["n1"] - before["n1"]) / broadcasts
    # What node 0 resent (the shaped link drops what overflows its queue; a busy host drops
    # more) is in its tx counter too; a resent segment is at most one full frame.
    once = sent - resent * FRAME / broadcasts
    r = results[-1]
    print(
        f"\nshaped 1 Gbit, 16 MiB node0->node1: median {r['median_s'] * 1e3:.1f} ms "
        f"({r['mbit_s']:.0f} Mbit/s), best {r['best_mbit_s']:.0f} Mbit/s; {len(results)} run(s), "
        f"other work {foreign:.2f} cores\n"
        f"node-0 link tx per broadcast: {sent / MIB16:.4f} x 16 MiB "
        f"({resent} segments resent in all); node-1 (acks): {back:.0f} B"
    )
    # Each broadcast sends 16 MiB plus headers over node 0's link; rendezvous and barrier
    # chatter is a few hundred KB for the whole run; retransmissions aside, nothing is sent twice.
    assert MIB16 * WIRE * 0.99 <= sent, (before, after)
    assert once <= MIB16 * WIRE * 1.03, (before, after, resent)
    assert back < 0.05 * MIB16
    _check_rate(results, foreign, cfg.rate_mbit)


def test_emulated_rails_each_rank_uses_its_own_link(netns_ok):
    cfg = EmulatedCluster(nodes=2, links="gpu", ranks_per_node=2)
    with Emulation(cfg) as emu:
        assert [emu.rank_ifname(r) for r in range(4)] == ["eth0", "eth1", "eth0", "eth1"]
        assert len({emu.rank_ip(r) for r in range(4)}) == 4
        before = emu.link_bytes()
        results, foreign = _measure(emu, "1,3", repeats=5)
        after = emu.link_bytes()
        both = _torchrun_probe(emu, "0,2;1,3", repeats=3, attempt=5)  # two rails at once
    grew = {k: after[k] - before[k] for k in after}
    assert grew["n0g1"] >= MIB16, grew  # rank 1's own rail carried the payload
    assert grew["n0g0"] < 0.05 * MIB16, grew  # and rank 0's rail did not
    one = _check_rate(results, foreign, cfg.rate_mbit) * cfg.rate_mbit * PAYLOAD
    # Two rails at once carry more than one link can (sharing one link would give <= 1x): on a
    # quiet 2-core VM 1740 Mbit/s of payload against 948 for one; the host's cores move every
    # packet, so a slower or busier host gets less of the 2x. Same-run ratio.
    gain = both["aggregate_best_mbit_s"] / one
    if gain <= 1.05 and foreign > 0.5:
        pytest.skip(f"machine busy ({foreign:.1f} cores of other work): two rails gave {gain:.2f}x")
    assert gain > 1.05, (both, one)


def test_emulation_cleans_up_on_exception_and_sigterm(netns_ok, tmp_path):
    with pytest.raises(RuntimeError, match="boom"), Emulation(nodes=3) as emu:
        names = _ours(emu)
        assert len(names) == 4
        raise RuntimeError("boom")
    assert _ours(emu) == []

    # A process killed by SIGTERM inside the context still removes its namespaces.
    child = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(HERE.parent.parent)!r})
        from harness.worlds.emulated_network import Emulation
        with Emulation(nodes=2) as emu:
            print(emu.uid, flush=True)
            time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    uid = proc.stdout.readline().strip()
    assert uid, "child did not start an emulation"
    listed = subprocess.getoutput("ip netns list")
    assert f"bcb-{uid}-hub" in listed
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert f"bcb-{uid}-" not in subprocess.getoutput("ip netns list")

    # Leftovers of a process that died without cleaning up are removed by the next run.
    stale = f"bcb-{proc.pid}-9-n0"  # proc has exited, so its pid is not alive
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with Emulation(nodes=1):
            assert stale not in subprocess.getoutput("ip netns list")
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True, check=False)


def test_emulation_reports_unavailable_cleanly(monkeypatch):
    import harness.worlds.emulated_network as emulate

    monkeypatch.setattr(emulate.os, "geteuid", lambda: 1000)
    assert "root" in (emulate.unavailable_reason() or "")
    with pytest.raises(EmulationUnavailable, match="root"), Emulation():
        pass
