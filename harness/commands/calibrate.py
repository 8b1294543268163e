"""Fit the cost model's α and β to the machine it runs on: ``bcastbench calibrate``.

A Hydra app (``conf/commands/calibrate.yaml``: ``world=4 reps=21 short=false dry_run=false
max_load=null out=conf/cluster/local.yaml``). Times broadcast, scatter and all_gather on a real gloo
world (groups of 2 and of the whole world) as one verified job of probes (``harness.job.probes``,
run by ``harness.job.execute.run_job`` as every job is: interleaved rounds, every rank checked),
host pickle/unpickle/memcpy rates, the fixed per-call host costs (pickle.dumps/loads, pack/unpack
(strategies.core.packer, unpacker) on tiny ``rl_rollout`` batches, see ``per_call_costs``), the
node-local signal of ``shm``'s channel (``signal_cost``), fits α, β per collective in the model's
own form (``formulas.coefficients``) and writes the cluster file atomically, with the world size and
core count it ran on (``calibrated_ranks``, ``cpu_cores``: the oversubscription factor's reference).

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
from dataclasses import dataclass, replace
from pathlib import Path

from harness.commands.hydra_app import run_app
from harness.job.build import for_calibration
from harness.job.execute import run_job
from harness.job.probes import ProbeShape, probe_name
from harness.machine import other_cores, other_cores_now, snapshot
from harness.model.calibration_fit import (
    ALGORITHMS,
    PER_CALL_PAYLOAD,
    Fit,
    Sample,
    best_fits,
    build_local_cluster,
    format_report,
    per_call_costs,
    signal_cost,
    write_cluster_yaml,
)
from harness.payload import generated
from harness.worlds.forked import ForkedWorld
from strategies.core.cluster import CONF_DIR, ClusterConf, load_cluster
from strategies.core.formulas import (
    ClusterError,
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
SIGNAL_PROBE_BYTES = 4096
"""The message of the signal probe: one page, so the copy is nothing next to the signal."""


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
        header = _file_header(world_size, group_sizes, len(sizes), reps, report)
        cluster = _write_preset(cluster, Path(out), header, verbose)
    return cluster, fits, samples


def _write_preset(cluster, out: Path, header: str, verbose: bool):
    """Write the fitted ``cluster`` to ``out``, keeping the stores it holds (``_kept_stores``),
    and read it back; returns what was written."""
    kept = _kept_stores(out)
    cluster = replace(cluster, stores=kept)
    if kept:  # fitted against the constants just replaced: say so where they are read
        header += ("\nStores kept from an earlier `bcastbench calibrate target=store` fit, made "
                   "against the previous constants: run it again on a pull sweep.")  # fmt: skip
        if verbose:
            print(f"{out}: stores kept from an earlier fit; run `bcastbench calibrate "
                  "target=store` again")  # fmt: skip
    write_cluster_yaml(cluster, out, header)
    load_cluster(out)  # what was written must load and validate
    if verbose:
        print(f"wrote {out}")
    return cluster


def _kept_stores(out: Path) -> dict:
    """The stores ``out`` already holds (``bcastbench calibrate target=store`` fits them from a pull
    sweep, which this command does not run): a recalibration keeps them."""
    try:
        return load_cluster(out).stores if out.is_file() else {}
    except ClusterError:  # an unreadable preset is replaced whole, as before
        return {}


@dataclass
class CalibrateConf:
    """Root config of ``conf/commands/calibrate.yaml``."""

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


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.commands.calibrate [world=4] [reps=21] [short=true] [dry_run=true] ...``"""
    return run_app(MODULE, "calibrate", task, check, argv, schema=CalibrateConf)


if __name__ == "__main__":
    sys.exit(main())
