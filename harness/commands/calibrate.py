"""Fit the cost model's α and β to the machine it runs on: ``python -m harness.commands.calibrate``.

A Hydra app (``conf/calibrate.yaml``: ``world=4 reps=21 short=false dry_run=false max_load=null
out=conf/cluster/local.yaml``). Times broadcast, scatter and all_gather on a real gloo world
(groups of 2 and of the whole world) as one verified job of probes (``harness.job.probes``, run
by ``harness.job.execute.run_job`` as every job is: interleaved rounds, every rank checked), host pickle/unpickle/memcpy rates, the fixed per-call host
costs (pickle.dumps/loads, pack/unpack (strategies.core.packer, unpacker) on tiny ``rl_rollout`` batches, see
``per_call_costs``), the node-local signal of ``shm``'s channel (``signal_cost``), fits α, β per collective in the model's own form
(``formulas.coefficients``) and writes the cluster file atomically, with the world size and core
count it ran on (``calibrated_ranks``, ``cpu_cores``: the oversubscription factor's reference).

Run it on a quiet machine: every figure includes whatever else shares the cores. ``max_load=N``
refuses to start while other work uses more than N cores (harness.machine, from /proc/stat;
the load average can be meaningless in a VM), and the report warns when other work took > 0.5
cores during the run.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.commands.hydra_app import run_app
from harness.files import write_atomic
from harness.job.build import for_calibration
from harness.job.execute import run_job
from harness.job.probes import ProbeShape, probe_name
from harness.machine import other_cores, other_cores_now, snapshot
from harness.payload import generated
from harness.worlds.forked import ForkedWorld
from strategies.core.cluster import CONF_DIR, GB, US, ClusterConf, LinkConf, load_cluster
from strategies.core.formulas import (
    ALLGATHER_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    SCATTER_ALGORITHMS,
    ClusterError,
    coefficients,
)
from strategies.core.header_format import DEFAULT_MAX_BYTES, read_header
from strategies.core.layout import Layout
from strategies.core.node_channel import NodeChannel
from strategies.core.node_signals import available as shm_available
from strategies.core.packer import pack
from strategies.core.unpacker import unpack

MODULE = "harness.commands.calibrate"
"""Where this command lives; its printed name comes from ``harness.errors.program``."""

KIB = 1024
DEFAULT_SIZES = tuple(KIB * 4**i for i in range(8))  # 1 KiB .. 16 MiB
SHORT_SIZES = tuple(KIB * 4**i for i in range(6))  # 1 KiB .. 1 MiB
ALGORITHMS = {
    "broadcast": ("broadcast_algorithm", BROADCAST_ALGORITHMS),
    "scatter": ("scatter_algorithm", SCATTER_ALGORITHMS),
    "all_gather": ("allgather_algorithm", ALLGATHER_ALGORITHMS),
}
# One machine: every rank is on the same "node", so nothing is ever priced on `inter`.
LOCAL_GPUS_PER_NODE = 1024
SIGNAL_PROBE_BYTES = 4096
"""The message of the signal probe: one page, so the copy is nothing next to the signal."""
# Per-call host costs: the sweep's payload at its smallest sizes, where the bytes cost little
# and the fixed part (Python, per-leaf pickling, header encode/decode) dominates.
PER_CALL_PAYLOAD = ("rl_rollout", (1, 2, 3), 512)


@dataclass(frozen=True)
class Sample:
    """Median over iterations of the max over ranks, for one collective shape."""

    kind: str
    group_size: int
    payload_bytes: int
    """nccl-tests S: broadcast bytes; scatter/all_gather total bytes over the group."""
    nbytes: int
    """``Comm.nbytes`` convention (scatter: one chunk)."""
    p50_s: float


@dataclass(frozen=True)
class Fit:
    kind: str
    algorithm: str
    link: LinkConf
    r2: float
    max_rel_err: float
    rms_rel_err: float


# --------------------------------------------------------------------------------------------
# What runs on each rank
# --------------------------------------------------------------------------------------------
def _time_host(ctx, nbytes, reps):
    """pickle.dumps / loads and memcpy rates (and device copies where CUDA is available),
    measured on rank 0 while the others wait."""
    import torch
    import torch.distributed as dist

    out = None
    if ctx.rank == 0:
        out = _host_rates(nbytes, reps)
        if torch.cuda.is_available():
            out.update(_device_rates(nbytes, reps))
    dist.barrier()
    return out


def _host_rates(nbytes: int, reps: int) -> dict[str, float]:
    import pickle

    import torch
    from tensordict import TensorDict

    # A batch-like TensorDict: a few tensors of mixed dtypes, as the pickled strategy sends.
    n_elem = nbytes // 16
    batch = TensorDict(
        {
            "input_ids": torch.arange(n_elem, dtype=torch.int64),
            "attention_mask": torch.ones(n_elem, dtype=torch.int32),
            "position_ids": torch.arange(n_elem, dtype=torch.int32),
        },
        batch_size=[],
    )
    dumps, loads, copies = [], [], []
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    for it in range(reps + 1):  # iteration 0 warms up
        t0 = time.perf_counter()
        blob = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        t1 = time.perf_counter()
        pickle.loads(blob)
        t2 = time.perf_counter()
        dst.copy_(src)
        t3 = time.perf_counter()
        if it:
            dumps.append(len(blob) / (t1 - t0))
            loads.append(len(blob) / (t2 - t1))
            copies.append(nbytes / (t3 - t2))
    return dict(
        pickle_bytes_per_s=statistics.median(dumps),
        unpickle_bytes_per_s=statistics.median(loads),
        memcpy_bytes_per_s=statistics.median(copies),
    )


def _device_rates(nbytes: int, reps: int) -> dict[str, float]:
    """Device→host, host→device (pinned) and device→device copy rates, bytes/s."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copies = {"d2h": (host, dev), "h2d": (dev, host), "device_copy": (dev, src_dev)}
    rates: dict[str, list[float]] = {name: [] for name in copies}
    for it in range(reps + 1):
        for name, (to, frm) in copies.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            to.copy_(frm)
            torch.cuda.synchronize()
            if it:
                rates[name].append(nbytes / (time.perf_counter() - t0))
    return {f"{name}_bytes_per_s": statistics.median(v) for name, v in rates.items()}


