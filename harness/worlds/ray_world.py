"""The Ray world (``RayWorld``, a ``harness.worlds.protocol.World``): ranks as Ray actors, placed in
one placement group as RL frameworks place their workers, with torch.distributed and
megatron-core groups built inside the actors.

Each actor holds a ``harness.worlds.forked.RankContext``, so the rank-side job of the forked world
(``harness.job.broadcast.run_job_on_rank``) runs here unchanged: same groups, same timing, same
verification. ``RayWorld.submit``/``collect`` also let a driver hand each rank its own arguments
(Ray ObjectRefs included), which is what dispatch (``harness.job.dispatch``) needs.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

from harness import paths
from harness.worlds import ray_reaper
from harness.worlds.emulated import LINKS_ENV, link_counter
from harness.worlds.protocol import WorldError, group_by_node
from harness.worlds.rank import RankContext, device_for, rendezvous_store, where
from harness.worlds.ray_network import PrivateNetwork

NODE_RESOURCE = "bcb_node"
"""Custom resource a multi-node cluster's node ``k`` advertises as ``bcb_node<k>``: bundles ask
for it so rank ``r`` lands on node ``r // ranks_per_node``, as torchrun's node ranks place it."""


DISPATCH_MODES = ("none", "leader", "all_ranks")
"""Values of ``RayConf.dispatch``."""
DEATH_GRACE_S = 3.0
"""How long, after a rank fails, the world waits for its peers to fail too before naming one."""


PROGRESS_POLL_S = 2.0
"""How often the driver asks waiting ranks where they are."""
WAIT_SLICE_S = 0.2
"""The longest one wait on Ray lasts before the driver looks for a Ctrl-C (``ctrl_c_as_a_flag``)."""
LEAVE_S, CLOSE_GRACE_S, KILL_GRACE_S = 10.0, 15.0, 2.0
"""Closing a world: how long ranks get to leave the torch.distributed world, and how long the
private cluster's processes get to end by themselves (after a clean close) or after SIGTERM
(an interrupted or failed job) before SIGKILL."""

DROPPED = "the Ray world's ranks were torn down (a next job starts new ones on the same cluster)"
"""What a failed task's error says happened to the world (``RayWorld.revive``)."""

LOOPBACK = "127.0.0.2"
"""The address a private local Ray cluster advertises and connects on (see ``RayWorld``)."""


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


class _ActorBoard:
    """What a rank actor is doing, kept in the actor for the driver to ask (``RankActor.where``)
    while a task runs: the forked world's ``PhaseBoard`` interface, one slot."""

    def __init__(self) -> None:
        self.phase, self.since = "starting", time.monotonic()

    def write(self, rank: int, job: int, step: int, phase: str) -> None:
        self.phase, self.since = phase, time.monotonic()


class RankActor:
    """One rank: joins the torch.distributed world, then runs ``fn(ctx, *args)`` on request.
    Runs its methods on two threads, so ``where`` answers while ``call`` works."""

    def __init__(self, rank: int, world_size: int, backend: str, device: str) -> None:
        import torch

        torch.set_num_threads(1)  # ranks share the node's cores; more threads oversubscribe
        self.rank, self.world_size = rank, world_size
        self.backend, self.device = backend, device
        self.ctx = None
        self.board = _ActorBoard()
        self._task_thread: int | None = None

    def where(self) -> tuple[str, float, str]:
        """(the phase this rank last reported, seconds since it did, where its task's thread
        is: inside a collective or outside any)."""
        import sys

        frame = sys._current_frames().get(self._task_thread) if self._task_thread else None
        stack = where(frame) if frame is not None else "idle"
        return self.board.phase, time.monotonic() - self.board.since, stack

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        """The Ray node this actor runs on (its host)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind((self.node_ip(), 0))
            return s.getsockname()[1]

    def join(self, master_addr: str, port: int, timeout_s: float, ifname: str | None = None) -> int:
        """Initialize torch.distributed (collective over all actors); return this pid. ``ifname``:
        this rank's own ``GLOO_SOCKET_IFNAME`` (its rail), over the actors' common one."""
        import torch.distributed as dist

        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(port),
        )
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        # Ray pins each GPU bundle's actor to one visible device, so any index maps to 0.
        dev = device_for(self.backend, self.device, self.rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            self.backend,
            store=rendezvous_store(master_addr, port, self.rank, self.world_size, timeout),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )

        # None off an emulated cluster; there, the rank-side job counts link bytes with it.
        counter = link_counter()
        self.ctx = RankContext(
            self.rank, self.world_size, self.backend, dev, link_counter=counter, board=self.board,
            node=f"ray node {self.node_id()}",
        )  # fmt: skip
        return os.getpid()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        import threading

        self._task_thread = threading.get_ident()
        self.board.write(self.rank, 0, 0, getattr(fn, "__name__", "task"))
        return fn(self.ctx, *args)

    def leave(self) -> None:
        """Destroy the groups and the world (collective); the actor is killed afterwards."""
        import torch.distributed as dist

        if self.ctx is not None:
            self.ctx.release_groups()
        if dist.is_initialized():
            dist.destroy_process_group()


def _end_pids(pids, grace_s: float, terminate: bool) -> None:
    """``ray_reaper.end_processes`` on those of ``pids`` still running."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    ray_reaper.end_processes(procs, grace_s, terminate=terminate)


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


