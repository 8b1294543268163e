"""Calibrate the cost model's Ray terms on a local Ray world: the driver's put, each actor's
get, and the per-actor call overhead, fitted as α + n·β; written to ``conf/ray/local.yaml``.

    bcastbench calibrate target=ray [ranks=4] [reps=7] [out=conf/ray/local.yaml] [dry_run=true]

Configured through ``conf/commands/ray_calibrate.yaml`` (schema ``RayCalibrateConf``); the points
and the fit also go to ``calibration.json`` in the Hydra job's directory
(``results/ray/calibrate/``).

What is timed is what a dispatch call pays (``harness.job.dispatch``): chunking the global
batch and ``ray.put`` of each chunk (a DataProto, or the floor's flat uint8 array), every rank's
``ray.get`` of its replica's object (all ranks at once, as in ``all_ranks``: the slowest rank
counts), and a round of no-op tasks to k actors (k = 1..ranks) for the call overhead. The
pricing lives in ``harness.model.dispatch_prices``; this module only measures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness import paths
from harness.commands.hydra_app import run_app
from harness.commands.tool import job_command, job_dir
from harness.errors import ConfigError
from harness.files import write_atomic, write_json
from harness.job.dispatch import chunk, flat_bytes
from harness.payload import generated
from harness.worlds import opening
from harness.worlds.ray_cluster import RayConf, RayUnavailable, import_ray

SIZES = (4, 48, 192, 704)
"""rl_rollout rows per chunk at seq_len 512: from tens of KiB to the 16 MiB the tables use."""
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


def _call_s(world, k: int, reps: int) -> float:
    import ray

    def once() -> float:
        t0 = time.perf_counter()
        ray.get([a.call.remote(_noop) for a in world.actors[:k]])
        return time.perf_counter() - t0

    return _median(once, reps)


def _fit(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares α, β of y = α + β·x, both clamped at 0 (a negative start-up is noise)."""
    a = np.column_stack([np.ones(len(x)), np.asarray(x, dtype=float)])
    alpha, beta = np.linalg.lstsq(a, np.asarray(y, dtype=float), rcond=None)[0]
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def measure(world, reps: int) -> dict[str, list]:
    """Every timing the fit needs: {term: [(bytes or actors, seconds), ...]}."""
    out: dict[str, list] = {k: [] for k in ("put", "put_raw", "get", "get_raw", "call")}
    for rows in SIZES:
        batch = generated.make("rl_rollout", rows, SEQ_LEN, 0, None)
        piece = chunk(batch, 1)[0]
        flat = flat_bytes(piece)
        n = int(flat.nbytes)
        out["put"].append((n, _put_s(lambda b=batch: chunk(b, 1)[0], reps)))
        out["put_raw"].append((n, _put_s(lambda f=flat: f, reps)))
        out["get"].append((n, _get_s(world, piece, reps)))
        out["get_raw"].append((n, _get_s(world, flat, reps)))
    for k in range(1, world.world_size + 1):
        out["call"].append((k, _call_s(world, k, reps)))
    return out


def fitted(points: dict[str, list]) -> dict[str, float]:
    """The RayCostConf fields (µs, GB/s) from ``measure``'s points."""
    conf: dict[str, float] = {}
    for term in ("put", "put_raw", "get", "get_raw"):
        alpha, beta = _fit(*zip(*points[term]))
        conf[f"{term}_call_us"] = round(alpha * 1e6, 1)
        conf[f"{term}_gbytes_per_s"] = round(1 / beta / 1e9, 3) if beta > 0 else 1000.0
    alpha, beta = _fit(*zip(*points["call"]))
    conf["call_us"] = round(alpha * 1e6, 1)
    conf["call_per_actor_us"] = round(beta * 1e6, 1)
    return conf


def _yaml(conf: dict[str, float], points: dict[str, list], ranks: int, secs: float,
          command: str) -> str:  # fmt: skip
    import socket

    import yaml

    lines = [
        f"# Written by `{command}`; do not edit by hand, run it again.",
        f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} on {socket.gethostname()}, local Ray world of "
        f"{ranks} actors, {len(SIZES)} sizes ({secs:.0f} s). Values measured here.",
        "# points (bytes or actors -> ms, median):",
    ]
    for term, pts in points.items():
        lines.append(f"#   {term:<8} " + "  ".join(f"{x}:{y * 1e3:.2f}" for x, y in pts))
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
    world = opening.ray_world(cfg.ranks, RayConf(num_cpus=2, object_store_mb=512))
    points = measure(world, cfg.reps)
    conf = fitted(points)
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
