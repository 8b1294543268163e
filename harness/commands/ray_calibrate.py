"""Calibrate the cost model's Ray terms on a local Ray world: the driver's put, each actor's
get, the per-actor call overhead, a lend over Ray Direct Transport (``rdt``) and a compiled
graph's channels (``cgraph``), fitted as α + n·β (relative least squares, so every size
counts); written to ``conf/ray/local.yaml``.

    bcastbench calibrate target=ray [ranks=4] [reps=7] [out=conf/ray/local.yaml] [dry_run=true]

Configured through ``conf/commands/ray_calibrate.yaml`` (schema ``RayCalibrateConf``); the points
and the fit also go to ``calibration.json`` in the Hydra job's directory
(``results/ray/calibrate/``).

What is timed is what a dispatch call pays (``harness.job.dispatch``): chunking the global
batch and ``ray.put`` of each chunk (a DataProto, or the floor's flat uint8 array), every rank's
``ray.get`` of its replica's object (all ranks at once, as in ``all_ranks``: the slowest rank
counts), and a round of no-op tasks to k actors (k = 1..ranks) for the call overhead.
``rdt``'s lend: rank 0 lends a chunk it already holds (the floor's flat tensor, or the
DataProto) and the first k ranks take it, k = 2 and ``ranks`` (one receiver, and all others:
Ray Direct Transport sends to each in turn). ``cgraph``: a compiled graph from the driver
through rank 0 to the first k ranks, executed with the chunk as its input, k = 2 and
``ranks`` (the readers share the host's cores). Both are timed from the driver's start to the
last rank's end, as a dispatch call is. The pricing lives in
``harness.model.dispatch_prices``; this module only measures.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness import paths
from harness.commands.hydra_app import run_app
from harness.commands.tool import job_command, job_dir
from harness.errors import ConfigError
from harness.files import write_atomic, write_json
from harness.job.dispatch import cgraph_give, chunk, flat_bytes, rdt_lend
from harness.model.least_squares import relative_fit
from harness.payload import generated
from harness.worlds import opening
from harness.worlds.ray_cluster import RayConf, RayUnavailable, import_ray

SIZES = (4, 48, 192, 704, 2816, 11264)
"""rl_rollout rows per chunk at seq_len 512: from tens of KiB to the 256 MiB RL hands a
replica (``sweep=large``): an affine fit to 16 MiB alone overpriced dispatch at 256 MiB."""
OBJECT_STORE_MB = 4096
"""The calibration's object store: the largest chunk and its flat copy, and a compiled
graph's channels of that size (as ``sweep=ray``'s dispatch jobs give it)."""
GRAPH_TIMEOUT_S = 300.0
"""The longest one execution of a compiled graph may take before the calibration fails."""
SEQ_LEN = 512
OUT = paths.CONF_DIR / "ray" / "local.yaml"
MODULE = "harness.commands.ray_calibrate"
"""Where ``bcastbench calibrate target=ray`` lives (its printed name:
``harness.errors.program``)."""


@dataclass
class RayCalibrateConf:
    """Root config of ``conf/commands/ray_calibrate.yaml``."""

    ranks: int = 4
    """Actors of the local Ray world; the call overhead is fitted over 1..ranks of them and
    every get runs on all of them at once."""
    reps: int = 7
    """Repetitions of each timing; the median counts."""
    out: str | None = None
    """Ray cost preset to write; null: ``conf/ray/local.yaml`` (``ray=local``)."""
    dry_run: bool = False
    """Measure and print the fit, write no preset (the job's calibration.json still)."""


def _noop(ctx) -> int:
    return ctx.rank


def _timed_get(ctx, boxed: list) -> float:
    """Seconds this rank spends in ``ray.get`` of the ref it was handed inside a list (a bare
    ref as an argument would be fetched by Ray before the task starts, outside the clock)."""
    import ray

    t0 = time.perf_counter()
    ray.get(boxed[0])
    return time.perf_counter() - t0


def _median(fn, reps: int) -> float:
    return float(np.median([fn() for _ in range(reps)]))


def _put_s(obj_of, reps: int) -> float:
    import ray

    def once() -> float:
        t0 = time.perf_counter()
        ray.put(obj_of())
        return time.perf_counter() - t0

    return _median(once, reps)


def _get_s(world, obj, reps: int) -> float:
    import ray

    def once() -> float:
        ref = ray.put(obj)
        per_rank = world.collect(world.submit(_timed_get, [([ref],)] * world.world_size), "get")
        return max(per_rank)

    return _median(once, reps)


_KEPT: dict = {}
"""On a rank: what it lends (``_keep``), held across the timed lends."""


def _keep(ctx, boxed: list) -> None:
    """Rank: hold the object as ``rdt``'s leader holds its chunk (a flat array as a tensor)."""
    import ray

    _KEPT["lent"] = rdt_lend(ctx, ray.get(boxed[0]))


def _lend_kept(ctx):
    return _KEPT["lent"]


def _end(ctx, data) -> int:
    """A rank's end time once it holds ``data`` (Ray resolved it before the task ran)."""
    return time.time_ns()


def _lend_s(world, obj, k: int, reps: int) -> float:
    """Seconds from rank 0's lend of ``obj`` (already held there) until the first ``k`` ranks
    hold it; the other ranks take nothing."""
    import ray

    world.collect(world.submit(_keep, [([ray.put(obj)],)] * world.world_size), "keep")

    def once() -> float:
        t0 = time.time_ns()
        lent = world.lend(0, _lend_kept)
        args = [(lent if r < k else None,) for r in range(world.world_size)]
        ends = world.collect(world.submit(_end, args), "lend")[:k]
        return (max(ends) - t0) / 1e9

    seconds = _median(once, reps)
    world.collect(world.submit(_forget, [()] * world.world_size), "forget")
    return seconds


def _forget(ctx) -> None:
    _KEPT.clear()


def _cgraph_s(world, obj, k: int, reps: int) -> float:
    """Seconds of one execution of a compiled graph that hands ``obj`` from the driver through
    rank 0 to the first ``k`` ranks (rank 0 among them), driver's start to last rank's end.
    A graph of its own for each object: a graph whose channels grew more than once did not
    tear down here (Ray 2.60)."""
    import ray
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as inp:
        given = world.actors[0].call.bind(cgraph_give, inp)
        dag = MultiOutputNode([a.call.bind(_end, given) for a in world.actors[:k]])
    graph = dag.experimental_compile()

    def once() -> float:
        t0 = time.time_ns()
        return (max(ray.get(graph.execute(obj), timeout=GRAPH_TIMEOUT_S)) - t0) / 1e9

    try:
        once()  # untimed: the channels grow to the object's size
        return _median(once, reps)
    finally:
        graph.teardown()
        gc.collect()  # the graph's channels leave the object store only with the graph


def _call_s(world, k: int, reps: int) -> float:
    import ray

    def once() -> float:
        t0 = time.perf_counter()
        ray.get([a.call.remote(_noop) for a in world.actors[:k]])
        return time.perf_counter() - t0

    return _median(once, reps)


def _fit(x: list[float], y: list[float]) -> tuple[float, float]:
    """α, β ≥ 0 of y = α + β·x (``relative_fit``)."""
    alpha, beta = relative_fit([np.ones(len(x)), x], y)
    return alpha, beta


def measure(world, reps: int) -> dict[str, list]:
    """Every timing the fit needs: {term: [(bytes or actors, seconds), ...]}; the lend and
    channel terms as [(bytes, ranks taking it, seconds), ...]."""
    terms = ("put", "put_raw", "get", "get_raw", "call", "lend", "lend_raw", "channel",
             "channel_raw")  # fmt: skip
    out: dict[str, list] = {k: [] for k in terms}
    takers = sorted({min(2, world.world_size), world.world_size})
    pieces = []
    for rows in SIZES:
        batch = generated.make("rl_rollout", rows, SEQ_LEN, 0, None)
        piece = chunk(batch, 1)[0]
        flat = flat_bytes(piece)
        n = int(flat.nbytes)
        out["put"].append((n, _put_s(lambda b=batch: chunk(b, 1)[0], reps)))
        out["put_raw"].append((n, _put_s(lambda f=flat: f, reps)))
        out["get"].append((n, _get_s(world, piece, reps)))
        out["get_raw"].append((n, _get_s(world, flat, reps)))
        for k in takers:
            out["lend"].append((n, k, _lend_s(world, piece, k, reps)))
            out["lend_raw"].append((n, k, _lend_s(world, flat, k, reps)))
        pieces.append((n, piece, flat))
        del batch
    for k in range(1, world.world_size + 1):
        out["call"].append((k, _call_s(world, k, reps)))
    # Last: Ray Direct Transport's lends hang while a compiled graph holds the actors.
    for n, piece, flat in pieces:
        for k in takers:
            out["channel"].append((n, k, _cgraph_s(world, piece, k, reps)))
            out["channel_raw"].append((n, k, _cgraph_s(world, flat, k, reps)))
    return out


def fitted(points: dict[str, list], cores: int) -> dict[str, float]:
    """The RayCostConf fields (µs, GB/s) from ``measure``'s points, on a host of ``cores``."""
    conf: dict[str, float] = {}
    for term in ("put", "put_raw", "get", "get_raw"):
        alpha, beta = _fit(*zip(*points[term]))
        conf[f"{term}_call_us"] = round(alpha * 1e6, 1)
        conf[f"{term}_gbytes_per_s"] = _rate(beta)
    alpha, beta = _fit(*zip(*points["call"]))
    conf["call_us"] = round(alpha * 1e6, 1)
    conf["call_per_actor_us"] = round(beta * 1e6, 1)
    for term in ("lend", "lend_raw"):
        # α + (k − 1)·(α_r + n·β_r): Ray Direct Transport sends to each other taker in turn.
        n, k, y = (np.asarray(v, dtype=float) for v in zip(*points[term]))
        alpha, per_taker, beta = relative_fit([np.ones(len(y)), k - 1, (k - 1) * n], y)
        conf[f"{term}_call_us"] = round(alpha * 1e6, 1)
        conf[f"{term}_per_rank_us"] = round(per_taker * 1e6, 1)
        conf[f"{term}_gbytes_per_s"] = _rate(beta)
    for term in ("channel", "channel_raw"):
        # α + n·β_write + n·β_read·sharing(k): the readers share the host's cores.
        n, k, y = (np.asarray(v, dtype=float) for v in zip(*points[term]))
        sharing = np.maximum(1.0, k / cores)
        alpha, write, read = relative_fit([np.ones(len(y)), n, n * sharing], y)
        conf[f"{term}_call_us"] = round(alpha * 1e6, 1)
        conf[f"{term}_write_gbytes_per_s"] = _rate(write)
        conf[f"{term}_read_gbytes_per_s"] = _rate(read)
    return conf


def _rate(beta: float) -> float:
    """GB/s of a fitted β (s/byte); 0 where no per-byte cost was found (``RayCostConf``)."""
    return round(1 / beta / 1e9, 3) if beta > 0 else 0.0


def _yaml(conf: dict[str, float], points: dict[str, list], ranks: int, secs: float,
          command: str) -> str:  # fmt: skip
    import socket

    import yaml

    lines = [
        f"# Written by `{command}`; do not edit by hand, run it again.",
        f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} on {socket.gethostname()}, local Ray world of "
        f"{ranks} actors, {len(SIZES)} sizes ({secs:.0f} s). Values measured here.",
        "# points (bytes or actors [/ ranks taking it] -> ms, median):",
    ]
    for term, pts in points.items():
        cells = ["/".join(map(str, p[:-1])) + f":{p[-1] * 1e3:.2f}" for p in pts]
        lines.append(f"#   {term:<11} " + "  ".join(cells))
    body = yaml.safe_dump({"name": "local", **conf, "calibrated_ranks": ranks}, sort_keys=False)
    return "\n".join(lines) + "\n" + body


