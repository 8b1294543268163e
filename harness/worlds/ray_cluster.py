"""Where a Ray world's ranks run: ``RayConf`` (which cluster, how the ranks are placed), Ray itself,
and the private cluster a world starts for itself (its directory, token, reaper and network)."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

from harness.worlds import ray_reaper
from harness.worlds.ray_network import PrivateNetwork

NODE_RESOURCE = "bcb_node"
"""Custom resource a multi-node cluster's node ``k`` advertises as ``bcb_node<k>``: bundles ask
for it so rank ``r`` lands on node ``r // ranks_per_node``, as torchrun's node ranks place it."""


DISPATCH_MODES = ("none", "leader", "all_ranks")
"""Values of ``RayConf.dispatch``."""

LOOPBACK = "127.0.0.2"
"""The address a private local Ray cluster advertises and connects on (see
``PrivateCluster.start``)."""


TOKEN_FILE = "auth_token"


def cluster_auth(cluster_dir: Path) -> dict[str, str]:
    """The environment every process of a cluster started by hand (``ray start``, the
    emulated cluster's nodes and driver) shares: token mode with a token of the cluster's
    own, in its directory. Left to itself Ray reads (or writes)
    ``~/.ray/auth_token``: a machine where Ray never ran has none (a head started in token mode
    exits with AuthenticationError), and a run would write into the user's home and tie its
    private cluster to the token the user keeps for their own."""
    token = Path(cluster_dir) / TOKEN_FILE
    if not token.exists():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}


_PROCESS_TOKEN = secrets.token_hex(32)


def _private_token_env() -> dict[str, str]:
    """The token a private cluster started in this process runs with, in the environment its
    processes inherit: one token per driver process (Ray's driver loads its token once and
    keeps it), never written to disk. Ray's own default would read or write
    ``~/.ray/auth_token`` in the user's home. A token the user set is left alone, and so is
    the auth mode: Ray reads that when it is imported, and children must agree with it."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return {}
    return {"RAY_AUTH_TOKEN": _PROCESS_TOKEN}


SOCKET_PATH_ROOM = 40
"""Longest cluster directory Ray's unix sockets fit under (``<dir>/ray/session_<stamp>/sockets/
plasma_store`` must stay within the 107 bytes of a socket path)."""


def private_cluster_dir() -> Path:
    """A new directory for one private cluster (its session files, token, sockets): under the
    temporary directory when its path leaves room for Ray's sockets, else under /tmp."""
    base = tempfile.gettempdir()
    if len(base) + len("/bcb-ray-xxxxxxxx") > SOCKET_PATH_ROOM:
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix="bcb-ray-", dir=base))


class RayUnavailable(RuntimeError):
    """Ray is not installed here (``pip install "ray==2.60.0"``)."""


