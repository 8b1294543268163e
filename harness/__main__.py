"""``python -m harness`` / ``bcastbench``: one job, or a Hydra multirun sweep (-m)."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
import warnings

from harness import paths  # noqa: I001

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron.*")
logging.getLogger("megatron").setLevel(logging.WARNING)  # its import-time INFO lines are noise

import hydra  # noqa: E402

from harness.run.config import ConfigError, register  # noqa: E402

CONF = str(paths.CONF_DIR)


@hydra.main(version_base="1.3", config_path=CONF, config_name="config")
def _task(cfg):
    from harness.run import app
    from harness.run.world import WorldError

    try:
        return app.run(cfg)
    except (ConfigError, WorldError) as exc:
        # A clear one-paragraph message instead of a stack through Hydra's internals.
        print(f"bcastbench: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise


def _torchrun_rank() -> int | None:
    if "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "MASTER_ADDR" in os.environ
    ):
        return int(os.environ.get("RANK", 0))
    return None


def _prompt_slurm_failures() -> None:
    """submitit polls sacct with a back-off of up to 10 min (SlurmJob.watcher), so a job whose
    rank crashed can sit unnoticed for minutes; poll at least every BCASTBENCH_SLURM_POLL_S
    (default 10 s) instead, so a failed sweep fails within seconds."""
    try:
        from submitit.slurm import slurm
    except ImportError:
        return
    slurm.SlurmJob.watcher._delay_s = float(os.environ.get("BCASTBENCH_SLURM_POLL_S", "10"))


def main() -> None:
    register()
    if any("hydra/launcher=" in arg for arg in sys.argv):
        _prompt_slurm_failures()
    rank = _torchrun_rank()
    if rank:
        # Under torchrun every rank runs this app; only rank 0 owns the output directory.
        scratch = tempfile.mkdtemp(prefix=f"bcastbench-rank{rank}-")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        sys.argv += [
            f"hydra.run.dir={scratch}",
            "hydra.output_subdir=null",
            "hydra/job_logging=none",
        ]
    _task()


if __name__ == "__main__":
    main()
