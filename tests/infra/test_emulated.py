"""The harness beyond one machine, on an emulated cluster (harness.worlds.emulated_network): torchrun across two
"hosts" (network namespaces), the ``emulate.enabled=true`` option end to end, a crashing rank,
and that no ``bcb-`` namespace survives any of it.

Each test starts four ranks that import torch and megatron on a 2-core machine (~25–40 s), so
there are few and each checks several things. They skip when the machine cannot host network
namespaces (not root, no iproute2); BCB_REQUIRE_INFRA=1 turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.worlds.emulated_network import EmulateConf, Emulation, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
FAST = ["iters=2", "warmup=1", "payload.batch_size=64", "payload.seq_len=256"]
WIRE = 1514 / 1448  # wire bytes per payload byte at MTU 1500 (Ethernet + IP + TCP headers)


def test_emulate_options_are_validated():
    """Bad cluster shapes are refused before anything starts (no root needed)."""
    from hydra import compose, initialize_config_dir

    from harness.errors import ConfigError
    from harness.job.config import validate
    from harness.job.config_schema import register

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        ok = compose(config_name="config", overrides=["emulate.enabled=true", "layout=tp2pp2"])
        assert validate(ok).world_size == 4
        for overrides, message in [
            (["emulate.nodes=3"], "does not divide the world of 4"),
            (["emulate.links=rails"], "emulate.links must be node or gpu"),
            (["emulate.ranks_per_node=4"], "ranks_per_node=4 but world 4 / nodes 2 = 2"),
            (["emulate.rate_mbit=0"], "rate_mbit must be positive"),
        ]:
            cfg = compose(
                config_name="config",
                overrides=["emulate.enabled=true", "layout=tp2pp2", *overrides],
            )
            with pytest.raises(ConfigError, match=re.escape(message)):
                validate(cfg)
        # Off by default: the same numbers are not checked when no emulation is asked for.
        off = compose(config_name="config", overrides=["emulate.nodes=3", "layout=tp2pp2"])
        assert validate(off).world_size == 4


@pytest.fixture(scope="module")
def netns_ok():
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("BCB_REQUIRE_INFRA") == "1":
            pytest.fail(reason)
        pytest.skip(f"network namespaces unavailable: {reason}")


def _our_netns() -> list[str]:
    # Namespaces of this test process (bcb-<pid>-…) or of the harness drivers it started and
    # that have exited (their pids are gone; a live concurrent run's are not counted).
    from harness.worlds.emulated_network import _pid_alive

    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    names = [ln.split()[0] for ln in out.stdout.splitlines() if ln.startswith("bcb-")]
    mine = []
    for name in names:
        pid = name[4:].split("-", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or not _pid_alive(int(pid))):
            mine.append(name)
    return mine


@pytest.mark.world
def test_torchrun_across_two_hosts(netns_ok, tmp_path):
    """torchrun --nnodes 2 with a c10d rendezvous, one agent per namespace; the record is
    written once, by global rank 0 on node 0."""
    run_dir = tmp_path / "run"
    cfg = EmulateConf(nodes=2, rate_mbit=1000, links="node", ranks_per_node=2)
    with Emulation(cfg) as emu:
        procs = []
        for node in range(2):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
            argv += ["--nproc-per-node", "2", "--rdzv-backend", "c10d"]
            argv += ["--rdzv-endpoint", f"{emu.node_ip(0)}:29400", "--rdzv-id", "bcb-two-hosts"]
            # The namespaces share the host's name, which resolves outside them: say which agent
            # hosts the rendezvous store and which address each agent has.
            argv += ["--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", emu.node_ip(node)]
            argv += ["--max-restarts", "0", "-m", "harness", "layout=tp2pp2", *FAST]
            argv += [f"hydra.run.dir={run_dir}"]
            # BCB_NODE makes each worker check that it landed on the node of its rank block.
            env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "BCB_NODE": str(node)}
            procs.append(
                emu.popen(
                    node, argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
            )
        before = emu.crossed_bytes()
        outs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in procs]
        crossed = emu.crossed_bytes() - before
        names = _our_netns()
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(o[-3000:] for o in outs)
    rec = json.loads((run_dir / "result.json").read_text())
    assert rec["world_size"] == 4 and rec["correct"] is True and (rec["tp"], rec["pp"]) == (2, 2)
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("result.json")] == [
        Path("run/result.json")
    ]
    assert crossed > rec["payload_bytes"]  # the PP hop really went over the node link
    assert names and not set(names) & set(_our_netns())


def _emulated_job(
    run_dir, *overrides: str, references: str = "[]"
) -> tuple[subprocess.CompletedProcess, float]:
    """One ``python -m harness`` job on the emulated cluster (tp2pp2, no references unless
    given) and its wall time."""
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "harness", "layout=tp2pp2", f"references={references}", *FAST,
         "emulate.enabled=true", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return res, time.monotonic() - t0


@pytest.fixture(scope="module")
def two_node_job(netns_ok, tmp_path_factory):
    """One ``emulate.enabled=true`` job on two emulated nodes (1000 Mbit/s, a link per node):
    pp_first timed, shm, vllm_shm_broadcast and independent_fetch beside it, every one verified
    bit for bit on every rank; (run directory, record, wall seconds). One job serves the tests
    below: each start of the cluster is four ranks importing torch."""
    run_dir = tmp_path_factory.mktemp("two_node") / "run"
    res, elapsed = _emulated_job(
        run_dir, "strategy=pp_first", "emulate.nodes=2", "emulate.rate_mbit=1000",
        "emulate.links=node", "timeout_s=60",
        references="[shm,vllm_shm_broadcast,independent_fetch]",
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return run_dir, json.loads((run_dir / "result.json").read_text()), elapsed


@pytest.mark.world
def test_emulated_cluster_job_records_shape_and_bytes(two_node_job):
    """``emulate.enabled=true``: the driver builds the cluster, runs the ranks inside it, and the
    record carries the cluster's shape and the bytes one call sent across nodes."""
    run_dir, rec, elapsed = two_node_job
    assert rec["correct"] is True and rec["strategy"] == "pp_first"
    assert sorted(p.name for p in run_dir.glob("emulate-node*.log")) == [
        "emulate-node0.log",
        "emulate-node1.log",
    ]
    assert (rec["emulate_nodes"], rec["emulate_links"], rec["emulate_rate_mbit"]) == (
        2,
        "node",
        1000,
    )
    assert rec["emulate_ranks_per_node"] == 2
    # pp_first crosses once: the packed message (payload + header) over node 0's link, as TCP
    # segments; a barrier's few hundred bytes ride along.
    s = rec["payload_bytes"]
    assert s * WIRE <= rec["cross_node_bytes_per_call"] <= s * WIRE * 1.1 + 16384, rec
    assert rec["emulate_job_bytes"] > rec["cross_node_bytes_per_call"]
    assert isinstance(rec["emulate_retransmitted_segments"], int)
    assert rec["emulate_retransmitted_segments"] >= 0
    assert list(run_dir.parent.rglob("result.json")) == [run_dir / "result.json"]
    assert not list(run_dir.parent.rglob(".result.*"))
    assert _our_netns() == []
    print(
        f"\nemulated job: {elapsed:.0f} s, {rec['cross_node_bytes_per_call'] / s:.3f} x S crossed"
    )


