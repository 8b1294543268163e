"""``bcastbench``: one command, a subcommand per job to be done.

    bcastbench run [Hydra overrides]       one job, or a sweep with -m (also `python -m harness`)
    bcastbench bench [--quick]             the named bench sweep (conf/sweep/bench.yaml), then
                                           the report
    bcastbench predict|calibrate|extrapolate [overrides]   the cost model's Hydra apps
    bcastbench ray-dispatch|ray-emulated [overrides]       Ray dispatch, measured
    bcastbench ray-calibrate|ray-model [overrides]         Ray dispatch's cost model
    bcastbench emulated-table [overrides]                  the emulated-cluster table
    bcastbench report|collect|validate DIR                 read a run or sweep directory
    bcastbench store-calibrate DIR         fit the pull stores' costs from a pull sweep
    bcastbench compare OLD NEW             two runs cell by cell (new/old, interval, verdict)
    bcastbench gpu-check                   the CUDA checks on a single-GPU machine

Every ``[overrides]`` subcommand is a Hydra app configured through ``conf/<name>.yaml``
(``ray-dispatch`` reads ``conf/ray_dispatch.yaml``), sweeps with ``-m``, and shows its config
with ``--cfg job``.

Arguments that do not start with a subcommand's name go to ``run``, so ``bcastbench
strategy=flat`` and ``python -m harness strategy=flat`` are the same job. Every subcommand
module exposes ``main(argv) -> int``; this file only dispatches, by module name, so that
``bcastbench --help`` imports none of them (nor torch).

A bad config, name or value prints one line naming the field and what is valid and exits 2
(no traceback); a failed job exits 1 with its error; Ctrl-C prints where the records written so
far are and exits 130 (``harness.commands.run``).
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "run": (
        "harness.commands.run",
        "one job, or a sweep with -m (Hydra overrides; `run --help` shows the config)",
    ),
    "bench": ("harness.commands.bench", "the bench sweep (conf/sweep/bench.yaml), then its report"),
    "predict": ("harness.commands.predict", "predict every strategy's time on a cluster"),
    "calibrate": ("harness.commands.calibrate", "fit the cost model to this cluster"),
    "extrapolate": ("harness.commands.extrapolate", "predicted latency from 8 to 16k GPUs"),
    "store-calibrate": (
        "harness.commands.store_calibrate",
        "DIR: fit the pull stores' put/get costs into a cluster preset",
    ),
    "schema": (
        "harness.payload.schema_command",
        "FILE -o schema.yaml: a recorded batch's shape, no data",
    ),
    "report": ("harness.commands.report", "DIR: report.md and figures of a run or sweep"),
    "collect": ("harness.report.collect", "DIR: one CSV row per job of a run or sweep"),
    "validate": ("harness.commands.validate", "DIR: the cost model against a measured sweep"),
    "compare": (
        "harness.commands.compare",
        "OLD NEW: two runs cell by cell, new/old with a 95 % interval and a verdict",
    ),
    "emulated-table": (
        "harness.commands.emulated_table",
        "strategies on both emulated link layouts vs the model (conf/emulated_table.yaml)",
    ),
    "ray-dispatch": (
        "harness.commands.ray_dispatch",
        "Ray dispatch modes side by side on a Ray world (conf/ray_dispatch.yaml)",
    ),
    "ray-emulated": (
        "harness.commands.ray_emulated",
        "Ray dispatch across emulated nodes, root (conf/ray_emulated.yaml)",
    ),
    "ray-calibrate": (
        "harness.commands.ray_calibrate",
        "fit Ray's put/get/call costs into conf/ray/ (conf/ray_calibrate.yaml)",
    ),
    "ray-model": (
        "harness.commands.ray_model",
        "the Ray dispatch model: task=example | task=validate (conf/ray_model.yaml)",
    ),
    "gpu-check": ("harness.commands.gpu_check", "the CUDA checks on a single-GPU machine"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return (
        "usage: bcastbench <subcommand> [args...]   (no subcommand: run)\n\n"
        "subcommands:\n" + "\n".join(lines) + "\n\n`bcastbench <subcommand> --help` for each."
    )


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default: the command line) to a subcommand; its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if argv and argv[0] in SUBCOMMANDS:
        name, argv = argv[0], argv[1:]
    else:
        name = "run"
    module, _ = SUBCOMMANDS[name]
    # Hydra apps read sys.argv, and the commands name themselves from it; a caller that
    # dispatches in process (a test, a notebook) gets its own argv back afterwards.
    saved = sys.argv
    try:
        if name != "run":  # the job app sets its own argv (the program ``bcastbench``)
            sys.argv = [f"bcastbench {name}", *argv]
        status = importlib.import_module(module).main(argv)
        # A command that hands back what it made (records, a fit) has succeeded.
        return status if isinstance(status, int) else 0
    finally:
        sys.argv = saved
