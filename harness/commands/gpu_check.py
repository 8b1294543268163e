"""``bcastbench bench target=gpu`` (``make gpu-check``): the CUDA paths on a single-GPU machine
with no network, in one command.

Two named sweeps (config, in ``conf/sweep/``): ``gpu_check_nccl``, every strategy end to end
with NCCL on a world of 1 (CUDA payload, verification on the GPU); ``gpu_check_gloo_cuda``, a
gloo world of 4 ranks sharing the GPU with CUDA tensors: pickled, header, flat, direct, shm
(staged through host shared memory) and auto against the floor at two sizes, where pickling
CUDA tensors (device→host→device) shows. They are two
files because their products differ (backend, layout, strategies and sizes all change
together). Records go under results/gpu/<timestamp>/; a table is printed. Without a GPU it says
so and exits 0. Missing packages install offline from ./wheels (``make gpu-wheels``).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from harness import paths

REPO = paths.REPO
NEEDED = ("hydra", "omegaconf", "megatron.core", "tensordict")
SWEEPS = ("gpu_check_nccl", "gpu_check_gloo_cuda")


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


def main(argv: list[str] | None = None) -> int:
    try:
        import torch
    except ImportError:
        print("gpu-check: torch is not installed; nothing to check")
        return 0
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible; skipping (exit 0)")
        return 0
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    if _missing():
        _install_offline(env)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = REPO / "results" / "gpu" / stamp
    rc = 0
    for sweep in SWEEPS:
        cmd = [sys.executable, "-m", "harness", "run", "-m", f"sweep={sweep}", *(argv or []),
               f"hydra.sweep.dir={out / sweep}"]  # fmt: skip
        print("gpu-check:", " ".join(cmd[1:]), flush=True)
        rc |= subprocess.call(cmd, cwd=REPO, env=env)
    print(f"gpu-check: records under {out}; exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
