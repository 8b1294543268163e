"""One rank of an emulated cluster's task: ``python -m harness.worlds.emulated_rank <task.pkl>``, run
by each node's torchrun agent (``harness.worlds.emulated.EmulatedWorld``).

The rank joins the world its agents started, runs the task the driver wrote, and global rank 0
writes every rank's result beside the task, atomically, for the driver to read.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

from harness.worlds.emulated import RESULTS_FILE
from harness.worlds.joined import JoinedWorld
from harness.worlds.launcher import JOINED, detect


def main(task_path: str) -> int:
    task = Path(task_path)
    # Written by this rank's own driver into its private scratch directory (0700).
    fn, args, what, timeout_s, backend, device = pickle.loads(task.read_bytes())
    launch = detect(dict(os.environ))
    if launch.kind != JOINED:
        raise SystemExit(f"harness.worlds.emulated_rank runs under torchrun only, not {launch.via}")
    world = JoinedWorld(launch, backend, device, timeout_s).start()
    try:
        results = world.run(fn, *args, what=what, timeout_s=timeout_s)
    finally:
        world.close()
    if results is not None:
        partial = task.with_name(f".{RESULTS_FILE}.{os.getpid()}")
        partial.write_bytes(pickle.dumps(results))
        os.replace(partial, task.with_name(RESULTS_FILE))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
