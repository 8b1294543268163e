"""The Ray world (``RayWorld``, a ``harness.worlds.protocol.World``): ranks as Ray actors, placed in
one placement group as RL frameworks place their workers, with torch.distributed and
megatron-core groups built inside the actors.

Each actor (``harness.worlds.ray_actor.RankActor``) holds a ``harness.worlds.rank.RankContext``,
so the rank-side job of the forked world (``harness.job.broadcast.run_job_on_rank``) runs here
unchanged: same groups, same timing, same verification. ``RayWorld.submit``/``collect`` also let
a driver hand each rank its own arguments (Ray ObjectRefs included), which is what dispatch
(``harness.job.dispatch``) needs; ``harness.worlds.ray_answers`` gathers the answers and names a
hung or failed rank, and ``harness.worlds.ray_cluster`` holds the cluster (``RayConf``, the
private cluster a world starts for itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness.worlds.protocol import NodesFoundAtStart, WorldError, group_by_node
from harness.worlds.ray_actor import actor_env, remote_rank_actor
from harness.worlds.ray_answers import collect_answers, placed
from harness.worlds.ray_cluster import (
    NODE_RESOURCE,
    PrivateCluster,
    RayConf,
    end_pids,
    import_ray,
)

LEAVE_S, CLOSE_GRACE_S, KILL_GRACE_S = 10.0, 15.0, 2.0
"""Closing a world: how long ranks get to leave the torch.distributed world, and how long the
private cluster's processes get to end by themselves (after a clean close) or after SIGTERM
(an interrupted or failed job) before SIGKILL."""


class RayWorld(NodesFoundAtStart):
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
        self.start_s = 0.0
        self._ray = None
        self._pg = None
        self._connected = False
        self._cluster: PrivateCluster | None = None
        """The private cluster this world started (``address="local"``), until its close."""
        self._node_ids: set[str] = set()
        self._lending = None
        """Ray's collective group over the ranks for Ray Direct Transport (``lend``), made on
        first use and gone with the actors."""

    @property
    def started_pids(self) -> set[int]:
        """Processes this world's private cluster started (raylet, GCS, workers, and the
        actors a strategy started since, a store's): close() waits for each of them to end and
        kills any that does not, by pid. No other process of the driver's is among them."""
        if self._cluster is None:
            return set()
        self._cluster.count_started()
        return self._cluster.started_pids

    @property
    def _cluster_dir(self) -> Path | None:
        """A private cluster's own directory (session files, token), removed at close."""
        return self._cluster.dir if self._cluster is not None else None

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
        if self._cluster is not None:
            self._cluster.count_started()
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
        end_pids(self.rank_pids, KILL_GRACE_S, terminate=True)
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
        self._lending = None
        if self._pg is not None:
            try:
                ray.util.remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None

    def _connect(self, ray) -> None:
        if ray.is_initialized():
            raise WorldError(
                "a Ray session is already open in this process; a RayWorld opens and closes "
                "its own (close the other one first)"
            )
        runtime_env = {"env_vars": actor_env(self.conf)}
        if self.conf.address == "local":
            self._cluster = PrivateCluster()
            self._cluster.start(ray, self.conf, runtime_env)
        else:
            ray.init(address=self.conf.address, runtime_env=runtime_env, log_to_driver=False)
        self._connected = True

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
        if not placed(ray, self._pg, self.conf.start_timeout_s):
            raise WorldError(
                f"the placement group of {self.world_size} bundles ({bundles[0]} for rank 0, "
                f"{self.conf.placement}) was not placed within {self.conf.start_timeout_s:.0f} s; "
                f"the cluster offers {ray.cluster_resources()}"
            )
        remote = remote_rank_actor()
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

    def close(self, kill: bool = False) -> None:
        """Leave the world, kill the actors, remove the placement group, and (for a private
        cluster) shut Ray down and make sure every process it started has ended."""
        ray = self._ray
        if ray is not None and self._connected:
            if self.actors and not kill:
                try:
                    ray.get([a.leave.remote() for a in self.actors], timeout=LEAVE_S)
                except Exception:
                    pass  # a rank that cannot leave cleanly is killed below anyway
            self._kill_actors()
            ray.shutdown()
            self._connected = False
        self._end_cluster(kill)

    def _end_cluster(self, kill: bool = False) -> None:
        """Wait for the processes the private cluster started (SIGTERM them first when
        ``kill``: an interrupted or failed job does not wait for Ray's own shutdown); SIGKILL
        any left after the grace, by pid; then its directory, token and network go."""
        if self._cluster is not None:
            self._cluster.end(KILL_GRACE_S if kill else CLOSE_GRACE_S, terminate=kill)
            self._cluster = None

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
        ``harness.worlds.forked.ForkedWorld.run``)."""
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

    def lend(self, rank: int, fn: Callable[..., Any], *args: Any):
        """Start ``fn(ctx, *args)`` on rank ``rank``, its answer kept there and lent over Ray
        Direct Transport (``RankActor.lend``); return its ObjectRef, which a task of another
        rank takes (``submit``) over the ranks' collective group. The group is Ray's over every
        rank in rank order, torch gloo: where torch.distributed is up, as on these ranks, Ray
        makes it a subgroup of their world, so it opens no rendezvous or port of its own."""
        if not self.alive:
            raise WorldError("the Ray world is not running (it was closed or failed)")
        if self._lending is None:
            from ray.experimental.collective import create_collective_group

            self._lending = create_collective_group(self.actors, backend="torch_gloo")
        return self.actors[rank].lend.remote(fn, *args)

    def collect(self, refs: list, what: str, timeout_s: float | None = None) -> list[Any]:
        """Every rank's answer in rank order. A rank that fails or dies, or that reports no
        progress for ``timeout_s`` (as in a forked world: the limit is on silence, not on the
        job's length), tears the world down and raises WorldError naming it and its phase. A
        Ctrl-C while it waits raises KeyboardInterrupt within ``WAIT_SLICE_S``."""
        limit = timeout_s or self.conf.timeout_s
        return collect_answers(self._ray, self.actors, refs, what, limit, self._drop_ranks)
