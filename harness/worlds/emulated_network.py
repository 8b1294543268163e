"""An emulated multi-node cluster on one machine: each node is a network namespace, joined through
a bridge by veth links shaped with tc tbf, so "crossing nodes" costs what a real NIC would.

Needs root, ``ip`` and ``tc`` (iproute2) and a kernel with netns, veth, bridge and the tbf qdisc.
Everything lives in namespaces named ``bcb-<pid>-<seq>-*`` and is removed on exit, on exception,
on SIGINT/SIGTERM, and (for runs that were killed outright) by the next run that starts.

Topology: one "hub" namespace holds a bridge; node ``n`` is namespace ``...-n<n>``. With
``links="node"`` each node has one veth (``eth0`` inside the node, ``n<n>`` on the hub) and all
its ranks share it; with ``links="gpu"`` ("rails") each rank has its own veth (``eth<local>``
inside its node, ``n<n>g<local>`` on the hub) and its own address, and source-based policy
routing sends each rank's traffic out of its own link. tbf shapes egress only, so both ends of
every link carry a qdisc: node→hub (upload) and hub→node (download) are each ``rate_mbit``.
Ranks in the same namespace talk over loopback, i.e. intra-node traffic is not shaped.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

PREFIX = "bcb-"
_SEQ = itertools.count()


class EmulationUnavailable(RuntimeError):
    """Network namespaces cannot be used here (not root, no iproute2, kernel lacks a feature)."""


@dataclass
class EmulateConf:
    """An emulated cluster: how many nodes, how they are linked, how fast the links are, and
    how the harness runs a job on it. The job config's ``emulate:`` key (schema registered by
    ``harness.job.config``) and the argument of ``Emulation`` are this one type."""

    enabled: bool = False
    """Run the job on the emulated cluster (``harness.worlds.emulated``). Needs root and
    iproute2; gloo on CPU."""
    nodes: int = 2
    """Emulated nodes (one network namespace each); the world (dp·pp·tp·cp) is split into
    equal blocks of consecutive ranks, rank r on node r // ranks_per_node (the layout's order
    puts TP, then CP, innermost)."""
    rate_mbit: int = 1000
    """tbf rate of each link, per direction, in Mbit/s (the payload gets ≈ (MTU − 52)/(MTU + 14)
    of it over TCP)."""
    links: str = "node"
    """``node``: one link per node shared by its ranks; ``gpu``: one link per rank (rails)."""
    ranks_per_node: int | None = None
    """Ranks placed on each node, in blocks; null: world size / nodes for a harness job
    (``for_world``), 2 for a bare ``Emulation``."""
    bytes_calls: int = 2
    """Untimed calls per strategy in the link-counting phase that gives
    cross_node_bytes_per_call (0: skip the phase)."""
    limit_s: float | None = None
    """Wall-clock limit of the whole emulated launch; null: 2·timeout_s + 60 s."""
    burst_kb: int = 32
    """tbf bucket of each link's sending end (node → hub), in KiB. A large bucket lets the
    first bytes pass at line speed (a negative fitted α); a small one keeps α fittable."""
    hub_burst_kb: int = 256
    """tbf bucket of each link's receiving end (hub → node), in KiB. Two equal small buckets
    in series lose part of the rate, so the receiving end, which only matters for incast, gets
    a larger bucket."""
    subnet: str = "10.231.0.0/16"
    """Private IPv4 subnet used only inside the namespaces (must hold 256·(nodes+1) addresses)."""
    latency_ms: int = 50
    """tbf queueing limit, expressed as the longest a packet may wait in the bucket."""
    mtu: int = 1500
    """MTU of every veth."""

    def for_world(self, world_size: int) -> EmulateConf:
        """This cluster with ``ranks_per_node`` filled in for a world of ``world_size``."""
        if self.nodes < 1 or world_size % self.nodes:
            raise ValueError(
                f"emulate.nodes={self.nodes} does not divide the world of {world_size}"
            )
        return replace(self, ranks_per_node=world_size // self.nodes)

    def check(self) -> None:
        """The values ``Emulation`` needs; a ValueError naming the field."""
        if self.nodes < 1 or not self.ranks_per_node or self.ranks_per_node < 1:
            raise ValueError(
                f"emulate.nodes and emulate.ranks_per_node must be >= 1, got {self.nodes} and "
                f"{self.ranks_per_node} (use for_world(world_size) to fill ranks_per_node)"
            )
        if self.links not in ("node", "gpu"):
            raise ValueError(f"emulate.links must be node or gpu, got {self.links!r}")
        for name in ("rate_mbit", "burst_kb", "hub_burst_kb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"emulate.{name} must be positive, got {getattr(self, name)}")
        if self.ranks_per_node > 250:
            raise ValueError(f"emulate.ranks_per_node: at most 250, got {self.ranks_per_node}")
        net = ipaddress.ip_network(self.subnet)
        if net.version != 4 or net.num_addresses < 256 * (self.nodes + 1):
            raise ValueError(f"emulate.subnet {self.subnet} is too small for {self.nodes} nodes")

    @property
    def world_size(self) -> int:
        return self.nodes * (self.ranks_per_node or 0)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _snmp_field(text: str, proto: str, field: str) -> int:
    """One counter of /proc/net/snmp, whose rows come in pairs: ``Proto: names...`` then
    ``Proto: values...``."""
    rows = [line.split()[1:] for line in text.splitlines() if line.startswith(f"{proto}:")]
    if len(rows) < 2 or field not in rows[0]:
        raise RuntimeError(f"/proc/net/snmp has no {proto} {field} counter: {text[:200]!r}")
    return int(rows[1][rows[0].index(field)])


def _netns_list() -> list[str]:
    res = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None if they can (cheap; for pytest skips)."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "no Linux network namespaces on this platform"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    res = _run(["ip", "netns", "add", probe], check=False)
    if res.returncode != 0:
        return f"`ip netns add` failed: {res.stderr.strip()}"
    try:
        for argv in (
            ["ip", "-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"],
            ["tc", "-n", probe, "qdisc", "add", "dev", "a", "root", "tbf", "rate", "1gbit"]
            + ["burst", "32kb", "latency", "50ms"],
            ["ip", "-n", probe, "link", "add", "name", "br", "type", "bridge"],
        ):
            res = _run(argv, check=False)
            if res.returncode != 0:
                return f"`{' '.join(argv)}` failed: {res.stderr.strip()}"
    finally:
        _run(["ip", "netns", "delete", probe], check=False)
    return None


def cleanup_leftovers() -> list[str]:
    """Delete ``bcb-<pid>-*`` namespaces whose creating process is gone; return their names.

    Namespaces of live processes are left alone, so concurrent runs do not break each other.
    """
    removed = []
    for name in _netns_list():
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and _pid_alive(int(pid)):
            continue
        _kill_netns_pids(name)
        if _run(["ip", "netns", "delete", name], check=False).returncode == 0:
            removed.append(name)
    return removed


def _kill_netns_pids(name: str) -> None:
    # A namespace outlives its name while a process still runs inside it, so stop those first.
    res = _run(["ip", "netns", "pids", name], check=False)
    for tok in res.stdout.split():
        if tok.isdigit():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except ProcessLookupError:
                pass


class Emulation:
    """Context manager that builds an :class:`EmulateConf` cluster and tears it down again."""

    def __init__(self, cfg: EmulateConf | None = None, **overrides: object) -> None:
        if cfg is None:
            cfg = EmulateConf(**overrides)  # type: ignore[arg-type]
        elif overrides:
            raise TypeError("pass either an EmulateConf or keyword overrides, not both")
        if cfg.ranks_per_node is None:
            cfg = replace(cfg, ranks_per_node=2)
        cfg.check()
        self.cfg = cfg
        self.uid = f"{os.getpid()}-{next(_SEQ)}"
        self.hub = f"{PREFIX}{self.uid}-hub"
        self.node_ns = [f"{PREFIX}{self.uid}-n{n}" for n in range(cfg.nodes)]
        self._net = ipaddress.ip_network(cfg.subnet)
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}
        self._closed = True
        self._lock = threading.RLock()  # a signal may arrive while close() holds it

    # -- addressing ----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.cfg.world_size

    def node_of_rank(self, rank: int) -> int:
        if not 0 <= rank < self.cfg.world_size:
            raise ValueError(f"rank {rank} outside world of {self.cfg.world_size}")
        return rank // self.cfg.ranks_per_node

    def _links(self) -> list[tuple[int, int | None]]:
        """(node, local rank or None) for every link."""
        if self.cfg.links == "node":
            return [(n, None) for n in range(self.cfg.nodes)]
        return [(n, k) for n in range(self.cfg.nodes) for k in range(self.cfg.ranks_per_node)]

    def _ip(self, node: int, local: int | None) -> str:
        # 10.231.<node+1>.<local+1>: readable, and never the network or broadcast address.
        return str(self._net.network_address + 256 * (node + 1) + (local or 0) + 1)

    @staticmethod
    def _ifname(local: int | None) -> str:
        return "eth0" if local is None else f"eth{local}"

    @staticmethod
    def _hub_ifname(node: int, local: int | None) -> str:
        return f"n{node}" if local is None else f"n{node}g{local}"

    def _local(self, rank: int) -> int | None:
        return None if self.cfg.links == "node" else rank % self.cfg.ranks_per_node

    def node_ip(self, node: int) -> str:
        """The node's first address (its only one with ``links="node"``): use for rendezvous."""
        return self._ip(node, None if self.cfg.links == "node" else 0)

    def rank_ip(self, rank: int) -> str:
        """The address ``rank`` should bind to: its node's, or its own rail's."""
        return self._ip(self.node_of_rank(rank), self._local(rank))

    def rank_ifname(self, rank: int) -> str:
        """The interface ``rank`` should use (``GLOO_SOCKET_IFNAME``) inside its namespace."""
        self.node_of_rank(rank)
        return self._ifname(self._local(rank))

    def netns(self, node: int) -> str:
        return self.node_ns[node]

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> Emulation:
        reason = unavailable_reason()
        if reason is not None:
            raise EmulationUnavailable(reason)
        cleanup_leftovers()
        self._closed = False
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, name: str, *argv: str) -> None:
        _run(["ip", "-n", name, *argv])

    def _tbf(self, ns: str, dev: str, burst_kb: int) -> None:
        c = self.cfg
        _run(
            ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate"]
            + [f"{c.rate_mbit}mbit", "burst", f"{burst_kb}kb", "latency", f"{c.latency_ms}ms"]
        )

    def _build(self) -> None:
        c = self.cfg
        for ns in (self.hub, *self.node_ns):
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
            self._ns(ns, "link", "set", "lo", "up")
        self._ns(self.hub, "link", "add", "name", "br0", "type", "bridge")
        self._ns(self.hub, "link", "set", "br0", "up")
        prefix_len = self._net.prefixlen
        for node, local in self._links():
            ns, dev, hub_dev = (
                self.node_ns[node],
                self._ifname(local),
                self._hub_ifname(node, local),
            )
            # Create the pair directly inside the namespaces: no name ever appears in the root
            # namespace, so concurrent emulations cannot collide.
            _run(
                ["ip", "-n", ns, "link", "add", "name", dev, "mtu", str(c.mtu), "type", "veth"]
                + ["peer", "name", hub_dev, "mtu", str(c.mtu), "netns", self.hub]
            )
            self._ns(self.hub, "link", "set", hub_dev, "master", "br0")
            self._ns(self.hub, "link", "set", hub_dev, "up")
            self._ns(ns, "addr", "add", f"{self._ip(node, local)}/{prefix_len}", "dev", dev)
            self._ns(ns, "link", "set", dev, "up")
            self._tbf(ns, dev, c.burst_kb)
            self._tbf(self.hub, hub_dev, c.hub_burst_kb)
        if c.links == "gpu":
            self._policy_routing()

    def _policy_routing(self) -> None:
        c = self.cfg
        for node in range(c.nodes):
            ns = self.node_ns[node]
            # Several interfaces on one subnet: answer ARP only on the interface that owns the
            # address, and don't drop replies that arrive on "the other" interface.
            sysctls = {
                "net.ipv4.conf.all.arp_ignore": 1,
                "net.ipv4.conf.all.arp_announce": 2,
                "net.ipv4.conf.all.rp_filter": 0,
                "net.ipv4.conf.default.rp_filter": 0,
            }
            for local in range(c.ranks_per_node):
                sysctls[f"net.ipv4.conf.eth{local}.rp_filter"] = 0
            for key, value in sysctls.items():
                _run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"])
            for local in range(c.ranks_per_node):
                table = str(100 + local)
                ip, dev = self._ip(node, local), self._ifname(local)
                # Traffic from a rank's address leaves over that rank's own link.
                self._ns(ns, "route", "add", str(self._net), "dev", dev, "src", ip, "table", table)
                self._ns(ns, "rule", "add", "from", ip, "table", table, "priority", table)
                # A socket that connects without binding (gloo's connecting side) has no source
                # yet, so the rules above miss it and the main table would give it eth0's
                # address: the peer's replies, i.e. the payload, would then all come in over
                # rail 0. Rail-aligned host routes pick rail k (and its address) for peers on
                # rail k of every other node, as on a rail-optimized fabric.
                for other in range(c.nodes):
                    if other != node:
                        peer = f"{self._ip(other, local)}/32"
                        self._ns(ns, "route", "add", peer, "dev", dev, "src", ip)

    def close(self) -> None:
        """Stop processes started by :meth:`popen` and delete every namespace. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._created):
            _kill_netns_pids(ns)
            _run(["ip", "netns", "delete", ns], check=False)
        self._created.clear()
        self._restore_signal_handlers()
        atexit.unregister(self.close)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit still runs

        def handler(signum: int, frame: object) -> None:
            self.close()
            previous = self._old_handlers.get(signum)
            if callable(previous):
                previous(signum, frame)
            elif signum == signal.SIGINT:
                raise KeyboardInterrupt
            else:
                raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old_handlers.clear()

    # -- running things ------------------------------------------------------------------
    def popen(
        self,
        node: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **kw: object,
    ) -> subprocess.Popen:
        """Run ``argv`` inside ``node``'s namespace. ``env`` is added to this process's
        environment. The process gets its own session and is killed on exit if still running."""
        if self._closed:
            raise RuntimeError("emulation is not running")
        full_env = {**os.environ, **(env or {})}
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.node_ns[node], *argv], env=full_env, **kw
        )
        self._procs.append(proc)
        return proc

    def run(self, node: int, argv: Sequence[str], **kw: object) -> subprocess.CompletedProcess:
        """Like :func:`subprocess.run` inside ``node``'s namespace."""
        return subprocess.run(["ip", "netns", "exec", self.node_ns[node], *argv], **kw)

    # -- counters ------------------------------------------------------------------------
    def link_bytes(self) -> dict[str, int]:
        """Bytes each inter-node link has carried out of its node so far (veth tx counters,
        Ethernet headers included), keyed ``n<node>`` or ``n<node>g<local>`` (rails).

        Every byte that crosses between nodes leaves exactly one node link, so the sum over
        the dict is the traffic that crossed node boundaries (plus rendezvous chatter/ARP).
        """
        out: dict[str, int] = {}
        by_node: dict[int, dict[str, int]] = {}
        for node in range(self.cfg.nodes):
            res = _run(["ip", "-n", self.node_ns[node], "-j", "-s", "link", "show"])
            by_node[node] = {
                link["ifname"]: int(link["stats64"]["tx"]["bytes"])
                for link in json.loads(res.stdout)
            }
        for node, local in self._links():
            out[self._hub_ifname(node, local)] = by_node[node][self._ifname(local)]
        return out

    def retransmitted_segments(self) -> dict[str, int]:
        """TCP segments each node has sent again so far (``Tcp: RetransSegs`` of its network
        namespace), keyed ``n<node>``. A shaped link drops what overflows its queue, and TCP
        resends it: those bytes are in :meth:`link_bytes` too, so a busy host's link carries more
        than one copy of the payload without any strategy sending twice."""
        out: dict[str, int] = {}
        for node in range(self.cfg.nodes):
            res = _run(["ip", "netns", "exec", self.node_ns[node], "cat", "/proc/net/snmp"])
            out[f"n{node}"] = _snmp_field(res.stdout, "Tcp", "RetransSegs")
        return out

    def crossed_bytes(self) -> int:
        """Total of :meth:`link_bytes`: bytes that left any node over its links."""
        return sum(self.link_bytes().values())