class RayWorld:
    """``world_size`` ranks as Ray actors in one placement group, serving tasks until closed."""

    def __init__(self, world_size: int, conf: RayConf | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.conf = conf or RayConf()
        if self.conf.ranks_per_node is not None and world_size % self.conf.ranks_per_node:
            raise ValueError(
                f"ray.ranks_per_node ({self.conf.ranks_per_node}) does not divide the world of "
                f"{world_size}"
            )
        self.world_size = world_size
        self.actors: list = []
        self.rank_pids: list[int] = []
        self._nodes: tuple[tuple[int, ...], ...] = ()
        self.started_pids: set[int] = set()
        """Processes this world's private cluster started (raylet, GCS, workers): close()
        waits for each of them to end and kills any that does not, by pid."""
        self.start_s = 0.0
        self._ray = None
        self._pg = None
        self._owns_cluster = False
        self._connected = False
        self._cluster_dir: Path | None = None
        """A private cluster's own directory (session files, token), removed at close."""
        self._saved_env: dict[str, str | None] = {}
        self._reaper: tuple[int, Any] | None = None
        self._network: PrivateNetwork | None = None
        self._node_ids: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> RayWorld:
        self._ray = import_ray()
        return self._bring_up(self._connect)

    def revive(self) -> RayWorld:
        """Start the ranks again after a failed task dropped them (``collect``): a new
        placement group and new actors join a new torch.distributed world on the cluster this
        world still holds, so a sweep's next job does not pay a cluster's start again. Raises
        (the world closed) when the cluster lost a node the ranks ran on or cannot place them;
        a world already closed stays closed (not alive: the caller starts a new one)."""
        if self.alive or self._ray is None or not self._connected:
            return self
        return self._bring_up(self._check_nodes)

    def _bring_up(self, first: Callable[[Any], None]) -> RayWorld:
        """``first(ray)`` (connect, or check the cluster), then the ranks placed and joined;
        on any failure the world is closed, every process it started ended."""
        ray = self._ray
        t0 = time.perf_counter()
        try:
            first(ray)
            self._place(ray)
            self._join(ray)
        except BaseException:
            self.close(kill=True)
            raise
        if self._owns_cluster:
            self.started_pids |= _descendants() - self._before
        self.start_s = time.perf_counter() - t0
        return self

    def _check_nodes(self, ray) -> None:
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        lost = self._node_ids - alive
        if lost:
            raise WorldError(
                f"the Ray cluster lost {len(lost)} node(s) the ranks ran on; a new world is "
                "started instead"
            )

    def _drop_ranks(self) -> None:
        """A failed task: the rank actors killed (their processes ended, by pid) and the
        placement group removed; the cluster stays, for ``revive``."""
        self._kill_actors()
        _end_pids(self.rank_pids, KILL_GRACE_S, terminate=True)
        self.rank_pids = []

    def _kill_actors(self) -> None:
        """The rank actors killed and their placement group removed (neither may stop a
        close or a failure's teardown)."""
        ray = self._ray
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors = []
        if self._pg is not None:
            try:
                ray.util.remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None

    def _actor_env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH", "")
        env = {
            "PYTHONPATH": str(paths.REPO) + (os.pathsep + path if path else ""),
            "OMP_NUM_THREADS": "1",
        }
        if self.conf.socket_ifname and "{" not in self.conf.socket_ifname:
            env["GLOO_SOCKET_IFNAME"] = self.conf.socket_ifname
        elif self.conf.address == "local" and not self.conf.socket_ifname:
            # A private cluster is this machine alone: gloo's pairs stay on loopback.
            env["GLOO_SOCKET_IFNAME"] = "lo"

        if os.environ.get(LINKS_ENV):  # the emulated cluster's link counters, for the ranks
            env[LINKS_ENV] = os.environ[LINKS_ENV]
        return env

    def _connect(self, ray) -> None:
        if ray.is_initialized():
            raise WorldError(
                "a Ray session is already open in this process; a RayWorld opens and closes "
                "its own (close the other one first)"
            )
        runtime_env = {"env_vars": self._actor_env()}
        self._before = _descendants()
        if self.conf.address == "local":
            self._owns_cluster = True
            self._prepare_private_cluster()
            # address="local" always starts a new cluster: a bare ray.init() would join any
            # cluster whose address another run left in /tmp/ray/ray_current_cluster.
            ray.init(
                address="local",
                # Its session files in its own directory, not Ray's shared /tmp/ray, so
                # nothing is left there and no later ray.init() finds this cluster.
                _temp_dir=str(self._cluster_dir / "ray"),
                # A private cluster on this machine talks over loopback only, never through
                # the host's outward-facing interface. Not 127.0.0.1: Ray rewrites that one
                # (and "localhost") to the primary interface's address; the rest of 127/8 is
                # loopback too and Ray keeps it.
                _node_ip_address=LOOPBACK,
                num_cpus=self.conf.num_cpus,
                object_store_memory=self.conf.object_store_mb * 2**20,
                include_dashboard=False,
                runtime_env=runtime_env,
                log_to_driver=False,
            )
        else:
            ray.init(address=self.conf.address, runtime_env=runtime_env, log_to_driver=False)
        self._connected = True
        if self._owns_cluster:
            self.started_pids |= _descendants() - self._before

    def _prepare_private_cluster(self) -> None:
        """The private cluster's directory, its token (Ray's processes inherit the
        environment), and the reaper that cleans up after a driver that dies uncleanly."""
        self._cluster_dir = private_cluster_dir()
        for key, value in _private_token_env().items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        self._reaper = ray_reaper.start(self._cluster_dir)
        self._before.add(self._reaper[1].pid)  # not the cluster's: it ends when told
        # After the reaper (which must stay on the host's network to outlive the cluster).
        self._network = PrivateNetwork()
        self._network.enter()

    def _forget_private_cluster(self) -> None:
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
        if self._cluster_dir is not None:
            shutil.rmtree(self._cluster_dir, ignore_errors=True)
            self._cluster_dir = None
        if self._reaper is not None:
            fd, proc = self._reaper
            self._reaper = None
            os.close(fd)
            try:
                proc.wait(timeout=10)
            except Exception:
                proc.kill()

    def _bundle(self, rank: int) -> dict[str, float]:
        c = self.conf
        bundle: dict[str, float] = {"CPU": c.actor_cpus}
        if c.backend == "nccl" or c.device == "cuda":
            bundle["GPU"] = 1
        if c.ranks_per_node is not None:
            bundle[f"{NODE_RESOURCE}{rank // c.ranks_per_node}"] = 0.001
        return bundle

    def _place(self, ray) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = [self._bundle(r) for r in range(self.world_size)]
        self._pg = placement_group(bundles, strategy=self.conf.placement)
        with ctrl_c_as_a_flag() as check:
            ready = _wait_for(ray, [self._pg.ready()], self.conf.start_timeout_s, check)
        if not ready:
            raise WorldError(
                f"the placement group of {self.world_size} bundles ({bundles[0]} for rank 0, "
                f"{self.conf.placement}) was not placed within {self.conf.start_timeout_s:.0f} s; "
                f"the cluster offers {ray.cluster_resources()}"
            )
        remote = ray.remote(RankActor)
        self.actors = [
            remote.options(
                max_concurrency=2,  # call, and where beside it
                num_cpus=self.conf.actor_cpus,
                num_gpus=bundles[r].get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=r
                ),
            ).remote(r, self.world_size, self.conf.backend, self.conf.device)
            for r in range(self.world_size)
        ]

    def _join(self, ray) -> None:
        c = self.conf
        # MASTER_ADDR is rank 0's node; the port is one rank 0 found free there.
        addr = self._get(self.actors[0].node_ip.remote(), "asking rank 0 for its node address")
        port = self._get(self.actors[0].free_port.remote(), "asking rank 0 for a free port")
        # gloo's own timeout sits past ours, so the driver names a hung rank first.
        refs = [
            a.join.remote(addr, port, c.timeout_s + 5, self._ifname(r))
            for r, a in enumerate(self.actors)
        ]
        self.rank_pids = self.collect(
            refs, "joining the torch.distributed world", c.start_timeout_s
        )
        node_ids = self.collect(
            [a.node_id.remote() for a in self.actors],
            "asking each rank for its node",
            c.start_timeout_s,
        )
        self._nodes = group_by_node(node_ids)
        self._node_ids = set(node_ids)

    def _ifname(self, rank: int) -> str | None:
        """Rank ``rank``'s interface when ``socket_ifname`` names one per rank, else None."""
        pattern = self.conf.socket_ifname
        if not pattern or "{" not in pattern:
            return None
        return pattern.format(local_rank=rank % (self.conf.ranks_per_node or self.world_size))

    def _get(self, ref, what: str):
        return self.collect([ref], what, self.conf.start_timeout_s)[0]

    @property
    def alive(self) -> bool:
        return bool(self.actors) and self._connected

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """The ranks on each Ray node (by the node id of each rank's actor)."""
        return self._nodes

    def record_fields(self) -> dict[str, Any]:
        return {}

    def close(self, kill: bool = False) -> None:
        """Leave the world, kill the actors, remove the placement group, and (for a private
        cluster) shut Ray down and make sure every process it started has ended."""
        ray = self._ray
        if ray is None or not self._connected:
            self._reap(kill)
            self._forget_private_cluster()
            return
        if self.actors and not kill:
            try:
                ray.get([a.leave.remote() for a in self.actors], timeout=LEAVE_S)
            except Exception:
                pass  # a rank that cannot leave cleanly is killed below anyway
        self._kill_actors()
        ray.shutdown()
        self._connected = False
        self._reap(kill)
        self._forget_private_cluster()

    def _reap(self, kill: bool = False) -> None:
        """Wait for the processes the private cluster started (SIGTERM them first when
        ``kill``: an interrupted or failed job does not wait for Ray's own shutdown); SIGKILL
        any left after the grace, by pid."""
        _end_pids(self.started_pids, KILL_GRACE_S if kill else CLOSE_GRACE_S, terminate=kill)

    def __enter__(self) -> RayWorld:
        if self.alive:
            return self
        return self.revive() if self._connected else self.start()

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)

    # -- tasks -----------------------------------------------------------------------------
    def run(
        self, fn: Callable[..., Any], *args: Any, what: str = "", timeout_s: float | None = None
    ) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank; the per-rank results in rank order (as
        ``harness.worlds.forked.World.run``)."""
        refs = self.submit(fn, [args] * self.world_size)
        return self.collect(refs, what or getattr(fn, "__name__", "task"), timeout_s)

    def submit(self, fn: Callable[..., Any], per_rank_args: Sequence[Sequence[Any]]) -> list:
        """Start ``fn(ctx, *per_rank_args[r])`` on every rank r; return the ObjectRefs. An
        ObjectRef among the arguments reaches the rank as its value (Ray fetches it)."""
        if not self.alive:
            raise WorldError("the Ray world is not running (it was closed or failed)")
        if len(per_rank_args) != self.world_size:
            raise ValueError(
                f"{len(per_rank_args)} argument lists for a world of {self.world_size}"
            )
        return [a.call.remote(fn, *args) for a, args in zip(self.actors, per_rank_args)]

    def collect(self, refs: list, what: str, timeout_s: float | None = None) -> list[Any]:
        """Every rank's answer in rank order. A rank that fails or dies, or that reports no
        progress for ``timeout_s`` (as in a forked world: the limit is on silence, not on the
        job's length), tears the world down and raises WorldError naming it and its phase. A
        Ctrl-C while it waits raises KeyboardInterrupt within ``WAIT_SLICE_S``."""
        with ctrl_c_as_a_flag() as check:
            return self._collect(refs, what, timeout_s or self.conf.timeout_s, check)

    def _collect(self, refs: list, what: str, limit: float, check: Callable[[], None]):
        ray = self._ray
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending, results = list(refs), {}
        started = time.monotonic()
        while pending:
            ready, pending = _wait_one(ray, pending, PROGRESS_POLL_S, check)
            if not ready:
                silent = self._silent_ranks(
                    [rank_of[r] for r in pending], limit, time.monotonic() - started
                )
                if silent:
                    self._drop_ranks()
                    named = "; ".join(
                        f"rank {r} stopped responding for {limit:.0f} s while {phase!r} ({at})"
                        for r, phase, at in silent
                    )
                    raise WorldError(f"{named}, in {what}; {DROPPED}")
                continue
            ref = ready[0]
            try:
                results[rank_of[ref]] = ray.get(ref)
            except Exception as exc:
                rank, exc = self._root_failure(rank_of[ref], exc, pending, rank_of)
                self._drop_ranks()
                detail = str(exc).strip()
                raise WorldError(
                    f"rank {rank} failed in {what}: {type(exc).__name__}; {DROPPED}\n{detail}"
                ) from None
        return [results[r] for r in range(len(refs))]

    def _silent_ranks(self, ranks: list[int], limit: float, waited: float):
        """(rank, phase, where) of each of ``ranks`` that has reported nothing for ``limit``
        seconds; when some of them are outside any collective, only those (the rest wait for
        them inside one). A rank that cannot even say where it is (its actor gone or wedged)
        counts as silent since the task began."""
        if waited < limit:
            return []
        ray = self._ray
        asks = {r: self.actors[r].where.remote() for r in ranks if r < len(self.actors)}
        silent = []
        for rank, ask in asks.items():
            try:
                phase, idle_s, at = ray.get(ask, timeout=PROGRESS_POLL_S)
            except Exception:
                phase, idle_s, at = "not answering", waited, "its actor does not answer"
            if idle_s >= limit:
                silent.append((rank, phase, at))
        outside = [s for s in silent if not s[2].startswith("in collective")]
        return outside or silent

    def _root_failure(self, rank: int, exc: Exception, pending: list, rank_of: dict):
        """The failure to name. When one rank dies, its peers fail too (their collectives lose
        a connection), and whichever answers first is not the cause: wait briefly for the others
        and prefer a rank whose actor died over one that raised."""
        ray = self._ray
        died = ray.exceptions.RayActorError
        if isinstance(exc, died) or not pending:
            return rank, exc
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
        for ref in sorted(ready, key=rank_of.get):
            try:
                ray.get(ref)
            except died as other:
                return rank_of[ref], other
            except Exception:
                continue
        return rank, exc


@contextlib.contextmanager
def ctrl_c_as_a_flag():
    """While the driver waits on Ray, a Ctrl-C is a flag, raised as KeyboardInterrupt from the
    driver's own loop (``check()`` between waits), not from inside Ray.

    Ray's wait runs Python's signal handlers from inside its C++ loop and drops the
    KeyboardInterrupt Python's default handler raises there: a driver blocked in ``ray.wait``
    never saw its Ctrl-C and ran the job on (a sweep's Ctrl-C ended only when the SIGINT had
    also killed the cluster's processes and the driver noticed, which a loaded machine took
    longer than 30 s to do). Off the main thread, or where SIGINT is not Python's to handle
    (ignored, or the C default), nothing changes."""
    if _FLAG:  # a wait inside a wait: the outer one owns the signal
        yield _FLAG[-1]
        return
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield lambda: None
        return
    seen: list[int] = []

    def check() -> None:
        if seen:
            signal.signal(signal.SIGINT, previous)
            previous(signal.SIGINT, None)  # Python's default raises KeyboardInterrupt

    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    _FLAG.append(check)
    try:
        yield check
        check()
    finally:
        _FLAG.pop()
        signal.signal(signal.SIGINT, previous)


_FLAG: list[Callable[[], None]] = []
"""The check of the wait that owns SIGINT now (at most one: the outermost)."""


def _wait_one(ray, pending: list, timeout_s: float, check: Callable[[], None]):
    """``ray.wait(pending, num_returns=1, timeout=timeout_s)`` in slices of ``WAIT_SLICE_S``,
    ``check`` (a Ctrl-C) between them."""
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        left = deadline - time.monotonic()
        ready, rest = ray.wait(pending, num_returns=1, timeout=max(0.0, min(WAIT_SLICE_S, left)))
        if ready or left <= WAIT_SLICE_S:
            return ready, rest


def _wait_for(ray, refs: list, timeout_s: float, check: Callable[[], None]) -> bool:
    """Whether every one of ``refs`` is ready within ``timeout_s`` (``_wait_one`` slices)."""
    deadline, pending = time.monotonic() + timeout_s, list(refs)
    while pending:
        _, pending = _wait_one(ray, pending, max(0.0, deadline - time.monotonic()), check)
        if pending and time.monotonic() >= deadline:
            return False
    return True