def _time_per_call(ctx, reps):
    """Fixed per-call host costs, timed inside the calibration world the way strategies call
    them (so under the same sharing of the cores as the collectives' α and β): per tiny
    ``PER_CALL_PAYLOAD`` batch, the leader validates + packs (``packer.pack``, non-tensor data
    included), broadcasts, every receiver decodes the header and unpacks; then the leader
    pickles the TensorDict, broadcasts it, every receiver unpickles it. Returns, per rank,
    ``{kind: [(seconds, bytes, blob_bytes), ...]}`` (bytes: what the model charges by size)."""
    import torch.distributed as dist

    name, sizes, seq_len = PER_CALL_PAYLOAD
    batches = [generated.make(name, b, seq_len, 0) for b in sizes]
    out: dict[str, list] = {"pack": [], "unpack": [], "pickle": [], "unpickle": []}
    bufs: dict[int, object] = {}
    caches: dict[int, dict] = {i: {} for i in range(len(batches))}  # steady state: hits
    for it in range(reps + 1):  # iteration 0 warms up
        ctx.report(f"calibrate: per-call costs, iteration {it}")
        for i, dp in enumerate(batches):
            samples = (_pack_round(ctx.rank, dp, i, bufs, caches[i]), _pickle_round(ctx.rank, dp))
            if it:
                for kind, *sample in samples:
                    out[kind].append(tuple(sample))
    dist.barrier()
    return out


def _pack_round(rank: int, dp, i: int, bufs: dict, cache: dict) -> tuple:
    """One pack → broadcast → unpack of ``dp``: ``(kind, seconds, bytes, non-tensor bytes)``."""
    import torch
    import torch.distributed as dist

    nt = dp.non_tensor_batch if dp.broadcast_non_tensor else None
    _, header = pack(dp.batch, nt)  # sizes every rank knows
    total = header.total_bytes
    nt_bytes = header.non_tensor[1] if header.non_tensor else 0
    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        dp.validate(0)
        buf, _ = pack(dp.batch, nt, out=bufs.get(i))
        dt = time.perf_counter() - t0
        bufs[i] = buf
        dist.broadcast(buf[:total], src=0)
        return ("pack", dt, total, nt_bytes)
    got = torch.empty(total, dtype=torch.uint8)
    dist.broadcast(got, src=0)
    t0 = time.perf_counter()
    unpack(got, read_header(got, DEFAULT_MAX_BYTES, rank, cache))
    return ("unpack", time.perf_counter() - t0, 0, nt_bytes)


