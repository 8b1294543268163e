"""The emulated cluster (``EmulatedWorld``, a ``harness.worlds.protocol.World``): a joined world on
emulated nodes, driven from here (``emulate.enabled=true``; see harness.worlds.emulated_network).

    python -m harness strategy=pp_first layout=tp2pp2 emulate.enabled=true \
        emulate.nodes=2 emulate.rate_mbit=1000 emulate.links=node   # or links=gpu ("rails")

The driver (this module, chosen by ``harness.worlds.launcher.choose`` when not under a launcher)
builds the namespaces, then, for each task, starts one torchrun agent per node inside that
node's namespace (``torchrun --nnodes N --node-rank k --master-addr <node 0's address>``, static
rendezvous, so node k holds global ranks k·R … k·R+R−1 exactly as the layout's order places
them: rank r on node r // R, TP then CP innermost). Each agent runs ``harness.worlds.emulated_rank``,
whose ranks join that world (``harness.worlds.joined.JoinedWorld``) and run the task the driver
wrote into a scratch directory; global rank 0 writes every rank's result back there, and the
driver hands them on with the cluster's shape (``record_fields``).

Cross-node bytes per call. The job's calls (warm-up, timed, counting, verification) and its
references all cross the links, so totals around the whole job cannot be split per strategy.
Instead the runner has a dedicated, untimed phase (``harness.job.phases.LinkBytes``): for each
strategy in turn, global rank 0 reads every node link's tx counter, the ranks make
``emulate.bytes_calls`` back-to-back calls, and rank 0 reads the counters again; barriers fence
the window. ``cross_node_bytes_per_call`` is that difference / calls: wire bytes (Ethernet, IP
and TCP headers included, ≈ 1514/1448 of the payload at MTU 1500), plus one barrier's few
hundred bytes. Each reference gets the same figure in ``references``. ``emulate_job_bytes`` is
the driver's own before/after total of the whole launch (rendezvous and everything else), and
``emulate_link_bytes`` the same per link (``n<node>``, or ``n<node>g<local>`` for rails).
Both count what TCP resent after a shaped link dropped it (a busy host drops more);
``emulate_retransmitted_segments`` says how many segments that was.

A rank that crashes or hangs fails the job: its agent exits non-zero (a silent rank's watchdog
ends it, see ``harness.worlds.joined``; or gloo's timeout makes the others fail), the driver sees
it, kills every agent and removes the namespaces; the driver's own wall-clock limit
(``emulate.limit_s``) is the backstop. Ctrl-C and SIGTERM clean up too.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import paths  # noqa: I001
from harness.worlds.emulated_network import Emulation, EmulationUnavailable
from harness.worlds.protocol import RankFn, WorldError

LINKS_ENV = "BCB_LINK_COUNTERS"
"""JSON ``[[netns, ifname], …]``: the node end of every inter-node link (set by the driver)."""
IFNAME_PATTERN_ENV = "BCB_IFNAME_PATTERN"
"""``eth{local_rank}``: rails give each rank its own interface, but torchrun gives all local
workers one environment, so each worker sets GLOO_SOCKET_IFNAME from this itself."""
NODE_ENV = "BCB_NODE"
"""The emulated node an agent was started on; workers check their rank landed there."""
MASTER_PORT = 29500  # a fresh namespace has every port free
TASK_FILE, RESULTS_FILE = "task.pkl", "results.pkl"
"""In the emulated world's scratch directory: the driver's task, and rank 0's answer."""


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


def _start_agents(emu, task: Path, port: int, log_dir: Path) -> tuple[list, list[Path]]:
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
        argv += ["--master-addr", emu.node_ip(0), "--master-port", str(port)]
        argv += ["--max-restarts", "0", "-m", "harness.worlds.emulated_rank", str(task)]
        log = log_dir / f"emulate-node{node}.log"
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


def _repo() -> str:
    return str(paths.REPO)


