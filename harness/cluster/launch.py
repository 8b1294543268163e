"""Run one job on an emulated multi-node cluster (``emulate.enabled=true``; see
harness.cluster.netns).

    python -m harness strategy=pp_first layout=tp2pp2 emulate.enabled=true \
        emulate.nodes=2 emulate.rate_mbit=1000 emulate.links=node   # or links=gpu ("rails")

The driver (this module, called by ``harness.run.app.run`` when not under a launcher) builds the
namespaces, then starts one torchrun agent per node inside that node's namespace
(``torchrun --nnodes N --node-rank k --master-addr <node 0's address>``, static rendezvous, so
node k holds global ranks k·R … k·R+R−1 exactly as the layout's order places them: rank r on node
r // R, TP then CP innermost). Each agent runs ``python -m harness`` with this job's own overrides,
so the workers are ordinary torchrun ranks; global rank 0 writes its record into a scratch
directory, and the driver adds the cluster's shape and writes the job's ``result.json``.

Cross-node bytes per call. The job's calls (warm-up, timed, counting, verification) and its
references all cross the links, so totals around the whole job cannot be split per strategy.
Instead the runner has a dedicated, untimed phase (``runner._link_bytes_phase``): for each
strategy in turn, global rank 0 reads every node link's tx counter, the ranks make
``emulate.bytes_calls`` back-to-back calls, and rank 0 reads the counters again; barriers fence
the window. ``cross_node_bytes_per_call`` is that difference / calls: wire bytes (Ethernet, IP
and TCP headers included, ≈ 1514/1448 of the payload at MTU 1500), plus one barrier's few
hundred bytes. Each reference gets the same figure in ``references``. ``emulate_job_bytes`` is
the driver's own before/after total of the whole launch (rendezvous and everything else), and
``emulate_link_bytes`` the same per link (``n<node>``, or ``n<node>g<local>`` for rails).

A rank that crashes or hangs fails the job: its agent exits non-zero (or gloo's timeout makes
the others fail), the driver sees it, kills every agent and removes the namespaces; the driver's
own wall-clock limit (``emulate.limit_s``) is the backstop. Ctrl-C and SIGTERM clean up too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harness import paths  # noqa: I001
from harness.run.world import WorldError

LINKS_ENV = "BCB_LINK_COUNTERS"
"""JSON ``[[netns, ifname], …]``: the node end of every inter-node link (set by the driver)."""
IFNAME_PATTERN_ENV = "BCB_IFNAME_PATTERN"
"""``eth{local_rank}``: rails give each rank its own interface, but torchrun gives all local
workers one environment, so each worker sets GLOO_SOCKET_IFNAME from this itself."""
NODE_ENV = "BCB_NODE"
"""The emulated node an agent was started on; workers check their rank landed there."""
MASTER_PORT = 29500  # a fresh namespace has every port free


def link_counter() -> Callable[[], int] | None:
    """A function that returns the bytes all node links have sent so far, or None when this
    process is not a worker of an emulated job. Works from inside a node's namespace too:
    ``ip -n`` opens the other namespaces by name."""
    spec = os.environ.get(LINKS_ENV)
    if not spec:
        return None
    by_ns: dict[str, list[str]] = {}
    for ns, dev in json.loads(spec):
        by_ns.setdefault(ns, []).append(dev)

    def read() -> int:
        total = 0
        for ns, devs in by_ns.items():
            res = subprocess.run(
                ["ip", "-n", ns, "-j", "-s", "link", "show"],
                capture_output=True,
                text=True,
                check=True,
            )
            tx = {ln["ifname"]: int(ln["stats64"]["tx"]["bytes"]) for ln in json.loads(res.stdout)}
            total += sum(tx[d] for d in devs)
        return total

    return read


def adopt_worker_env() -> None:
    """In a worker: pick this rank's interface (rails) and check its node placement."""
    pattern = os.environ.get(IFNAME_PATTERN_ENV)
    if pattern:
        local = int(os.environ.get("LOCAL_RANK", 0))
        os.environ["GLOO_SOCKET_IFNAME"] = pattern.format(local_rank=local)
    node = os.environ.get(NODE_ENV)
    if node is not None and "RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        rank, per_node = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        if rank // per_node != int(node):
            raise WorldError(
                f"rank {rank} started on emulated node {node}, expected node {rank // per_node}"
            )


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_emulated(cfg, layout, overrides: list[str], out_dir: Path) -> dict:
    """Run the job ``overrides`` describe on an emulated cluster; return its record (not yet
    written). Agents' output goes to ``out_dir/emulate-node<k>.log``."""
    from omegaconf import OmegaConf

    from harness.cluster.netns import EmulateConf, Emulation, EmulationUnavailable

    e = cfg.emulate
    conf = OmegaConf.to_object(e) if OmegaConf.is_config(e) else e
    if not isinstance(conf, EmulateConf):  # a job config composed without the schema
        conf = EmulateConf(**conf)
    cluster = conf.for_world(layout.world_size)
    limit_s = float(e.limit_s) if e.limit_s is not None else 2 * float(cfg.timeout_s) + 60
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bcastbench-emulated-"))
    try:
        try:
            emu_cm = Emulation(cluster)
            emu = emu_cm.__enter__()
        except EmulationUnavailable as exc:
            raise WorldError(
                f"emulate.enabled=true but namespaces are unavailable: {exc}"
            ) from None
        try:
            record = _launch(emu, cfg, overrides, scratch, out_dir, limit_s)
        finally:
            emu_cm.__exit__(None, None, None)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return record


