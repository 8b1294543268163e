"""A bare gloo world (``torch.multiprocessing`` spawn, one ``init_process_group``, nothing else)
timing one broadcast of N bytes the way the harness times its floor: the yardstick for the
harness's own overhead (``test_bench_bare.py``).

Each rank, per iteration: a barrier, a fresh receive buffer and one broadcast from rank 0,
timed on every rank; an iteration's latency is the max over ranks (as in the harness). The
world stays up between requests, so a benchmark can alternate it with the harness's world.

    python tests/benchmarks/bare_world.py 6039552     # p50 in µs, 4 ranks, 20 iterations
"""

from __future__ import annotations

import datetime
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, conn) -> None:
    torch.set_num_threads(1)  # as the harness's ranks
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    conn.send("ready")
    while (request := conn.recv()) is not None:
        nbytes, iters, warmup = request
        sent = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8) if rank == 0 else None
        times = []
        for it in range(warmup + iters):
            dist.barrier()
            t0 = time.perf_counter()
            buf = sent if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
            dist.broadcast(buf, src=0)
            if it >= warmup:
                times.append(time.perf_counter() - t0)
        conn.send(times)
    dist.destroy_process_group()


class BareWorld:
    """``world`` spawned ranks that time broadcasts on request; a context manager."""

    def __init__(self, world: int = 4) -> None:
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(world)]
        port = _free_port()
        self.conns = [parent for parent, _ in pipes]
        self.procs = [
            ctx.Process(target=_rank, args=(r, world, port, child), daemon=True)
            for r, (_, child) in enumerate(pipes)
        ]
        for p in self.procs:
            p.start()
        # Spawned ranks import torch for seconds: wait, so nothing timed meanwhile pays for it.
        for r, c in enumerate(self.conns):
            if not c.poll(300) or c.recv() != "ready":
                self.close()
                raise TimeoutError(f"bare world: rank {r} did not start within 300 s")

    def p50_us(self, nbytes: int, iters: int = 20, warmup: int = 3) -> float:
        """p50 (µs, max over ranks per iteration) of one broadcast of ``nbytes``."""
        for c in self.conns:
            c.send((nbytes, iters, warmup))
        per_rank = []
        for r, c in enumerate(self.conns):
            if not c.poll(300):
                raise TimeoutError(f"bare world: rank {r} did not answer within 300 s")
            per_rank.append(c.recv())
        return float(np.percentile(np.asarray(per_rank).max(axis=0), 50)) * 1e6

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> BareWorld:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    with BareWorld() as bare:
        print(f"{bare.p50_us(int(sys.argv[1]) if len(sys.argv) > 1 else 6 << 20):.0f}")