class EmulatedWorld:
    """A world of ``world_size`` ranks on an emulated cluster of ``conf.nodes`` nodes; its
    agents' output goes to ``log_dir/emulate-node<k>.log``."""

    def __init__(
        self, conf, world_size: int, log_dir: Path, timeout_s: float = 120.0,
        backend: str = "gloo", device: str = "cpu",
    ) -> None:  # fmt: skip
        self.conf = conf.for_world(world_size)
        self.world_size, self.log_dir, self.timeout_s = world_size, Path(log_dir), timeout_s
        self.backend, self.device = backend, device
        self.limit_s = float(conf.limit_s) if conf.limit_s is not None else 2 * timeout_s + 60
        self.start_s = 0.0
        self._emu = None
        self._scratch: Path | None = None
        self._tasks = 0
        self._fields: dict[str, Any] = {}

    def start(self) -> EmulatedWorld:

        t0 = time.perf_counter()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            emu = Emulation(self.conf)
            emu.__enter__()
        except EmulationUnavailable as exc:
            raise WorldError(
                f"emulate.enabled=true but namespaces are unavailable: {exc}"
            ) from None
        self._emu = emu
        # Private to this driver (0700): the task pickled in it is ours, not a user's file.
        self._scratch = Path(tempfile.mkdtemp(prefix="bcastbench-emulated-"))
        self.start_s = time.perf_counter() - t0
        return self

    def run(self, fn: RankFn, *args: Any, what: str = "", timeout_s: float | None = None):
        """``fn(ctx, *args)`` on every rank of the cluster; the per-rank results in rank
        order. A failed agent, or the whole task past ``emulate.limit_s``, tears the cluster
        down and raises WorldError naming the node, with the end of its log."""
        if self._emu is None:
            raise WorldError("the emulated cluster is not running (it was closed or failed)")
        emu, scratch = self._emu, self._scratch
        what = what or getattr(fn, "__name__", "task")
        (scratch / RESULTS_FILE).unlink(missing_ok=True)
        task = scratch / TASK_FILE
        limit = timeout_s or self.timeout_s
        task.write_bytes(pickle.dumps((fn, args, what, limit, self.backend, self.device)))
        self._tasks += 1
        before, resent, t0 = emu.link_bytes(), emu.retransmitted_segments(), time.monotonic()
        try:
            procs, logs = _start_agents(emu, task, MASTER_PORT + self._tasks, self.log_dir)
            _wait(procs, logs, t0 + self.limit_s, self.limit_s)
            if not (scratch / RESULTS_FILE).is_file():
                raise WorldError(
                    f"emulated job ended without results; node 0's log:\n{_tail(logs[0])}"
                )
        except BaseException:
            self.close(kill=True)
            raise
        after = emu.link_bytes()
        resent = {k: n - resent[k] for k, n in emu.retransmitted_segments().items()}
        self._fields = self._shape(
            {name: after[name] - before[name] for name in after},
            sum(resent.values()),
            time.monotonic() - t0,
        )
        return pickle.loads((scratch / RESULTS_FILE).read_bytes())

    def _shape(self, per_link: dict[str, int], resent: int, wall_s: float) -> dict[str, Any]:
        c = self.conf
        return dict(
            emulate_nodes=c.nodes,
            emulate_links=c.links,
            emulate_rate_mbit=c.rate_mbit,
            emulate_ranks_per_node=c.ranks_per_node,
            emulate_bytes_calls=int(c.bytes_calls),
            emulate_job_bytes=sum(per_link.values()),
            emulate_link_bytes=per_link,
            emulate_retransmitted_segments=resent,
            emulate_wall_s=wall_s,
        )

    def record_fields(self) -> dict[str, Any]:
        """The cluster's shape and what its links carried during the last task."""
        return dict(self._fields)

    @property
    def alive(self) -> bool:
        return self._emu is not None

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        per = self.conf.ranks_per_node
        return tuple(tuple(range(k * per, (k + 1) * per)) for k in range(self.conf.nodes))

    def close(self, kill: bool = False) -> None:
        """Kill every agent still running and remove the namespaces and the scratch."""
        emu, self._emu = self._emu, None
        if emu is not None:
            emu.__exit__(None, None, None)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