def _start_agents(emu, overrides, scratch: Path, out_dir: Path) -> tuple[list, list[Path]]:
    """One torchrun agent per node, inside its namespace; their processes and log files."""
    c = emu.cfg
    links = [
        [emu.netns(node), dev]
        for node in range(c.nodes)
        for dev in sorted(
            {
                emu.rank_ifname(r)
                for r in range(node * c.ranks_per_node, (node + 1) * c.ranks_per_node)
            }
        )
    ]
    procs, logs = [], []
    for node in range(c.nodes):
        env = {"OMP_NUM_THREADS": "1", NODE_ENV: str(node), LINKS_ENV: json.dumps(links)}
        if c.links == "gpu":
            env[IFNAME_PATTERN_ENV] = "eth{local_rank}"
        else:
            env["GLOO_SOCKET_IFNAME"] = emu.rank_ifname(node * c.ranks_per_node)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(c.nodes)]
        argv += ["--nproc-per-node", str(c.ranks_per_node), "--node-rank", str(node)]
        argv += ["--master-addr", emu.node_ip(0), "--master-port", str(MASTER_PORT)]
        argv += ["--max-restarts", "0", "-m", "harness", *overrides]
        argv += [f"hydra.run.dir={scratch}", "hydra.output_subdir=null", "hydra/job_logging=none"]
        log = out_dir / f"emulate-node{node}.log"
        logs.append(log)
        with open(log, "wb") as f:
            procs.append(
                emu.popen(node, argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=_repo())
            )
    return procs, logs


def _wait(procs: list, logs: list[Path], deadline: float, limit_s: float) -> None:
    """Until every agent exits 0; a failed agent or the deadline raises ``WorldError``."""
    while True:
        codes = [p.poll() for p in procs]
        if all(code == 0 for code in codes):
            return
        bad = [(k, code) for k, code in enumerate(codes) if code not in (None, 0)]
        if bad:
            k, code = bad[0]
            # The other nodes' ranks would wait out gloo's timeout; the context kills them now.
            raise WorldError(
                f"emulated node {k} failed (torchrun exit {code}); its log {logs[k]} ends:\n"
                + _tail(logs[k])
            )
        if time.monotonic() > deadline:
            raise WorldError(
                f"emulated job did not finish within {limit_s:.0f} s (emulate.limit_s); "
                f"node 0's log {logs[0]} ends:\n" + _tail(logs[0])
            )
        time.sleep(0.2)


def _launch(emu, cfg, overrides, scratch: Path, out_dir: Path, limit_s: float) -> dict:
    c = emu.cfg
    before = emu.link_bytes()
    t0 = time.monotonic()
    procs, logs = _start_agents(emu, overrides, scratch, out_dir)
    _wait(procs, logs, t0 + limit_s, limit_s)
    after = emu.link_bytes()
    per_link = {name: after[name] - before[name] for name in after}
    path = scratch / "result.json"
    if not path.is_file():
        raise WorldError(f"emulated job ended without a record; node 0's log:\n{_tail(logs[0])}")
    record = json.loads(path.read_text())
    record.update(
        emulate_nodes=c.nodes,
        emulate_links=c.links,
        emulate_rate_mbit=c.rate_mbit,
        emulate_ranks_per_node=c.ranks_per_node,
        emulate_bytes_calls=int(cfg.emulate.bytes_calls),
        emulate_job_bytes=sum(per_link.values()),
        emulate_link_bytes=per_link,
        emulate_wall_s=time.monotonic() - t0,
    )
    record.setdefault("cross_node_bytes_per_call", None)
    return record


def _repo() -> str:
    return str(paths.REPO)