def _pickle_round(rank: int, dp) -> tuple:
    """One pickle → broadcast → unpickle of ``dp.batch``: ``(kind, seconds, bytes, 0)``."""
    import pickle

    import torch
    import torch.distributed as dist

    blob_len = len(pickle.dumps(dp.batch))
    dist.barrier()
    size = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        t0 = time.perf_counter()
        blob = pickle.dumps(dp.batch)
        dt = time.perf_counter() - t0
        size[0] = len(blob)
        dist.broadcast(size, src=0)
        dist.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), src=0)
        return ("pickle", dt, len(blob), 0)
    dist.broadcast(size, src=0)
    got = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.broadcast(got, src=0)
    t0 = time.perf_counter()
    pickle.loads(got.numpy().tobytes())
    return ("unpickle", time.perf_counter() - t0, blob_len, 0)


def _time_signals(ctx, reps):
    """One node-local signal of ``shm``'s channel (``strategies.core.node_channel``) per iteration:
    the whole world is one replica on one node, rank 0 writes a one-page message into its
    segment and signals every other rank, which maps it and lets it go. Returns this rank's
    seconds per iteration, from a common barrier to the signal sent (writer) or the message
    mapped (reader)."""
    import torch.distributed as dist

    groups = ctx.groups_for(Layout(tp=ctx.world_size))
    channel = NodeChannel(groups)
    out = []
    try:
        ctx.report("calibrate: shared-memory signals, connecting")
        channel.connect()
        warm = len(channel.slots)  # the ring's turns: each of its segments is made and sent once
        for it in range(reps + warm):
            dist.barrier()
            t0 = time.perf_counter()
            if channel.is_node_leader:
                slot = channel.writer_slot()
                slot.buffer(SIGNAL_PROBE_BYTES)
                channel.publish(slot, SIGNAL_PROBE_BYTES)
            else:
                view = channel.receive()
                del view  # mapped, then released as its last tensor dies
            if it >= warm:
                out.append(time.perf_counter() - t0)
        dist.barrier()
    finally:
        channel.close()
    return out


def signal_cost(per_rank: list[list[float]]) -> dict[str, float]:
    """Seconds of one signal: per iteration the last rank to hold the message (max over
    ranks), median over iterations, divided by the readers the writer signalled in turn."""
    per_iter = [max(ts) for ts in zip(*per_rank)]
    readers = max(len(per_rank) - 1, 1)
    return {"signal_s": statistics.median(per_iter) / readers} if per_iter else {}


def per_call_costs(per_rank: list[dict], rates: dict[str, float]) -> dict[str, float]:
    """Fixed seconds per call: each timed call minus what ``rates`` charge for its bytes
    (memcpy for the packed message and pickle for its non-tensor blob; unpickle for a received
    blob), median over ranks, sizes and repetitions, clamped at 0."""
    charge = {
        "pack": lambda n, nt: n / rates["memcpy_bytes_per_s"] + nt / rates["pickle_bytes_per_s"],
        "unpack": lambda n, nt: nt / rates["unpickle_bytes_per_s"],
        "pickle": lambda n, nt: n / rates["pickle_bytes_per_s"],
        "unpickle": lambda n, nt: n / rates["unpickle_bytes_per_s"],
    }
    out = {}
    for kind, cost in charge.items():
        fixed = [t - cost(n, nt) for r in per_rank for t, n, nt in r.get(kind, ())]
        out[f"{kind}_call_s"] = max(0.0, statistics.median(fixed)) if fixed else 0.0
    return out


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------
def probe_names(group_sizes, sizes) -> list[str]:
    """Every collective the calibration times: each kind, group size and byte count."""
    return [probe_name(k, p, size) for p in group_sizes for size in sizes for k in ALGORITHMS]


