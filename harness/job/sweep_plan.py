"""Every job of a sweep, composed and checked before the first one starts.

Hydra composes a job's config only when the job starts, so a sweep whose 40th combination is
invalid would run 39 jobs first. ``check_sweep`` expands the sweep the way Hydra's basic
sweeper will (its ``params`` from ``conf/sweep/*`` and the command line's ``a=1,2`` lists,
``glob(...)`` over config groups included), composes every combination, then checks each with
the validator it is handed (``harness.job.config.validate``); the first bad one raises
``ConfigError`` naming the job, its overrides and what is wrong. Composing first and importing
nothing heavy itself, it refuses a mistyped key before the job's modules (torch) load.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from harness import paths
from harness.errors import ConfigError, one_line
from harness.job.config_schema import register
from harness.payload.sizes import sizes_for


def describe(exc: BaseException) -> str:
    """An error from composing or checking a config, as one line."""
    return one_line(exc)


def _jobs(loader, master, overrides: list[str]) -> list[list[str]]:
    """Each job's overrides, in the order the basic sweeper launches them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (master.hydra.sweeper.get("params") or {}).items()]
    task = [o for o in overrides if not o.split("=", 1)[0].lstrip("~+").startswith("hydra")]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(params + task)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


@contextmanager
def _expanded(overrides: list[str], config_name: str):
    """(config loader, master config, every job's overrides) of a ``-m`` command line."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    register()
    try:
        with initialize_config_dir(config_dir=str(paths.CONF_DIR), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            master = loader.load_configuration(config_name, overrides, RunMode.MULTIRUN)
            yield loader, master, _jobs(loader, master, overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(f"the sweep's config: {describe(exc)}") from None


def sweep_jobs(overrides: list[str], config_name: str = "config") -> list[list[str]]:
    """Every job's overrides, as the sweep will launch them (nothing composed per job)."""
    with _expanded(overrides, config_name) as (_, _, jobs):
        return jobs


def sweep_dir(overrides: list[str], config_name: str = "config") -> Path:
    """The directory the sweep ``-m overrides`` writes to, resolved now (a ``${now:}`` in it
    is fixed here: the caller hands the result back to Hydra as ``hydra.sweep.dir``)."""
    with _expanded(overrides, config_name) as (_, master, _):
        try:
            return Path(str(master.hydra.sweep.dir))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"hydra.sweep.dir: {describe(exc)}") from None


RANKS_EXPONENT = 0.75
"""A job's share of its sweep's time grows as its ranks to this power (``job_weight``): on this
2-core host ``make bench``'s cells of 4 ranks took about 1.9× those of 2, its cells of 8 about
2.7× (2026-12-07): more than the square root, less than linear."""


def job_weight(cfg) -> float:
    """How long a job of config ``cfg`` takes beside the sweep's others, for the progress
    line's ETA (``harness.report.progress``): its ranks to ``RANKS_EXPONENT``."""
    # Here, not at the top: a mistyped key is refused before the config's strategies (torch).
    from harness.job.config import layout_of

    return float(layout_of(cfg).world_size) ** RANKS_EXPONENT


def check_sweep(
    overrides: list[str], validate: Callable[[], Callable], config_name: str = "config"
) -> list[float]:
    """Compose every job ``-m overrides`` makes, then check each with the validator
    ``validate()`` returns (asked for only once every job composed); each job's ``job_weight``,
    in the order the sweep runs them (their count is the sweep's)."""
    with _expanded(overrides, config_name) as (loader, master, jobs):
        configs = []
        compose = _Composer(loader, master)
        for index, job in enumerate(jobs):
            where = f"job {index + 1} of {len(jobs)} ({' '.join(job)})"
            try:
                configs.append((where, compose(job)))
            except (HydraException, OmegaConfBaseException) as exc:
                raise ConfigError(f"{where}: {describe(exc)}; no job was started") from None
        check = validate()
        for where, cfg in configs:
            try:
                check(cfg)
            except (ConfigError, HydraException, OmegaConfBaseException) as exc:
                raise ConfigError(f"{where}: {describe(exc)}; no job was started") from None
        return [job_weight(cfg) for _, cfg in configs]


class _Composer:
    """A sweep job's config, as Hydra's ``load_sweep_config`` composes it when the job starts,
    for every job of one sweep. Hydra composes each job from its files again (reading and
    parsing every YAML file of its defaults); jobs that choose the same config groups share
    their defaults, so here each choice of groups is composed once and a job's value
    overrides are applied to a copy with Hydra's own ``_apply_overrides_to_config``, after the
    groups, as Hydra applies them. An override is a group's where Hydra takes it for one
    (``hydra._internal.defaults_list.Overrides``: its key names a config group and its value
    is not a dict)."""

    def __init__(self, loader, master) -> None:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.override_parser.overrides_parser import OverridesParser

        self.loader, self.master = loader, master
        self.parser = OverridesParser.create(config_loader=loader)
        self.apply = ConfigLoaderImpl._apply_overrides_to_config
        self.composed: dict[tuple[str, ...], object] = {}

    def __call__(self, job: list[str]):
        parsed = self.parser.parse_overrides(job)
        groups = tuple(o.input_line for o in parsed if self._is_group(o))
        values = [o for o in parsed if not self._is_group(o)]
        base = self.composed.get(groups)
        if base is None:
            base = self.composed[groups] = self.loader.load_sweep_config(self.master, list(groups))
        cfg = copy.deepcopy(base)
        self.apply(values, cfg)
        return cfg

    def _is_group(self, override) -> bool:
        return not isinstance(override.value(), dict) and self.loader.repository.group_exists(
            override.key_or_group
        )


SIZE_RANGE = re.compile(r"^payload\.batch_size=sizes\((?P<args>[^)]*)\)$")
"""``payload.batch_size=sizes(64K,16M,4)``: nccl-tests' ``-b 64K -e 16M -f 4`` on the command
line."""


def expand_size_ranges(argv: list[str], config_name: str = "config") -> list[str]:
    """``argv`` with a ``payload.batch_size=sizes(BEGIN,END,FACTOR)`` override made the list of
    batch sizes whose payload is nearest each of BEGIN, BEGIN·FACTOR, ... END bytes, for the
    payload and seq_len the rest of the command line composes to (one job per size under
    ``-m``). Anything else is left as it is; a bad range raises ConfigError."""
    hits = [a for a in argv if SIZE_RANGE.match(a)]
    if not hits:
        return argv
    rest = [a for a in argv if a not in hits and not a.startswith("-")]
    with _expanded(rest, config_name) as (_, master, jobs):
        payloads = {(str(master.payload.name), int(master.payload.seq_len))}
        if len(jobs) > 1 and any(o.startswith(("payload=", "payload.seq_len=")) for j in jobs
                                 for o in j):  # fmt: skip
            raise ConfigError("sizes(...) needs one payload and one seq_len in the sweep")
    ((name, seq_len),) = payloads
    args = [x.strip() for x in SIZE_RANGE.match(hits[-1]).group("args").split(",")]
    try:
        rows = sizes_for(name, seq_len, *args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"payload.batch_size=sizes(BEGIN,END,FACTOR): {exc}") from None
    size = f"payload.batch_size={','.join(map(str, rows))}"
    return [size if a in hits else a for a in argv if a not in hits[:-1]]