def import_ray():
    """The ``ray`` module, or RayUnavailable saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(
            f"Ray worlds need the optional ray package ({exc}); install it with "
            '`python -m pip install "ray==2.60.0"`'
        ) from None
    if not hasattr(ray, "init"):  # a bare stand-in module (the verl interop tests register one)
        raise RayUnavailable(
            f"the ray module loaded here ({getattr(ray, '__file__', None) or 'no file'}) is "
            'not Ray; install it with `python -m pip install "ray==2.60.0"`'
        )
    return ray


@dataclass
class RayConf:
    """How to reach (or start) a Ray cluster and place the ranks on it."""

    address: str = "local"
    """``"local"``: start a private cluster in this process and stop it at close; otherwise the
    address of a running cluster (``"10.0.0.1:6379"`` or ``"auto"``), which is left running."""
    num_cpus: int = 2
    """CPUs the private cluster advertises (``address="local"`` only)."""
    object_store_mb: int = 512
    """Object store size of the private cluster, MiB (``address="local"`` only)."""
    placement: Literal["STRICT_PACK", "PACK"] = "STRICT_PACK"
    """Placement-group strategy: all ranks on one node (STRICT_PACK, what one-node RL jobs get)
    or as few nodes as fit (PACK, what verl and ROLL ask for across nodes)."""
    actor_cpus: float = 0.25
    """CPUs each rank's bundle reserves; fractional, so 8 ranks fit a 2-CPU cluster."""
    ranks_per_node: int | None = None
    """When set, rank ``r`` is pinned to the node advertising ``bcb_node<r // ranks_per_node>``
    (the emulated cluster); None lets the placement group choose."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """torch.distributed backend inside the actors (nccl gives each rank a GPU bundle); a
    ``bcastbench run world=ray`` job sets it from its ``backend`` group."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the ranks' tensors live (a ``bcastbench run`` job: from ``backend.device``)."""
    socket_ifname: str | None = None
    """``GLOO_SOCKET_IFNAME`` for the actors (the emulated cluster's ``eth0``); a
    ``{local_rank}`` in it is filled per rank (``eth{local_rank}``: the emulated rails, one
    link per rank, while Ray's own transfers keep the node's first address); None: gloo's
    default."""
    timeout_s: float = 120.0
    """No-answer limit for one task on the ranks; also gloo's own timeout (plus a margin); a
    ``bcastbench run`` job sets it from its ``timeout_s``."""
    start_timeout_s: float = 120.0
    """Limit for the placement group to be placed and every actor to join the world."""
    dispatch: Literal["none", "leader", "all_ranks"] = "none"
    """What a ``bcastbench run world=ray`` job times. ``none``: the broadcast alone, the leader
    already holding its batch (scope ``broadcast``, as on a forked world). ``leader``: the
    driver's global batch chunked and put to each replica's leader through Ray, then the job's
    strategy broadcasts it (ROLL). ``all_ranks``: one object per replica, fetched by every rank
    (verl, NeMo-RL, OpenRLHF); the strategy plays no part. Both dispatch modes time from the
    driver holding the batch to every rank holding its chunk (scope ``dispatch+broadcast``)
    beside their raw floor (``harness.job.dispatch``)."""

    def __post_init__(self) -> None:
        if self.placement not in ("STRICT_PACK", "PACK"):
            raise ValueError(f"ray.placement must be STRICT_PACK or PACK, got {self.placement!r}")
        if self.ranks_per_node is not None and self.placement == "STRICT_PACK":
            raise ValueError(
                f"ray.ranks_per_node={self.ranks_per_node} spreads ranks over nodes, but "
                "STRICT_PACK puts every bundle on one node; use placement=PACK"
            )
        for name in ("timeout_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ray.{name} must be positive seconds, got {getattr(self, name)}")
        if self.num_cpus < 1 or self.actor_cpus <= 0 or self.object_store_mb < 80:
            raise ValueError(
                f"ray.num_cpus ({self.num_cpus}) must be >= 1, ray.actor_cpus "
                f"({self.actor_cpus}) > 0 and ray.object_store_mb ({self.object_store_mb}) >= 80 "
                "(Ray's minimum object store is 75 MiB)"
            )
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(
                f"ray.dispatch must be one of {', '.join(DISPATCH_MODES)}, got {self.dispatch!r}"
            )


