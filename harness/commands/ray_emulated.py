"""Ray dispatch across emulated nodes: one Ray node per network namespace of
``harness.worlds.emulated_network``, the driver inside node 0's namespace, cross-node bytes per call read
from the links' counters.

    bcastbench run target=dispatch-emulated emulate.nodes=2 emulate.rate_mbit=1000 layout=tp2pp2 \
        payload.batch_size=48 'modes=[leader:header,leader:pickled,all_ranks]'
    bcastbench run target=dispatch-emulated -m payload.batch_size=48,704 emulate.links=node,gpu

Configured through ``conf/commands/ray_emulated.yaml``: ``bcastbench run target=dispatch``'s config
(``harness.commands.ray_dispatch.RayDispatchConf``) plus ``emulate``
(``harness.worlds.emulated_network.EmulateConf``: nodes, rate_mbit, links, bytes_calls, limit_s);
``ray.num_cpus`` and ``ray.object_store_mb`` are each node's. Each job runs the driver, ``bcastbench
run target=dispatch`` with the job's values, inside node 0's namespace, attached to the cluster, and
writes its record (the cluster's shape added, ``record=``) as ``result.json`` in the job's
directory. The jobs of a sweep that share a cluster shape share one cluster, started by the first of
them and stopped at exit.

Node k runs ``ray start --block`` with ``--node-ip-address`` its namespace's address and the
custom resource ``bcb_node<k>``, so rank r's bundle lands on node r // ranks_per_node as
torchrun's node ranks place it. Every Ray process lives in a namespace this run created;
closing the emulation kills them by pid (``ip netns pids``) and deletes the namespaces: nothing
else on the machine is touched.

``emulate.links=node`` gives each node one shaped link; ``emulate.links=gpu`` gives each rank its
own (rails): gloo binds to the rank's rail (``GLOO_SOCKET_IFNAME=eth<local rank>``), while Ray's
object manager talks over the node's one address, the first rail's. So with rails, Ray's object
transfers all cross on rail 0 of each node, as they would on a real node whose Ray address is
one NIC's; only the broadcasts spread over the rails.
"""

from __future__ import annotations

import atexit
import json
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from harness import paths
from harness.commands import ray_dispatch as dispatch
from harness.commands.hydra_app import run_app
from harness.commands.ray_dispatch import RayDispatchConf, format_table
from harness.commands.tool import job_command, job_dir, override, write_out
from harness.errors import ConfigError
from harness.job.config import layout_of, validate_dispatch
from harness.job.execute import RESULT_FILE
from harness.worlds.emulated import LINKS_ENV
from harness.worlds.emulated_network import EmulateConf, Emulation, unavailable_reason
from harness.worlds.protocol import WorldError
from harness.worlds.ray_cluster import NODE_RESOURCE, cluster_auth, private_cluster_dir

