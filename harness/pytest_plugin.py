"""bcastbench's pytest plugin (entry point ``pytest11``): gate a strategy in your own CI.

Fixtures:
- ``bcastbench_mode``: ``--bcastbench-mode=short|full`` as iterations, warm-up and rounds.
- ``bcastbench_world``: ``bcastbench_world(n)`` returns a running gloo world of ``n`` forked
  ranks, started once per session and size (restarted if a failed job tore it down).
- ``bcastbench_job``: ``bcastbench_job(strategy=..., layout="tp2pp2", payload="rl_rollout",
  batch_size=8, seq_len=512, options={...})`` runs one interleaved, verified job (the strategy,
  the floor and ``pickled`` in the same rounds) and returns its summary, with the same-run
  ratios ``vs_floor`` and ``vs_baseline``. ``strategy`` is a registered name (built-in or from
  the ``bcastbench.strategies`` entry point) or a dotted ``package.module.Class``.

A job's summary plugs into pytest-benchmark: ``benchmark.pedantic(lambda: bcastbench_job(...),
rounds=bcastbench_mode.rounds)``, then assert on the ratios, never on absolute times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class Mode:
    name: str
    iters: int
    """Timed, interleaved iterations per job (strategy, floor and pickled each)."""
    warmup: int
    """Untimed iterations per strategy first."""
    rounds: int
    """Jobs a gate should take the median over."""


MODES = {"short": Mode("short", 8, 1, 3), "full": Mode("full", 30, 3, 7)}


def pytest_addoption(parser) -> None:
    group = parser.getgroup("bcastbench")
    group.addoption(
        "--bcastbench-mode",
        choices=sorted(MODES),
        default="short",
        help="bcastbench job length: short (CI) or full (numbers worth keeping)",
    )


@pytest.fixture(scope="session")
def bcastbench_mode(request) -> Mode:
    return MODES[request.config.getoption("--bcastbench-mode")]


@pytest.fixture(scope="session")
def bcastbench_world():
    """A factory: ``bcastbench_world(n)`` is a running gloo world of n ranks (one per n)."""
    import torch

    from harness.run.world import World

    # Worlds fork this process: keep it single-threaded, or a fork after an OpenMP region can
    # deadlock a rank.
    torch.set_num_threads(1)
    worlds: dict[int, World] = {}

    def world_of(n: int) -> World:
        world = worlds.get(n)
        if world is not None and not world.alive:
            world.close(kill=True)
            world = None
        if world is None:
            world = worlds[n] = World(n).start()
        return world

    try:
        yield world_of
    finally:
        for world in worlds.values():
            world.close(kill=not world.alive)


def layout_named(layout: Any):
    """A ``Layout`` from a conf/layout name (``"tp2pp2"``), a dict of fields, or a Layout."""
    import yaml

    from harness.paths import CONF_DIR
    from strategies.core.layout import Layout

    if isinstance(layout, Layout):
        return layout
    if isinstance(layout, dict):
        return Layout(**layout)
    path = CONF_DIR / "layout" / f"{layout}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONF_DIR / "layout").glob("*.yaml"))
        raise ValueError(f"unknown layout {layout!r}; valid names: {known}")
    return Layout(**yaml.safe_load(path.read_text()))


@pytest.fixture
def bcastbench_job(bcastbench_world, bcastbench_mode):
    """A function running one verified job and returning its summary (see module docstring)."""
    import strategies
    from harness.run.runner import JobSpec, run_job_on_rank, summarize

    def job(strategy: str, layout: Any = "tp2pp2", options: dict | None = None, **spec) -> dict:
        options = dict(options or {})
        strategies.check_options(strategy, options)  # one line before any rank runs
        the_layout = layout_named(layout)
        spec.setdefault("seq_len", 512)
        spec.setdefault("iters", bcastbench_mode.iters)
        spec.setdefault("warmup", bcastbench_mode.warmup)
        job_spec = JobSpec(strategy, the_layout, options=options, **spec)
        world = bcastbench_world(the_layout.world_size)
        results = world.run(run_job_on_rank, job_spec, what=f"{strategy} job")
        return _flat(strategy, summarize(job_spec, results))

    return job


def _flat(strategy: str, summary: dict) -> dict:
    """The strategy's own figures at the top level, with the references' p50 and ratios."""
    if "unsupported" in summary:
        pytest.skip(f"{strategy} refuses this layout: {summary['unsupported']}")
    per = summary["strategies"]
    mine = dict(per[strategy])
    # The floor is the fastest raw method timed in the job (runner.best_floor), as records say.
    floor_us, baseline = summary.get("floor_p50_us"), per.get("pickled")
    mine["strategy"] = strategy
    mine["payload_bytes"] = summary["payload_bytes"]
    if floor_us:
        mine["floor_p50_us"] = floor_us
        mine["floor_method"] = summary.get("floor_method")
        mine["vs_floor"] = mine["p50_us"] / floor_us
    if baseline is not None:
        mine["baseline_p50_us"] = baseline["p50_us"]
        mine["vs_baseline"] = mine["p50_us"] / baseline["p50_us"]
    mine["strategies"] = per
    return mine