def samples_from(record: dict, world_size: int) -> list[Sample]:
    """The calibration job's probes as samples: each one's p50 over calls, a call ending when
    the last rank holds the data (the record's figures: max over ranks, median over calls)."""
    p50_us = {record["strategy"]: record["p50_us"]}
    p50_us.update((name, ref["p50_us"]) for name, ref in record["references"].items())
    out = []
    for name, us in p50_us.items():
        shape = ProbeShape.parse(name, world_size)
        nbytes = shape.chunk_bytes if shape.kind == "scatter" else shape.payload_bytes
        out.append(Sample(shape.kind, shape.group_size, shape.payload_bytes, nbytes, us / 1e6))
    return out


def fit_kind(samples: list[Sample], kind: str, algorithm: str) -> Fit:
    """Least squares of t = a·α + b·β in relative error (every size counts, not just the big
    ones), with α, β ≥ 0."""
    param = ALGORITHMS[kind][0]
    rows = [s for s in samples if s.kind == kind]
    coef = np.array(
        [coefficients(kind, s.group_size, s.nbytes, **{param: algorithm}) for s in rows]
    )
    t = np.array([s.p50_s for s in rows])
    weighted = coef / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(weighted, np.ones_like(t), rcond=None)
    if alpha < 0:  # a burst or cache effect can pull α below zero; refit bandwidth alone
        alpha = 0.0
        beta = float(np.sum(weighted[:, 1]) / np.sum(weighted[:, 1] ** 2))
    if beta <= 0:
        beta = 1e-15
        alpha = float(np.sum(weighted[:, 0]) / np.sum(weighted[:, 0] ** 2))
    pred = coef @ np.array([alpha, beta])
    rel = (pred - t) / t
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2)) or 1.0
    return Fit(
        kind,
        algorithm,
        LinkConf.from_si(float(alpha), float(beta)),
        r2=1 - ss_res / ss_tot,
        max_rel_err=float(np.max(np.abs(rel))),
        rms_rel_err=float(np.sqrt(np.mean(rel**2))),
    )


def best_fits(samples: list[Sample]) -> dict[str, Fit]:
    """Per collective, the algorithm form whose fit has the lowest RMS relative error."""
    out = {}
    for kind, (_, algorithms) in ALGORITHMS.items():
        fits = [fit_kind(samples, kind, a) for a in algorithms]
        out[kind] = min(fits, key=lambda f: f.rms_rel_err)
    return out


def build_local_cluster(
    fits: dict[str, Fit], host: dict[str, float], world_size: int = 0, cpu_cores: int = 0
) -> ClusterConf:
    """The ``local`` cluster the fits and host rates (SI, as measured) describe."""
    by_kind = {kind: f.link for kind, f in fits.items()}
    memcpy = host["memcpy_bytes_per_s"]
    return ClusterConf(
        name="local",
        gpus_per_node=LOCAL_GPUS_PER_NODE,
        nics_per_node=1,
        intra=by_kind["broadcast"],
        inter=by_kind["broadcast"],  # never used: one machine is one node
        broadcast_algorithm=fits["broadcast"].algorithm,
        scatter_algorithm=fits["scatter"].algorithm,
        allgather_algorithm=fits["all_gather"].algorithm,
        intra_by_kind=by_kind,
        inter_by_kind={},
        d2h_gbytes_per_s=host.get("d2h_bytes_per_s", memcpy) / GB,
        h2d_gbytes_per_s=host.get("h2d_bytes_per_s", memcpy) / GB,
        pickle_gbytes_per_s=host["pickle_bytes_per_s"] / GB,
        unpickle_gbytes_per_s=host["unpickle_bytes_per_s"] / GB,
        memcpy_gbytes_per_s=memcpy / GB,
        device_copy_gbytes_per_s=host.get("device_copy_bytes_per_s", 0.0) / GB,
        **{
            f"{k}_call_us": host.get(f"{k}_call_s", 0.0) / US
            for k in ("pickle", "unpickle", "pack", "unpack")
        },  # fmt: skip
        signal_us=host.get("signal_s", 0.0) / US,
        # A CPU world time-slices the machine's cores; a GPU world does not (factor off).
        cpu_cores=0 if "device_copy_bytes_per_s" in host else cpu_cores,
        calibrated_ranks=world_size,
    )


