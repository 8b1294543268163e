"""``make gpu-check``: the CUDA paths on a single-GPU machine with no network, in one command.

(a) every strategy end to end with NCCL on a world of 1 (CUDA payload, verification on the
GPU); (b) a gloo world of 4 ranks sharing the GPU with CUDA tensors: pickled, header, flat, direct
against the floor at ~64 KiB and ~64 MiB, where pickling CUDA tensors (device→host→device)
shows. Records go under results/gpu/<timestamp>/; a table is printed. Without a GPU it says
so and exits 0. Missing packages install offline from ./wheels (``make gpu-wheels``).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from harness import paths  # noqa: I001

REPO = paths.REPO
NEEDED = ("hydra", "omegaconf", "megatron.core", "tensordict")


def _missing() -> list[str]:
    out = []
    for mod in NEEDED:
        try:
            if importlib.util.find_spec(mod) is None:
                out.append(mod)
        except ModuleNotFoundError:
            out.append(mod)
    return out


def _install_offline(env: dict) -> None:
    wheels = sorted((REPO / "wheels").glob("*.whl"))
    if not wheels:
        sys.exit(f"gpu-check: missing {_missing()} and no wheels in {REPO / 'wheels'}; run "
                 "`make gpu-wheels` on a machine with network access first")  # fmt: skip
    target = Path("/tmp/bcastbench-site")
    subprocess.check_call(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--upgrade", "--target", str(target), *map(str, wheels)]
    )  # fmt: skip
    env["PYTHONPATH"] = f"{target}:{env.get('PYTHONPATH', '')}"


def main() -> int:
    try:
        import torch
    except ImportError:
        print("gpu-check: torch is not installed; nothing to check")
        return 0
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; skipping (exit 0)")
        return 0
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    if _missing():
        _install_offline(env)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = REPO / "results" / "gpu" / stamp
    py = [sys.executable, "-m", "harness", "-m"]
    names = subprocess.check_output(
        [sys.executable, "-c", "import strategies; print(','.join(strategies.names()))"],
        cwd=REPO, env=env, text=True,
    ).strip()  # fmt: skip
    runs = [
        # (a) NCCL, world of 1: the CUDA code path of every strategy runs and is verified.
        [*py, f"strategy={names}", "backend=nccl", "layout.pp=1", "layout.tp=1",
         "iters=5", "warmup=1", f"hydra.sweep.dir={out}/nccl_world1"],
        # (b) gloo, 4 ranks sharing the GPU, CUDA tensors: ~64 KiB and ~64 MiB.
        [*py, "strategy=pickled,header,flat,direct", "backend=gloo_cuda", "layout=tp2pp2",
         "payload.seq_len=512", "payload.batch_size=3,2880", "iters=10", "warmup=2",
         f"hydra.sweep.dir={out}/gloo_cuda_world4"],
    ]  # fmt: skip
    rc = 0
    for cmd in runs:
        print("gpu-check:", " ".join(cmd[1:]), flush=True)
        rc |= subprocess.call(cmd, cwd=REPO, env=env)
    print(f"gpu-check: records under {out}; exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