def end_pids(pids: Iterable[int], grace_s: float, terminate: bool) -> None:
    """``ray_reaper.end_processes`` on those of ``pids`` still running."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    ray_reaper.end_processes(procs, grace_s, terminate=terminate)


class PrivateCluster:
    """The Ray cluster a world starts in this process (``RayConf.address == "local"``) and stops
    at its close: its own directory, its own token, the reaper that cleans up after a driver
    that dies uncleanly, a network of loopback alone where the process may make one, and the
    pids of every process it started."""

    def __init__(self) -> None:
        self.dir: Path | None = None
        """The cluster's own directory (session files, token), removed at ``end``."""
        self.started_pids: set[int] = set()
        """Processes the cluster started (raylet, GCS, workers, the ranks' actors): ``end``
        waits for each of them to end and kills any that does not, by pid."""
        self.roots: dict[int, float] = {}
        """The processes ``ray.init`` started (pid → start time), which start every other
        process of the cluster: the cluster is they and their descendants, never another
        process this one runs beside it (``ray_reaper.cluster_processes``)."""
        self._saved_env: dict[str, str | None] = {}
        self._reaper: tuple[int, Any] | None = None
        self._network: PrivateNetwork | None = None

    def start(self, ray, conf: RayConf, runtime_env: dict[str, Any]) -> None:
        """Prepare the cluster (``_prepare``) and start it: ``ray.init`` of a new cluster."""
        self._prepare()
        before = ray_reaper.descendants(os.getpid(), recursive=False)
        try:
            self._init(ray, conf, runtime_env)
        finally:  # a cluster that failed half way is ended as the roots it has
            now = ray_reaper.descendants(os.getpid(), recursive=False)
            self.roots = {p: t for p, t in now.items() if p not in before}
            os.write(self._reaper[0], ray_reaper.roots_line(self.roots))
        self.count_started()

    def _init(self, ray, conf: RayConf, runtime_env: dict[str, Any]) -> None:
        # address="local" always starts a new cluster: a bare ray.init() would join any
        # cluster whose address another run left in /tmp/ray/ray_current_cluster.
        ray.init(
            address="local",
            # Its session files in its own directory, not Ray's shared /tmp/ray, so
            # nothing is left there and no later ray.init() finds this cluster.
            _temp_dir=str(self.dir / "ray"),
            # A private cluster on this machine talks over loopback only, never through
            # the host's outward-facing interface. Not 127.0.0.1: Ray rewrites that one
            # (and "localhost") to the primary interface's address; the rest of 127/8 is
            # loopback too and Ray keeps it.
            _node_ip_address=LOOPBACK,
            num_cpus=conf.num_cpus,
            object_store_memory=conf.object_store_mb * 2**20,
            include_dashboard=False,
            runtime_env=runtime_env,
            log_to_driver=False,
        )

    def count_started(self) -> None:
        """Every live process of the cluster (its roots and their descendants: the ranks'
        actors among them) among ``started_pids``."""
        self.started_pids |= set(ray_reaper.cluster_processes(os.getpid(), self.roots))

    def _prepare(self) -> None:
        """The private cluster's directory, its token (Ray's processes inherit the
        environment), and the reaper that cleans up after a driver that dies uncleanly."""
        self.dir = private_cluster_dir()
        for key, value in _private_token_env().items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        self._reaper = ray_reaper.start(self.dir)
        # After the reaper (which must stay on the host's network to outlive the cluster).
        self._network = PrivateNetwork()
        self._network.enter()

    def end(self, grace_s: float, terminate: bool) -> None:
        """Wait ``grace_s`` for the processes the cluster started (SIGTERM them first when
        ``terminate``), SIGKILL any left, by pid; remove the named semaphores they left
        (``ray_reaper.remove_semaphores``); then forget the cluster (``_forget``)."""
        self.count_started()  # actors started since the ranks were (a store's)
        end_pids(self.started_pids, grace_s, terminate=terminate)
        ray_reaper.remove_semaphores(self.started_pids)
        self._forget()

    def _forget(self) -> None:
        """After the cluster has stopped: the environment as it was, the directory gone, the
        thread back on the host's network, and the reaper told (it finds nothing to stop)."""
        if self._network is not None and self._network.entered:
            try:
                self._network.leave()
            except (OSError, RuntimeError):
                pass  # a thread that cannot go back keeps loopback only; nothing is exposed
        self._network = None
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if self._reaper is not None:
            fd, proc = self._reaper
            self._reaper = None
            os.close(fd)
            try:
                proc.wait(timeout=10)
            except Exception:
                proc.kill()
