"""``bcastbench run`` (and ``bcastbench`` with no verb): the Hydra job app, one job or a
``-m`` sweep, its endings turned into exit statuses.

A bad config, name or value prints one line naming the field and what is valid and exits 2
(no traceback); a failed job exits 1 with its error; Ctrl-C prints where the records written so
far are and exits 130.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from harness import paths
from harness.commands.hydra_app import PASSTHROUGH
from harness.errors import ConfigError, usage_error
from harness.job import config_schema
from harness.job.config_schema import BenchConf, register
from harness.job.sweep_lock import claim, release
from harness.job.sweep_plan import check_sweep, expand_size_ranges, sweep_dir
from harness.megatron_import import quiet_megatron
from harness.report.sweep_state import STATE
from harness.worlds import launcher
from harness.worlds.protocol import JOB_FAILURES

FAILED_EXIT, INTERRUPTED_EXIT = 1, 130


def _job():
    """The job's app (``harness.job.app``), imported once the config composed: it brings torch,
    megatron-core and tensordict, which a mistyped key or a ``--help`` must not wait for (every
    import above is light)."""
    from harness.job import app

    return app


def _nothing_written_by_other_ranks(argv: list[str]) -> list[str]:
    """Under torchrun every rank runs this command; only global rank 0 owns the output
    directory. The others write nothing anywhere: no saved config, no log file, and as their
    run directory the temporary directory itself, which exists (a directory made for them was
    left behind whenever torchrun killed the rank before its exit handlers ran)."""
    here = launcher.current()
    if here.kind != launcher.JOINED or here.via != "torchrun" or here.writes_records:
        return argv
    nowhere = _quoted(tempfile.gettempdir())
    return [*argv, f"hydra.run.dir={nowhere}", "hydra.output_subdir=null", "hydra/job_logging=none"]


HYDRA_MODES = {
    "-r": "--run", "--run": "--run", "-m": "--multirun", "--multirun": "--multirun",
    "-c": "--cfg", "--cfg": "--cfg", "-i": "--info", "--info": "--info",
    "-sc": "--shell-completion", "--shell-completion": "--shell-completion",
}  # fmt: skip
"""Hydra's mutually exclusive modes, by every spelling of their flag."""


def _modes_clash(argv: list[str]) -> str | None:
    """What is wrong when ``argv`` asks Hydra for more than one mode (it would raise a bare
    ValueError with its stack), else None."""
    given = sorted(
        {HYDRA_MODES[a.split("=", 1)[0]] for a in argv if a.split("=", 1)[0] in HYDRA_MODES}
    )
    if len(given) < 2:
        return None
    return (
        f"{' and '.join(given)} given together; a command runs one of --run, --multirun, "
        "--cfg, --info, --shell-completion (one job's config: drop -m and add --cfg job)"
    )


def run(argv: list[str]) -> int:
    """``bcastbench run``: the Hydra job app, with errors turned into one line and an exit
    status (``HYDRA_FULL_ERROR`` makes Hydra hand its exceptions to us instead of printing
    them with a stack)."""
    clash = _modes_clash(argv)
    if clash is not None:
        return usage_error("bcastbench", ValueError(clash))
    quiet_megatron()

    register()
    try:
        argv = expand_size_ranges(argv)
    except ConfigError as exc:
        return _exit_status(exc)
    if any("hydra/launcher=" in arg for arg in argv):
        try:
            launcher.prompt_slurm_failures()
        except ConfigError as exc:
            return _exit_status(exc)
    if "--check" in argv:
        return _check_only([a for a in argv if a != "--check"])
    config_schema.COMMAND[:] = ["bcastbench", *argv]  # what the records say made them
    sys.argv = ["bcastbench", *_nothing_written_by_other_ranks(argv)]
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        root = _claim_sweep(argv)
    except ConfigError as exc:
        return _exit_status(exc)
    decorated = hydra.main(
        version_base="1.3", config_path=str(paths.CONF_DIR), config_name="config"
    )
    logger = logging.getLogger()
    found = (logger.level, list(logger.handlers))
    try:
        return _run_app(decorated)
    finally:
        _hand_back_logging(*found)
        if root is not None:
            release(root)


