"""Ray dispatch across emulated nodes: one Ray node per network namespace of
``harness.cluster.netns``, the driver inside node 0's namespace, cross-node bytes per call read
from the links' counters.

    bcastbench ray-emulated --nodes 2 --rate-mbit 1000 -- \
        --layout tp2pp2 --batch-size 48,704 --modes leader:header,leader:pickled,all_ranks

Everything after ``--`` goes to ``python -m harness.ray.dispatch`` (the driver). Node k runs
``ray start --block`` with ``--node-ip-address`` its namespace's address and the custom resource
``bcb_node<k>``, so rank r's bundle lands on node r // ranks_per_node as torchrun's node ranks
place it. Every Ray process lives in a namespace this run created; closing the emulation kills
them by pid (``ip netns pids``) and deletes the namespaces: nothing else on the machine is
touched.

``--links node`` gives each node one shaped link; ``--links gpu`` gives each rank its own
(rails): gloo binds to the rank's rail (``GLOO_SOCKET_IFNAME=eth<local rank>``), while Ray's
object manager talks over the node's one address, the first rail's. So with rails, Ray's object
transfers all cross on rail 0 of each node, as they would on a real node whose Ray address is
one NIC's; only the broadcasts spread over the rails.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import paths
from harness.cluster.launch import LINKS_ENV
from harness.errors import program
from harness.ray.world import NODE_RESOURCE, cluster_auth, private_cluster_dir
from harness.run.world import WorldError

RAY_PORT = 6379  # a fresh namespace has every port free
READY_LINE = "Ray runtime started"


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


def _world_size(dispatch_args: list[str]) -> int:
    from harness.ray.dispatch import _parser, load_layout

    names = _parser().parse_args(dispatch_args).layout.split(",")
    sizes = {load_layout(n).world_size for n in names}
    if len(sizes) != 1:
        raise ValueError(
            f"layouts {names} have world sizes {sorted(sizes)}; run one size at a time"
        )
    return sizes.pop()


def run_emulated(
    dispatch_args: list[str],
    nodes: int = 2,
    rate_mbit: int = 1000,
    cpus_per_node: int = 2,
    object_store_mb: int = 512,
    link_bytes_calls: int = 3,
    limit_s: float = 600.0,
    links: str = "node",
) -> list[dict]:
    """Run the dispatch driver with ``dispatch_args`` on a fresh emulated Ray cluster; return
    its records, each with the cluster's shape added."""
    from harness.cluster.netns import Emulation

    world_size = _world_size(dispatch_args)
    if world_size % nodes:
        raise ValueError(f"{nodes} nodes do not divide the world of {world_size}")
    per_node = world_size // nodes
    shape = {"nodes": nodes, "rate_mbit": rate_mbit, "links": links, "ranks_per_node": per_node}
    # Ray's unix sockets live under the head's temp dir, which must leave them room.
    scratch = private_cluster_dir()
    try:
        with Emulation(**shape) as emu:
            procs = start_ray_nodes(emu, scratch, cpus_per_node, object_store_mb, 120.0)
            try:
                records = _drive(emu, dispatch_args, scratch, per_node, link_bytes_calls, limit_s)
            finally:
                stop_ray_nodes(procs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for record in records:
        record.update(
            emulate_nodes=nodes,
            emulate_links=links,
            emulate_rate_mbit=rate_mbit,
            emulate_ranks_per_node=per_node,
            emulate_bytes_calls=link_bytes_calls,
        )
    return records


def _drive(emu, dispatch_args, scratch: Path, per_node: int, calls: int, limit_s: float):
    """The driver: ``python -m harness.ray.dispatch`` inside node 0's namespace, attached to
    the cluster, ranks pinned per node, gloo on each node's link."""
    out = scratch / "records.json"
    argv = [sys.executable, "-m", "harness.ray.dispatch", *dispatch_args]
    argv += ["--address", f"{emu.node_ip(0)}:{RAY_PORT}", "--placement", "PACK"]
    rails = emu.cfg.links == "gpu"
    ifname = "eth{local_rank}" if rails else emu.rank_ifname(0)
    argv += ["--ranks-per-node", str(per_node), "--socket-ifname", ifname]
    argv += ["--link-bytes-calls", str(calls), "--json", str(out)]
    devs = [f"eth{k}" for k in range(per_node)] if rails else ["eth0"]
    links = [[emu.netns(n), dev] for n in range(emu.cfg.nodes) for dev in devs]
    env = {**cluster_auth(scratch), LINKS_ENV: json.dumps(links), "OMP_NUM_THREADS": "1"}
    log = scratch / "driver.log"
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


def main(argv: list[str] | None = None) -> list[dict]:
    from harness.files import write_json
    from harness.ray.dispatch import format_table

    argv = sys.argv[1:] if argv is None else argv
    ours, dispatch_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(
        prog=program("harness.ray.emulated"), description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate-mbit", type=int, default=1000)
    p.add_argument("--link-bytes-calls", type=int, default=3)
    p.add_argument(
        "--links",
        default="node",
        choices=["node", "gpu"],
        help="one shaped link per node, or one per rank (rails; Ray uses rail 0)",
    )
    p.add_argument("--json", default=None, help="write the records to this file")
    args = p.parse_args(ours)
    records = run_emulated(
        dispatch_args,
        args.nodes,
        args.rate_mbit,
        link_bytes_calls=args.link_bytes_calls,
        links=args.links,
    )
    each = "node" if args.links == "node" else "rank (rails)"
    command = " ".join(["bcastbench ray-emulated", *map(shlex.quote, argv)])
    for record in records:
        record["command"] = command
        print(f"emulated: {args.nodes} nodes, one {args.rate_mbit} Mbit/s link per {each}")
        print(format_table(record) + "\n")
    if args.json:
        write_json(args.json, records)
    return records


if __name__ == "__main__":
    main()