def write_cluster_yaml(cluster: ClusterConf, path: Path, header: str) -> None:
    """The cluster as YAML under ``header`` (as comments), written atomically: a crash never
    leaves half a file where the harness reads its presets."""
    from omegaconf import OmegaConf

    def rounded(node):  # 4 significant digits: the fit is not better than that
        if isinstance(node, float) and node < 1e-3 and node != 0:
            return float(f"{node:.3e}")
        if isinstance(node, dict):
            return {k: rounded(v) for k, v in node.items()}
        return float(f"{node:.4g}") if isinstance(node, float) else node

    cfg = OmegaConf.to_container(OmegaConf.structured(cluster))
    text = OmegaConf.to_yaml(OmegaConf.create(rounded(cfg)))
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    write_atomic(path, comment + text)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def _refuse_when_busy(max_load: float | None) -> None:

    if max_load is None:
        return
    other = other_cores_now(1.0)
    if other is not None and other > max_load:
        raise SystemExit(
            f"other work uses {other:.1f} cores > max_load {max_load:g}: it shares the "
            "cores and every figure would include it; try again when the machine is quiet"
        )


def _measure(world, group_sizes, sizes, reps: int, host_bytes: int):
    """The collectives' job record (every probe verified on every rank) and the host figures
    (rates and per-call costs)."""
    spec = for_calibration(world.world_size, probe_names(group_sizes, sizes), reps)
    record = run_job(world, spec)
    host = world.run(_time_host, host_bytes, max(3, reps // 2), what="host rates")[0]
    calls = world.run(_time_per_call, max(10, reps), what="per-call host costs")
    host.update(per_call_costs(calls, host))
    if shm_available() is None:  # a machine without memfd prices shm's signals free
        signals = world.run(_time_signals, max(10, reps), what="shared-memory signals")
        host.update(signal_cost(signals))
    return record, host


def _file_header(world_size: int, group_sizes, n_sizes: int, reps: int, report: str) -> str:
    return (
        "Written by `bcastbench calibrate` (python -m harness.commands.calibrate); do not edit by "
        "hand, run it again.\n"
        f"{datetime.datetime.now().isoformat(timespec='seconds')} on "
        f"{platform.node()} ({os.cpu_count()} cores), gloo world of {world_size}, "
        f"groups {list(group_sizes)}, {n_sizes} sizes, median of {reps}.\n"
        "Values measured on that machine, not public figures; every rank is on one node.\n\n"
        + report
    )


def calibrate(
    world_size: int = 4,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    reps: int = 21,
    out: Path | None = CONF_DIR / "local.yaml",
    host_bytes: int = 16 * 2**20,
    world=None,
    verbose: bool = True,
    max_load: float | None = None,
) -> tuple[ClusterConf, dict[str, Fit], list[Sample]]:
    """Measure, fit, and (unless ``out`` is None) write the ``local`` cluster file.
    ``max_load``: refuse to start while other work uses more than this many cores (measured
    from /proc/stat over one second, see harness.machine)."""
    if world_size < 2:
        raise ClusterError(f"world: calibration needs at least 2 ranks, got {world_size}")
    t0 = time.perf_counter()
    _refuse_when_busy(max_load)
    start = snapshot()
    group_sizes = tuple(sorted({min(2, world_size), world_size}))
    own = world is None
    world = world or ForkedWorld(world_size).start()
    try:
        record, host = _measure(world, group_sizes, sizes, reps, host_bytes)
    finally:
        if own:
            world.close()
    samples = samples_from(record, world_size)
    fits = best_fits(samples)
    cluster = build_local_cluster(fits, host, world_size, os.cpu_count() or 1)
    report = format_report(fits, samples, host, world_size, time.perf_counter() - t0)
    # A world passed in is still running: its ranks' CPU would read as other work.
    other = other_cores(start) if own else None
    if other is not None and other > 0.5:  # other jobs shared the cores: figures are pessimistic
        report += (
            f"\nWARNING: other work used {other:.1f} of {os.cpu_count()} cores meanwhile; "
            "rerun when idle."
        )
    if verbose:
        print(report)
    if out is not None:
        write_cluster_yaml(cluster, Path(out), _file_header(world_size, group_sizes, len(sizes),
                                                            reps, report))  # fmt: skip
        load_cluster(Path(out))  # what was written must load and validate
        if verbose:
            print(f"wrote {out}")
    return cluster, fits, samples


def format_report(
    fits: dict[str, Fit], samples: list[Sample], host: dict, world_size: int, elapsed_s: float
) -> str:
    lines = [f"fit per collective (world {world_size}, {elapsed_s:.1f} s):"]
    for kind, f in fits.items():
        lines.append(
            f"  {kind:<10} {f.algorithm:<18} alpha {f.link.alpha_s * 1e6:8.1f} us  "
            f"bw {f.link.bandwidth_gbytes_per_s:6.3f} GB/s  R2 {f.r2:.4f}  "
            f"max rel err {100 * f.max_rel_err:5.1f}%  rms {100 * f.rms_rel_err:5.1f}%"
        )
    lines.append("measured p50 vs model (ms):")
    for s in samples:
        f = fits[s.kind]
        param = ALGORITHMS[s.kind][0]
        a, b = coefficients(s.kind, s.group_size, s.nbytes, **{param: f.algorithm})
        pred = a * f.link.alpha_s + b * f.link.beta_s_per_byte
        lines.append(
            f"  {s.kind:<10} p={s.group_size} S={s.payload_bytes:>9} B  "
            f"measured {s.p50_s * 1e3:8.3f}  model {pred * 1e3:8.3f}  "
            f"({100 * (pred - s.p50_s) / s.p50_s:+5.1f}%)"
        )
    lines.append(
        "host: "
        + ", ".join(
            f"{k.replace('_bytes_per_s', '')} {v / 1e9:.3f} GB/s"
            for k, v in host.items()
            if k.endswith("_bytes_per_s")
        )
    )
    calls = {k: v for k, v in host.items() if k.endswith("_call_s")}
    if calls:
        name, sizes, seq_len = PER_CALL_PAYLOAD
        lines.append(
            f"per call ({name} B={list(sizes)} seq {seq_len}, bytes subtracted): "
            + ", ".join(f"{k.removesuffix('_call_s')} {v * 1e6:.0f} us" for k, v in calls.items())
        )
    if "signal_s" in host:
        lines.append(
            f"shared memory: {host['signal_s'] * 1e6:.1f} us per node-local rank signalled "
            f"(writer + {world_size - 1} readers, last reader's p50 over the readers)"
        )
    return "\n".join(lines)


@dataclass
class CalibrateConf:
    """Root config of ``conf/calibrate.yaml``."""

    world: int = 4
    """Ranks in the gloo world (>= 2); recorded as ``calibrated_ranks``."""
    reps: int = 21
    """Timed iterations per shape (the median is kept)."""
    short: bool = False
    """Sizes up to 1 MiB only and a 2 MiB host buffer (tests, quick looks)."""
    dry_run: bool = False
    """Print the fit, write nothing."""
    max_load: float | None = None
    """Refuse to start while other work uses more than this many cores (/proc/stat)."""
    out: str | None = None
    """Cluster file to write; null: the ``local`` preset, ``conf/cluster/local.yaml``."""


def check(cfg) -> None:
    if cfg.world < 2:
        raise ClusterError(f"world must be >= 2 (a broadcast needs two ranks), got {cfg.world}")
    if cfg.reps < 1:
        raise ClusterError(f"reps must be >= 1, got {cfg.reps}")
    if cfg.max_load is not None and cfg.max_load < 0:
        raise ClusterError(f"max_load must be >= 0 cores or null, got {cfg.max_load}")
    if cfg.out is not None and Path(cfg.out).suffix not in (".yaml", ".yml"):
        raise ClusterError(f"out must name a .yaml file, got {cfg.out!r}")


def task(cfg) -> None:
    calibrate(
        world_size=cfg.world,
        sizes=SHORT_SIZES if cfg.short else DEFAULT_SIZES,
        reps=cfg.reps,
        out=None if cfg.dry_run else Path(cfg.out or CONF_DIR / "local.yaml"),
        host_bytes=(2 if cfg.short else 16) * 2**20,
        max_load=cfg.max_load,
    )


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="calibrate_schema", node=CalibrateConf)


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.commands.calibrate [world=4] [reps=21] [short=true] [dry_run=true] ...``"""
    register()
    return run_app(MODULE, "calibrate", task, check, argv)


if __name__ == "__main__":
    sys.exit(main())