def _claim_sweep(argv: list[str]) -> Path | None:
    """A ``-m`` sweep: every job checked, the progress total set and the sweep directory
    claimed (and handed to Hydra as ``hydra.sweep.dir``); None for a single run."""
    if not {"-m", "--multirun"} & set(argv) or PASSTHROUGH & set(argv):
        return None
    overrides = [a for a in argv if not a.startswith("-")]
    STATE.weights = check_sweep(overrides, lambda: _job().validate)
    STATE.total = len(STATE.weights)
    # Claimed before Hydra starts (it ignores what its callbacks raise), and handed back
    # resolved so Hydra writes exactly where the claim is; under torchrun only the rank that
    # writes records owns it.
    if not launcher.current().writes_records:
        return None
    root = claim(sweep_dir(overrides))
    sys.argv.append(f"hydra.sweep.dir={_quoted(str(root))}")
    return root


def _check_only(argv: list[str]) -> int:
    """``run --check``: compose and validate every job the command line makes (a ``-m`` sweep
    in full, as before a real sweep), print how many, start none; a bad config exits 2 with its
    usual one line. A single run composes as Hydra's run mode does (``a=1,2`` needs ``-m``)."""
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        if {"-m", "--multirun"} & set(argv):
            jobs = len(check_sweep(overrides, lambda: _job().validate))
        else:
            with hydra.initialize_config_dir(str(paths.CONF_DIR), version_base="1.3"):
                config = hydra.compose("config", overrides)
            _job().validate(config)
            jobs = 1
    except (ConfigError, HydraException, OmegaConfBaseException) as exc:
        return _exit_status(exc)
    print(f"bcastbench: {jobs} job{'s' if jobs != 1 else ''} checked; none started")
    return 0


def _hand_back_logging(level: int, handlers: list[logging.Handler]) -> None:
    """Hydra points the root logger at the job's log file; a command run in process (a
    notebook, a test) hands the root logger back as it found it, so later lines do not go to a
    run directory that may since have been removed."""
    logger = logging.getLogger()
    for handler in list(logger.handlers):
        if handler not in handlers:
            logger.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in logger.handlers:
            logger.addHandler(handler)
    logger.setLevel(level)


def _table_of_done_jobs() -> None:
    """After Ctrl-C, the sweep's table of the records written so far: a job's record is written
    before its end's callback writes the table, and Ctrl-C may fall between the two."""
    if STATE.records is None or not Path(STATE.records).is_dir():
        return
    # Deferred: the table needs pandas, which a command refused at config time never loads.
    from harness.report.progress import SweepTable

    try:
        SweepTable().write(Path(STATE.records))
    except Exception as exc:  # noqa: BLE001 -- the interrupt's own line still follows
        print(f"bcastbench: no results.csv after the interrupt: {exc}", file=sys.stderr)


def _run_app(decorated) -> int:
    """Hydra's app, its endings sorted into exit statuses."""
    try:
        decorated(task)()
    except SystemExit as exc:  # --help, or a job's one-line config error
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except KeyboardInterrupt:
        launcher.close_ray(
            kill=True
        )  # a Ray world's ranks may be mid-job: no clean leave to wait for
        _table_of_done_jobs()
        print(
            f"\nbcastbench: interrupted; records written so far: {STATE.records}", file=sys.stderr
        )
        return INTERRUPTED_EXIT
    except BaseException as exc:  # noqa: BLE001 - sorted into user errors, failures and bugs
        return _exit_status(exc)
    if STATE.failed:
        print(
            f"bcastbench: {STATE.failed} of {STATE.done} jobs failed; their records say why "
            f"(status, error): {STATE.records}",
            file=sys.stderr,
        )
        return FAILED_EXIT
    return 0


