"""Run a config-shaped command (``predict``, ``calibrate``, ``run target=dispatch``, ...) as a
Hydra app from an argv, configured by ``conf/commands/<name>.yaml``.

``run_app`` composes every job a command line asks for (a ``-m`` sweep expanded in full) and
checks each one before the first job starts, so a bad override or value prints one line naming
the field and what is valid and exits 2, with no traceback; only then does Hydra run the jobs
(its output directories, multirun, ``--cfg``, ``--help``). Errors the job itself raises for a
bad value are reported the same way.

A command's YAML lives in ``conf/commands/`` (named as its module, ``harness.commands.<name>``)
rather than at the top of ``conf/``, where only the job's ``config.yaml`` and the groups are;
each starts ``# @package _global_`` and names conf/'s groups with a leading ``/``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from harness import paths
from harness.errors import ConfigError, program, usage_error
from strategies.core.formulas import ClusterError
from strategies.core.layout import LayoutError

PASSTHROUGH = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve"}
"""Hydra's own flags: a command line with one of them is shown, not checked or run."""

COMMANDS = "commands"
"""The folder of ``conf/`` that holds each command's YAML."""


def config_name(name: str) -> str:
    """Hydra's name of command ``name``'s config: ``commands/<name>``, the file
    ``conf/commands/<name>.yaml``."""
    return f"{COMMANDS}/{name}"


def user_errors() -> tuple[type[BaseException], ...]:
    """What a bad override or value raises (as opposed to a bug, which keeps its traceback)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (HydraException, OmegaConfBaseException, ClusterError, ConfigError, LayoutError)


def fail(prog: str, exc: BaseException) -> None:
    """Print the one line and leave with ``harness.errors.USAGE_EXIT``."""
    raise SystemExit(usage_error(prog, exc))


def _job_overrides(argv: list[str]) -> list[list[str]]:
    """Every job's overrides: ``-m`` sweeps expanded, Hydra's own options left out."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in argv if not a.startswith("-") and not a.startswith("hydra")]
    parsed = OverridesParser.create().parse_overrides(overrides)
    if not any(o.is_sweep_override() for o in parsed):
        return [overrides]
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def compose(name: str, overrides: list[str]) -> Any:
    """Command ``name``'s config with ``overrides`` (Hydra's compose, no app)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(paths.CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name(name), overrides=list(overrides))


def check_all(name: str, argv: list[str], check: Callable[[Any], None]) -> int:
    """Compose and ``check`` every job of ``argv`` on command ``name``'s config; the number of
    jobs."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    jobs = _job_overrides(argv)
    with initialize_config_dir(config_dir=str(paths.CONF_DIR), version_base="1.3"):
        for overrides in jobs:
            check(hydra_compose(config_name=config_name(name), overrides=overrides))
    return len(jobs)


def store_schema(name: str, schema: type) -> None:
    """``schema`` in Hydra's ConfigStore as ``<name>_schema``, the name
    ``conf/commands/<name>.yaml`` lists first in its defaults (as ``/<name>_schema``)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=f"{name}_schema", node=schema)


def run_app(
    module: str,
    name: str,
    task: Callable[[Any], Any],
    check: Callable[[Any], None],
    argv: list[str] | None,
    schema: type | None = None,
) -> int:
    """``<module> [overrides...]`` as a Hydra app on ``conf/commands/<name>.yaml``: check every
    job, then run ``task`` on each; messages name the program as it was called
    (``harness.errors.program``). ``schema``: the structured config that YAML names as
    ``<name>_schema``."""
    import hydra

    if schema is not None:
        store_schema(name, schema)
    prog = program(module)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not PASSTHROUGH & set(argv):
        try:
            check_all(name, argv, check)
        except user_errors() as exc:
            fail(prog, exc)

    def guarded(cfg) -> Any:
        try:
            return task(cfg)
        except user_errors() as exc:
            fail(prog, exc)

    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        hydra.main(
            version_base="1.3", config_path=str(paths.CONF_DIR), config_name=config_name(name)
        )(guarded)()
    finally:
        sys.argv = saved
    return 0