def check(cfg) -> None:
    """The values a calibration reads, checked before Ray starts (``command.run_app``)."""
    if cfg.ranks < 1:
        raise ConfigError(f"ranks must be >= 1, got {cfg.ranks}")
    if cfg.reps < 1:
        raise ConfigError(f"reps must be >= 1, got {cfg.reps}")
    if cfg.out is not None and Path(cfg.out).suffix not in (".yaml", ".yml"):
        raise ConfigError(f"out must name a .yaml file, got {cfg.out!r}")
    try:
        import_ray()
    except RayUnavailable as exc:
        raise ConfigError(str(exc)) from None


def task(cfg) -> dict[str, float]:
    """One Hydra job: measure on this process's local Ray world, fit, write the preset and
    the job's ``calibration.json``."""
    t0 = time.perf_counter()
    world = opening.ray_world(cfg.ranks, RayConf(num_cpus=2, object_store_mb=OBJECT_STORE_MB))
    points = measure(world, cfg.reps)
    cores = len(os.sched_getaffinity(0))
    conf = {**fitted(points, cores), "calibrated_cores": cores}
    command = job_command(MODULE)
    out = None if cfg.dry_run else Path(cfg.out or OUT)
    if out is not None:
        write_atomic(out, _yaml(conf, points, cfg.ranks, time.perf_counter() - t0, command))
    record = {
        "kind": "ray_calibration",
        "ranks": cfg.ranks,
        "reps": cfg.reps,
        "fit": conf,
        "points": points,
        "preset": None if out is None else str(out),
        "command": command,
    }
    write_json(job_dir() / "calibration.json", record)
    print(f"wrote {out}: {conf}" if out is not None else f"fit (dry run, not written): {conf}")
    return conf


def main(argv: list[str] | None = None) -> int:
    """``bcastbench calibrate target=ray [overrides]``; a bad value exits 2 with one line."""
    return run_app(MODULE, "ray_calibrate", task, check, argv, schema=RayCalibrateConf)


if __name__ == "__main__":
    raise SystemExit(main())