MODULE = "harness.commands.ray_emulated"
"""Where ``bcastbench run target=dispatch-emulated`` lives (its printed name:
``harness.errors.program``)."""
RAY_PORT = 6379  # a fresh namespace has every port free
READY_LINE = "Ray runtime started"
SET_HERE = ("address", "placement", "ranks_per_node", "socket_ifname")
"""``ray.*`` fields this tool sets for the driver (the cluster's address, PACK, the per-node
pinning, each node's link), so a value given for them would be ignored: refused instead."""


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _wait_for(proc: subprocess.Popen, log: Path, what: str, limit_s: float) -> None:
    """Until ``log`` says the Ray node is up; fail naming the node if it exits or stalls."""
    deadline = time.monotonic() + limit_s
    while READY_LINE not in _tail(log, 100_000):
        if proc.poll() is not None:
            raise WorldError(
                f"{what} exited with code {proc.returncode}; its log ends:\n{_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise WorldError(f"{what} not up within {limit_s:.0f} s; its log ends:\n{_tail(log)}")
        time.sleep(0.2)


def start_ray_nodes(
    emu, log_dir: Path, cpus_per_node: int, object_store_mb: int, limit_s: float
) -> list[subprocess.Popen]:
    """``ray start --block`` in every node's namespace, head first; return the processes.

    The head's temp dir is under ``log_dir``: Ray writes the head's address to
    ``<temp dir>/ray_current_cluster``, and left in /tmp/ray a bare ``ray.init()`` elsewhere on
    the machine would try to join this cluster after it is gone."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    head = f"{emu.node_ip(0)}:{RAY_PORT}"
    procs = []
    for node in range(emu.cfg.nodes):
        argv = [ray_bin, "start", "--block", "--node-ip-address", emu.node_ip(node)]
        argv += ["--num-cpus", str(cpus_per_node), "--disable-usage-stats"]
        argv += ["--object-store-memory", str(object_store_mb * 2**20)]
        argv += ["--resources", json.dumps({f"{NODE_RESOURCE}{node}": 1})]
        if node == 0:
            argv += ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"]
            argv += ["--temp-dir", str(log_dir / "ray")]
        else:
            argv += ["--address", head]
        log = log_dir / f"ray-node{node}.log"
        with open(log, "wb") as f:
            proc = emu.popen(
                node, argv, env=cluster_auth(log_dir), stdout=f, stderr=subprocess.STDOUT
            )
        procs.append(proc)
        _wait_for(proc, log, f"Ray node {node} ({emu.netns(node)})", limit_s)
    return procs


def stop_ray_nodes(procs: list[subprocess.Popen], grace_s: float = 15.0) -> None:
    """SIGTERM each ``ray start --block`` we started (workers first), so Ray stops its own
    processes; the emulation's close kills whatever is still inside the namespaces."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


# -- the config ------------------------------------------------------------------------------
@dataclass
class RayEmulatedConf(RayDispatchConf):
    """Root config of ``conf/commands/ray_emulated.yaml``: a ``target=dispatch`` job on an
    emulated Ray cluster. ``ray.num_cpus`` and ``ray.object_store_mb`` size each node's Ray;
    the address, placement, pinning and link of the ranks (``SET_HERE``) are this tool's."""

    emulate: EmulateConf = field(default_factory=EmulateConf)
    """The emulated cluster (nodes, rate_mbit, links; ``bytes_calls``: untimed calls per mode
    whose link bytes are counted; ``limit_s``: the most one job's driver may take).
    ``emulate.enabled`` is ``bcastbench run``'s switch and is not read here."""


def register() -> None:
    """The schema in Hydra's ConfigStore (``conf/commands/ray_emulated.yaml`` names it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="ray_emulated_schema", node=RayEmulatedConf)


def emulate_conf(cfg, world_size: int) -> EmulateConf:
    """The runtime ``EmulateConf`` of ``cfg.emulate`` for a world of ``world_size``."""
    from omegaconf import OmegaConf

    emulate = EmulateConf(**OmegaConf.to_container(cfg.emulate, resolve=True))
    if emulate.ranks_per_node is None:
        emulate = emulate.for_world(world_size)
    elif emulate.ranks_per_node * emulate.nodes != world_size:
        raise ValueError(
            f"emulate.nodes ({emulate.nodes}) × emulate.ranks_per_node "
            f"({emulate.ranks_per_node}) != the layout's world of {world_size}"
        )
    emulate.check()
    return emulate


@cache
def _namespaces_unavailable() -> str | None:

    return unavailable_reason()


def check(cfg) -> None:
    """``run target=dispatch``'s checks, the cluster's shape, and that namespaces can be made
    here."""
    validate_dispatch(cfg)
    given = [f"ray.{k}" for k in SET_HERE if cfg.ray[k] != getattr(RayEmulatedConf().ray, k)]
    if given:
        raise ConfigError(f"{', '.join(given)}: set by target=dispatch-emulated for its cluster; "
                          "leave unset")  # fmt: skip
    if cfg.link_bytes_calls:
        raise ConfigError("link_bytes_calls: on the emulated cluster it is emulate.bytes_calls")
    try:
        emulate_conf(cfg, layout_of(cfg).world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not cfg.emulate.limit_s or cfg.emulate.limit_s <= 0:
        raise ConfigError(f"emulate.limit_s must be > 0 s, got {cfg.emulate.limit_s}")
    reason = _namespaces_unavailable()
    if reason is not None:
        raise ConfigError(f"the emulated cluster cannot be built here: {reason}")


# -- one cluster per shape, kept across a sweep's jobs ------------------------------------------
_CLUSTER: dict = {}
"""This process's emulated Ray cluster: ``key`` (its shape), ``emu``, ``scratch``, ``stack``
(what closes it). A job of another shape closes it and starts its own; exit closes it."""


def cluster(emulate: EmulateConf, cpus_per_node: int, object_store_mb: int):
    """(Emulation, scratch dir) of a running cluster of this shape, started if need be."""
    key = (tuple(sorted(asdict(emulate).items())), cpus_per_node, object_store_mb)
    if _CLUSTER.get("key") == key:
        return _CLUSTER["emu"], _CLUSTER["scratch"]
    close_cluster()
    with ExitStack() as stack:
        # Ray's unix sockets live under the head's temp dir, which must leave them room.
        scratch = private_cluster_dir()
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        emu = stack.enter_context(Emulation(emulate))
        procs = start_ray_nodes(emu, scratch, cpus_per_node, object_store_mb, 120.0)
        stack.callback(stop_ray_nodes, procs)
        _CLUSTER.update(key=key, emu=emu, scratch=scratch, stack=stack.pop_all())
    atexit.register(close_cluster)
    return emu, scratch


def close_cluster() -> None:
    """Stop this process's emulated cluster, if any: Ray nodes, namespaces, scratch."""
    stack = _CLUSTER.pop("stack", None)
    _CLUSTER.clear()
    if stack is not None:
        stack.close()


# -- the driver --------------------------------------------------------------------------------
def driver_overrides(cfg) -> list[str]:
    """The job's ``run target=dispatch`` values as overrides for the driver (not the cluster's)."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True)
    out = [override(f"{node}.{k}", v) for node in ("layout", "payload") for k, v in c[node].items()]
    out += [override(k, c[k]) for k in ("modes", "iters", "warmup")]
    # ++: the driver's options start empty, and struct mode takes a new key only so.
    out += [override(f"++options.{k}", v) for k, v in c["options"].items()]
    return out + [override(f"ray.{k}", c["ray"][k]) for k in ("actor_cpus", "timeout_s",
                                                              "start_timeout_s")]  # fmt: skip


def _drive(emu, overrides: list[str], scratch: Path, job: Path, calls: int, limit_s: float):
    """The driver: ``bcastbench run target=dispatch`` inside node 0's namespace, attached to the
    cluster, ranks pinned per node, gloo on each node's link, writing its record (with the
    cluster's fields in ``overrides``) as this job's ``result.json``; that record."""
    out = job / RESULT_FILE
    out.unlink(missing_ok=True)
    per_node = emu.cfg.ranks_per_node
    rails = emu.cfg.links == "gpu"
    argv = [sys.executable, "-m", "harness", "run", "target=dispatch", *overrides]
    argv += [override("ray.address", f"{emu.node_ip(0)}:{RAY_PORT}"), "ray.placement=PACK"]
    argv += [f"ray.ranks_per_node={per_node}"]
    argv += [override("ray.socket_ifname", "eth{local_rank}" if rails else emu.rank_ifname(0))]
    argv += [f"link_bytes_calls={calls}"]
    # The driver's Hydra files apart, its record in this job's directory.
    argv += [override("hydra.run.dir", str(job)), override("hydra.output_subdir", "driver")]
    devs = [f"eth{k}" for k in range(per_node)] if rails else ["eth0"]
    links = [[emu.netns(n), dev] for n in range(emu.cfg.nodes) for dev in devs]
    env = {**cluster_auth(scratch), LINKS_ENV: json.dumps(links), "OMP_NUM_THREADS": "1"}
    log = job / "driver.log"
    with open(log, "wb") as f:
        proc = emu.popen(0, argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(paths.REPO))
    try:
        code = proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        raise WorldError(
            f"the dispatch driver ran past {limit_s:.0f} s; its log ends:\n{_tail(log)}"
        ) from None
    if code != 0 or not out.is_file():
        raise WorldError(f"the dispatch driver failed (exit {code}); its log ends:\n{_tail(log)}")
    return json.loads(out.read_text())


_DONE: list[dict] = []
"""Every record this process's jobs made, for ``out``."""


def task(cfg) -> dict:
    """One Hydra job: the cluster of its shape (reused across a sweep), the driver, the record."""
    emulate = emulate_conf(cfg, layout_of(cfg).world_size)
    emu, scratch = cluster(emulate, int(cfg.ray.num_cpus), int(cfg.ray.object_store_mb))
    job = job_dir()
    job.mkdir(parents=True, exist_ok=True)
    shape = {
        "emulate_nodes": emulate.nodes,
        "emulate_links": emulate.links,
        "emulate_rate_mbit": emulate.rate_mbit,
        "emulate_ranks_per_node": emulate.ranks_per_node,
        "emulate_bytes_calls": emulate.bytes_calls,
        "command": job_command(MODULE),
    }
    overrides = [*driver_overrides(cfg), *(override(f"++record.{k}", v) for k, v in shape.items())]
    record = _drive(emu, overrides, scratch, job, emulate.bytes_calls, emulate.limit_s)
    each = "node" if emulate.links == "node" else "rank (rails)"
    print(f"emulated: {emulate.nodes} nodes, one {emulate.rate_mbit} Mbit/s link per {each}")
    print(format_table(record) + "\n", flush=True)
    _DONE.append(record)
    write_out(_DONE, cfg.out)
    return record


def main(argv: list[str] | None = None) -> int:
    """``bcastbench run target=dispatch-emulated [overrides]``; a bad value exits 2 with one
    line."""
    dispatch.register()
    register()
    return run_app(MODULE, "ray_emulated", task, check, argv)


if __name__ == "__main__":
    raise SystemExit(main())
