"""``make bench``: the default sweep (every strategy × three layouts × ~64 KiB..17 MiB on gloo
CPU), then the table, the report and the figures, and where they are.

    python -m harness.run.bench [--quick] [extra Hydra overrides...]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

import strategies
from harness import paths  # noqa: I001

REPO = paths.REPO
# rl_rollout carries ≈23 KiB per sample at seq_len 512: 3 → 69 KiB, 32 → 736 KiB,
# 128 → 2.9 MiB, 768 → 17.3 MiB.
SEQ_LEN = 512
BATCH_SIZES = (3, 32, 128, 768)
# One with PP, one with CP, one with DP > 1; layouts outermost so each world starts once.
LAYOUTS = ("tp2pp2", "tp2cp2", "tp2pp2dp2")
ITERS, WARMUP = 8, 2


def sweep_overrides(quick: bool = False) -> list[str]:
    sizes = BATCH_SIZES[:2] if quick else BATCH_SIZES
    return [
        f"layout={','.join(LAYOUTS[:1] if quick else LAYOUTS)}",
        f"strategy={','.join(strategies.names())}",
        f"payload.batch_size={','.join(map(str, sizes))}",
        f"payload.seq_len={SEQ_LEN}",
        f"iters={3 if quick else ITERS}",
        f"warmup={1 if quick else WARMUP}",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one layout, two sizes, few iterations")
    ap.add_argument("--out", help="sweep directory (default results/bench/<timestamp>)")
    args, extra = ap.parse_known_args(argv)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(args.out) if args.out else REPO / "results" / "bench" / stamp
    cmd = [
        sys.executable, "-m", "harness", "-m", *sweep_overrides(args.quick), *extra,
        f"hydra.sweep.dir={out}",
    ]  # fmt: skip
    print("bcastbench bench:", " ".join(cmd[1:]), flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, cwd=REPO)
    sweep_s = time.monotonic() - t0
    if rc != 0:
        print(
            f"bcastbench bench: the sweep failed (exit {rc}); records so far: {out}",
            file=sys.stderr,
        )
        return rc
    try:
        from harness.report import build as report
    except ImportError:
        report = None
    if report is not None:
        report.main([str(out)])
    print(f"\nbcastbench bench: sweep took {sweep_s:.0f} s; results in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
