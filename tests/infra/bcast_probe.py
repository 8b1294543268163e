"""Tiny torchrun worker for the infrastructure smoke test: broadcast N MiB from rank 0 to a group
of ranks (default {0, 2}, i.e. across the node link) and print one JSON line with the timings.

Run under torchrun (env:// rendezvous). Env: GLOO_SOCKET_IFNAME as usual, or
BCB_IFNAME_PATTERN (e.g. ``eth{local_rank}``) for one link per rank; BCB_NODE, if set, is the
node this process was started on and is checked against the rank's block placement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=16.0)
    ap.add_argument(
        "--group",
        default="0,2",
        help="comma-separated ranks, the first is the root; ';' separates disjoint groups that "
        "broadcast at the same time",
    )
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    pattern = os.environ.get("BCB_IFNAME_PATTERN")
    if pattern:
        # torchrun gives all local workers one environment; rails need one interface per rank.
        os.environ["GLOO_SOCKET_IFNAME"] = pattern.format(local_rank=int(os.environ["LOCAL_RANK"]))

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    node = os.environ.get("BCB_NODE")
    if node is not None and rank // local_world != int(node):
        raise SystemExit(f"rank {rank} landed on node {node}, expected {rank // local_world}")

    # Several disjoint groups ("0,2;1,3") broadcast at once: what two rails carry together.
    groups = [[int(r) for r in g.split(",")] for g in args.group.split(";")]
    if len({r for g in groups for r in g}) != sum(len(g) for g in groups):
        raise SystemExit(f"--group {args.group!r}: concurrent groups must be disjoint")
    made = [dist.new_group(g) for g in groups]  # every rank takes part in creating each group
    mine = next(((g, pg) for g, pg in zip(groups, made) if rank in g), None)
    numel = int(args.mib * 2**20) // 4
    seconds: list[float] = []
    buf = torch.empty(numel, dtype=torch.float32)
    for _ in range(args.repeats):
        if mine is not None and rank == mine[0][0]:
            buf.copy_(torch.arange(numel, dtype=torch.float32))
        else:
            buf.zero_()
        dist.barrier()
        t0 = time.perf_counter()
        if mine is not None:
            dist.broadcast(buf, src=mine[0][0], group=mine[1])
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        # The slowest rank defines the time (a root may return early).
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds.append(float(elapsed))
        if mine is not None and not torch.equal(buf[-8:], torch.arange(numel - 8, numel).float()):
            raise SystemExit(f"rank {rank}: broadcast delivered wrong data")
    if rank == 0:
        nbytes = numel * 4
        med = statistics.median(seconds)
        print(
            "BCAST_PROBE "
            + json.dumps(
                {
                    "bytes": nbytes,
                    "group": groups[0] if len(groups) == 1 else groups,
                    "world": world,
                    "seconds": seconds,
                    "median_s": med,
                    "mbit_s": nbytes * 8 / med / 1e6,
                    # Contention only ever slows a shaped link down: the best repeat is
                    # the robust estimate of its rate on a busy 2-core machine.
                    "best_mbit_s": nbytes * 8 / min(seconds) / 1e6,
                    "aggregate_best_mbit_s": len(groups) * nbytes * 8 / min(seconds) / 1e6,
                }
            ),
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