def _quoted(value: str) -> str:
    """``value`` as one Hydra override value, whatever characters a path holds."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def task(cfg):
    """The Hydra task (module level, so a submitit launcher pickles it by reference)."""
    try:
        return _job().run(cfg)
    except ConfigError as exc:
        _remove_unused_run_dir()
        # Leaves through Hydra's job runner as SystemExit, which it does not report.
        raise SystemExit(_exit_status(exc)) from None
    except Exception:
        if launcher.current().kind == launcher.JOINED:
            _end_joined_rank()
        raise


def _end_joined_rank() -> None:
    """A rank of a launcher's world whose job raised ends its process non-zero, at once.

    Hydra's sweep runner turns a job's exception into its return value, so under a multirun
    (a submitit job on Slurm) the task ended 0: Slurm's kill-on-bad-exit never fired and the
    other ranks waited in their collectives until the job's time limit. A non-zero exit
    lets the launcher end the step; the other ranks' collectives with this one fail at once
    (their peer is gone), and a rank that waits anyway names itself after ``timeout_s``."""
    here = launcher.current()
    print(f"bcastbench: rank {here.rank} of a {here.via} world: the job failed; this rank "
          f"exits so the launcher ends the others\n{traceback.format_exc()}",
          file=sys.stderr, flush=True)  # fmt: skip
    logging.shutdown()
    os._exit(FAILED_EXIT)


HYDRA_LEFTOVERS = {".hydra", "bcastbench.log"}
"""What Hydra puts in a run folder before the task starts."""


def _remove_unused_run_dir() -> None:
    """A single run refused by validation leaves no folder behind: Hydra made the run folder
    (its .hydra/ and an empty log) before the task started. Removed only when it holds
    nothing else and the log is empty, so a folder the user named and filled stays."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return
    out = Path(hydra_cfg.runtime.output_dir)
    try:
        entries = {p.name for p in out.iterdir()}
        log = out / "bcastbench.log"
        if not entries <= HYDRA_LEFTOVERS or (log.exists() and log.stat().st_size > 0):
            return
        shutil.rmtree(out / ".hydra", ignore_errors=True)
        log.unlink(missing_ok=True)
        out.rmdir()
        for parent in (out.parent, out.parent.parent):  # results/runs, results, if we made them
            if parent.name in ("runs", "results") and not any(parent.iterdir()):
                parent.rmdir()
    except OSError:
        pass  # a folder that cannot be tidied is left as it is


def _valid_keys(exc: BaseException) -> str:
    """For an override of a key the schema lacks, the keys its node does have."""
    missing = (ConfigKeyError, ConfigAttributeError)
    cause = exc if isinstance(exc, missing) else exc.__cause__
    key = getattr(cause, "full_key", None) if isinstance(cause, missing) else None
    if not key:
        return ""
    parent = key.rpartition(".")[0]
    root = OmegaConf.structured(BenchConf)
    node = OmegaConf.select(root, parent) if parent else root
    if not isinstance(node, DictConfig):
        return ""
    if not node:  # an open dict (strategy.options): any key, added with Hydra's +
        return f"; {parent} has no keys yet: add one with +{key}=<value>"
    return f"; valid keys: {', '.join(node)}"


def _exit_status(exc: BaseException) -> int:
    """One line for a bad config (2), the error for a failed job (1); a bug keeps its stack."""
    if isinstance(exc, ConfigError | HydraException | OmegaConfBaseException):
        return usage_error("bcastbench", exc, _valid_keys(exc))
    if isinstance(exc, JOB_FAILURES):
        print(f"bcastbench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return FAILED_EXIT
    if _is_launched_job_failure(exc):
        head = " ".join(str(exc).split("Error stream produced:")[0].split())
        print(f"bcastbench: a job's tasks failed ({head}); each task's log is beside its "
              "result file", file=sys.stderr)  # fmt: skip
        return FAILED_EXIT
    raise exc


def _is_launched_job_failure(exc: BaseException) -> bool:
    """submitit's word that a job's tasks ended without a result (a rank exited non-zero):
    a failed job, said in one line, not a bug's stack. Matched by name: submitit is the
    optional ``slurm`` extra."""
    kind = type(exc)
    return kind.__name__ == "UncompletedJobError" and kind.__module__.startswith("submitit")


def main(argv: list[str] | None = None) -> int:
    """``bcastbench run [overrides]``: the job app's exit status."""
    return run(list(sys.argv[1:] if argv is None else argv))