@pytest.mark.world
def test_shared_memory_strategies_cross_each_node_link_as_their_peers_do(two_node_job):
    """Across two emulated nodes (each a network namespace, its own address): shm sends the
    message once to the other node's first rank, which hands it to its node in shared
    memory (independent_fetch's store is fed the same way); vllm_shm_broadcast's readers on the
    other node subscribe to the writer's ZMQ socket on the node's address, and each gets its own
    copy of the pickle, as vLLM's remote readers do. All arrive bit for bit (the job's
    verification covers every strategy)."""
    _, rec, _ = two_node_job
    assert rec["correct"] is True and rec["emulate_ranks_per_node"] == 2
    s = rec["payload_bytes"]
    # A segment a shaped link dropped is counted again when TCP resends it (a busy host).
    slack = 16384 + 1514 * rec["emulate_retransmitted_segments"]
    shm = rec["references"]["shm"]["cross_node_bytes_per_call"]
    assert s * WIRE <= shm <= s * WIRE * 1.1 + slack, rec["references"]["shm"]
    # Two remote readers: two copies of a pickle at least as large as the tensors.
    vllm = rec["references"]["vllm_shm_broadcast"]["cross_node_bytes_per_call"]
    assert 2 * s * WIRE <= vllm <= 3 * s * WIRE + slack, rec["references"]["vllm_shm_broadcast"]
    # independent_fetch's store is per node: fed once across the link, as shm's segment is.
    fetch = rec["references"]["independent_fetch"]["cross_node_bytes_per_call"]
    assert s * WIRE <= fetch <= s * WIRE * 1.1 + slack, rec["references"]["independent_fetch"]
    assert _our_netns() == []


@pytest.mark.world
def test_emulated_crash_fails_fast_and_cleans_up(netns_ok, tmp_path):
    """A rank that dies fails the job (named node, non-zero exit) well before gloo's timeout,
    leaves no record and no namespace."""
    run_dir = tmp_path / "run"
    res, elapsed = _emulated_job(
        run_dir, "strategy=header", "emulate.bytes_calls=0", "fault.rank=3", "fault.kind=crash",
        "timeout_s=120",
    )  # fmt: skip
    assert res.returncode != 0
    assert "emulated node 1 failed" in res.stderr, res.stderr[-3000:]
    assert elapsed < 120, f"a crashed rank took {elapsed:.0f} s to fail the job"
    assert not (run_dir / "result.json").exists()
    assert _our_netns() == []
