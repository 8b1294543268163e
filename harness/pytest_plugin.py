"""bcastbench's pytest plugin (entry point ``pytest11``): gate a strategy in your own CI.

Fixtures:
- ``bcastbench_gate``: ``bcastbench_gate(strategy=..., layout="tp2pp2", payload="rl_rollout",
  batch_size=8, seq_len=512, options={...})`` runs ``bcastbench_mode.rounds`` verified jobs as
  pytest-benchmark's rounds and returns a ``Gate``: the medians over rounds of the strategy's
  per-call p50 and of the same-run ratios ``vs_floor`` and ``vs_baseline``. pytest-benchmark's
  table then shows the strategy's p50 per call (one value per round), not a job's wall time,
  and ``benchmark.extra_info`` carries the ratios.
- ``bcastbench_job``: the same arguments; one interleaved, verified job (the strategy, every
  floor method and ``pickled`` in the same rounds), its summary as a dict with ``vs_floor`` and
  ``vs_baseline``. ``strategy`` is a registered name (built-in or from the
  ``bcastbench.strategies`` entry point) or a dotted ``package.module.Class``.
- ``bcastbench_world``: ``bcastbench_world(n)`` returns a running gloo world of ``n`` forked
  ranks, started once per session and size (restarted if a failed job tore it down).
- ``bcastbench_mode``: ``--bcastbench-mode=short|full`` as iterations, warm-up and rounds.

After the tests, a terminal section lists every test that ran jobs: the strategy's p50 per call,
the floor, ``vs_floor`` and ``vs_baseline`` (medians over its jobs), the figures a gate asserts
on; assert on the ratios, never on absolute times.

The harness is imported inside the fixtures, not at the top: pytest loads this plugin into every
session of every project that installs bcastbench, and a session that asks for no fixture here
should not pay for torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness.paths import CONF_DIR


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

    from harness.worlds.launcher import forked_spec, open_world  # lean: module docstring
    from harness.worlds.protocol import REGISTRY  # lean: module docstring

    # Worlds fork this process: keep it single-threaded, or a fork after an OpenMP region can
    # deadlock a rank.
    torch.set_num_threads(1)
    used: set[tuple] = set()

    def world_of(n: int):
        spec = forked_spec(n)
        used.add(spec.reuse_key)
        return open_world(spec)  # the registry's live world of n, or a fresh one

    try:
        yield world_of
    finally:
        for key in used:
            REGISTRY.close(key)


def layout_named(layout: Any):
    """A ``Layout`` from a conf/layout name (``"tp2pp2"``), a dict of fields, or a Layout."""
    import yaml

    from strategies.core.layout import Layout  # lean: module docstring

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
def bcastbench_job(request, bcastbench_world, bcastbench_mode):
    """A function running one verified job and returning its summary (see module docstring).
    Every summary is also kept for the terminal section under this test's name."""
    import strategies  # lean: module docstring
    from harness.job.broadcast import (
        JobSpec,
        run_job_on_rank,
        summarize,
    )  # lean: module docstring

    def job(strategy: str, layout: Any = "tp2pp2", options: dict | None = None, **spec) -> dict:
        options = dict(options or {})
        strategies.check_options(strategy, options)  # one line before any rank runs
        the_layout = layout_named(layout)
        spec.setdefault("seq_len", 512)
        spec.setdefault("iters", bcastbench_mode.iters)
        spec.setdefault("warmup", bcastbench_mode.warmup)
        if spec.get("payload_path"):  # as every rank can open it (a schema by its bare name)
            from harness.payload.source import path_of  # lean: module docstring

            spec["payload_path"] = path_of(spec.get("payload", ""), spec["payload_path"])
        job_spec = JobSpec(strategy, the_layout, options=options, **spec)
        _check_recorded(job_spec)
        world = bcastbench_world(the_layout.world_size)
        results = world.run(run_job_on_rank, job_spec, what=f"{strategy} job")
        summary = _flat(strategy, summarize(job_spec, results))
        summary["layout"] = layout if isinstance(layout, str) else _layout_text(the_layout)
        summary["payload"] = job_spec.payload
        record_job(request, summary)
        return summary

    return job


def _check_recorded(spec) -> None:
    """A recorded payload (payload="file" | "schema", payload_path=...) is read once here, by
    the loader every command uses, so a bad or unsafe file fails the test with its one-line
    reason before any rank starts (as ``bcastbench run`` refuses it before any rank); a
    generated one is priced against the same limit."""
    from harness.errors import ConfigError
    from harness.job.config import check_size, per_leader  # lean: module docstring
    from harness.payload import (
        payload_schema,  # lean: module docstring
        recording,  # lean: module docstring
        source,  # lean: module docstring
    )

    if spec.payload not in source.RECORDED:
        shapes = per_leader(spec.distinct_shapes(), spec.seq_len)
        try:  # priced from its shapes, as bcastbench run prices it, before any rank allocates
            check_size(spec.payload, shapes, spec.payload_max_bytes)
        except (ConfigError, KeyError) as exc:
            raise ValueError(str(exc).strip("'\"")) from None
        return
    if not spec.payload_path:
        raise ValueError(f'payload="{spec.payload}" needs payload_path=<file>')
    try:
        source.make(
            spec.payload, spec.batch_size, spec.seq_len, spec.seed, None, spec.payload_path,
            spec.payload_trust, spec.payload_max_bytes,
        )  # fmt: skip
    except (recording.PayloadFileError, payload_schema.SchemaError) as exc:
        raise ValueError(str(exc)) from None


def _layout_text(layout) -> str:
    from harness.job.records import layout_name  # lean: module docstring

    return layout_name(layout)


# -- the gate: pytest-benchmark rounds whose time is the strategy's per-call p50 --------------
@dataclass(frozen=True)
class Gate:
    """What ``bcastbench_gate`` measured: medians over its rounds, one interleaved job each."""

    strategy: str
    p50_us: float
    """The strategy's p50 per call (max over ranks, barrier before each call), median over
    rounds: what pytest-benchmark's table shows, one value per round."""
    floor_p50_us: float | None
    """The floor's p50 (the fastest raw method of each job), median over rounds."""
    vs_floor: float | None
    """p50 / floor p50 inside each job, median over rounds: lower is better, 1 is the floor."""
    vs_floor_network: float | None
    """p50 / the network floor's p50 (the fastest raw method through the collective library,
    every method but node-local shared memory) inside each job, median over rounds: what a
    strategy on gloo or NCCL can reach, so what its gate holds it to."""
    vs_baseline: float | None
    """p50 / ``pickled`` p50 inside each job, median over rounds: below 1 is faster than
    pickled."""
    collectives_per_call: int | None
    """Collectives one call issues (max over ranks), from the first round."""
    payload_bytes: int
    floor_methods: tuple[str, ...]
    """The raw method that was the floor in each round."""
    rounds: list[dict] = field(repr=False)
    """Every round's job summary (``bcastbench_job``'s dict)."""


class _StrategyClock:
    """The clock pytest-benchmark reads around each round. A round moves it on by the
    strategy's p50 per call measured inside that job, so the benchmark's statistics are
    per-call latencies, not the wall time of a job that also times every floor method and
    pickled, counts collectives, measures memory and verifies every rank."""

    __name__ = "bcastbench_strategy_p50_clock"  # how pytest-benchmark names the timer in JSON

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


@pytest.fixture
def bcastbench_gate(request, bcastbench_job, bcastbench_mode):
    """A function: ``bcastbench_gate(strategy=..., **job)`` runs ``bcastbench_mode.rounds``
    jobs as pytest-benchmark rounds and returns their ``Gate`` (see module docstring). Without
    pytest-benchmark, or with ``--benchmark-disable``, the rounds still run and the gate still
    holds; only the benchmark table is missing."""
    try:
        benchmark = request.getfixturevalue("benchmark")
    except pytest.FixtureLookupError:  # pytest-benchmark not loaded (-p no:benchmark)
        benchmark = None

    def gate(strategy: str, **job) -> Gate:
        clock, rounds = _StrategyClock(), []

        def one_round() -> None:
            summary = bcastbench_job(strategy=strategy, **job)
            clock.now_s += summary["p50_us"] / 1e6
            rounds.append(summary)

        if benchmark is not None:
            if hasattr(benchmark, "_timer"):  # a private attribute of pytest-benchmark 4.x, 5.x
                benchmark._timer = clock
                timed = "strategy p50 per call (from the job)"
            else:
                timed = "wall time of one job (this pytest-benchmark has no _timer)"
            benchmark.pedantic(one_round, rounds=bcastbench_mode.rounds, iterations=1)
        while len(rounds) < bcastbench_mode.rounds:  # benchmarks disabled: pedantic ran once
            one_round()
        result = _gate_of(strategy, rounds)
        if benchmark is not None:
            benchmark.extra_info.update(_extra_info(result, timed, job))
        return result

    return gate


def _gate_of(strategy: str, rounds: list[dict]) -> Gate:
    return Gate(
        strategy=strategy,
        p50_us=statistics.median(r["p50_us"] for r in rounds),
        floor_p50_us=_median(r.get("floor_p50_us") for r in rounds),
        vs_floor=_median(r.get("vs_floor") for r in rounds),
        vs_floor_network=_median(r.get("vs_floor_network") for r in rounds),
        vs_baseline=_median(r.get("vs_baseline") for r in rounds),
        collectives_per_call=rounds[0].get("collectives_per_call"),
        payload_bytes=rounds[0]["payload_bytes"],
        floor_methods=tuple(str(r.get("floor_method")) for r in rounds),
        rounds=rounds,
    )


def _extra_info(result: Gate, timed: str, job: dict) -> dict:
    """What pytest-benchmark saves beside the stats (``--benchmark-json``, autosave)."""
    return {
        "stats_are": timed,
        "strategy": result.strategy,
        "layout": str(job.get("layout", "tp2pp2")),
        "payload": job.get("payload", "rl_rollout"),
        "payload_bytes": result.payload_bytes,
        "p50_us": result.p50_us,
        "floor_p50_us": result.floor_p50_us,
        "floor_methods": list(result.floor_methods),
        "vs_floor": result.vs_floor,
        "vs_floor_network": result.vs_floor_network,
        "vs_baseline": result.vs_baseline,
        "collectives_per_call": result.collectives_per_call,
        "rounds": len(result.rounds),
    }


# -- the terminal section ----------------------------------------------------------------------
_JOBS = pytest.StashKey[dict]()


def _jobs_of(config) -> dict[str, list[dict]]:
    """Test id -> the job summaries it ran, in order (kept on the pytest config)."""
    return config.stash.setdefault(_JOBS, {})


def record_job(request, summary: dict) -> None:
    """Keep a job's summary for the terminal section, under the test that ran it."""
    _jobs_of(request.config).setdefault(request.node.nodeid, []).append(summary)


SUMMARY_TITLE = "bcastbench: per-call p50 and same-run ratios (what the gates assert on)"


def summary_lines(jobs: dict[str, list[dict]]) -> list[str]:
    """One row per test that ran jobs: medians over its jobs of the strategy's p50 per call,
    the floor's, ``vs_floor`` and ``vs_baseline``; then what the columns mean."""
    # Here, not at the top: the plugin loads in every pytest session of a user's machine,
    # and the report's tables bring pandas with them.
    from harness.report.tables import human_bytes  # lean: module docstring

    header = ["test", "strategy", "layout", "payload", "jobs", "p50 ms/call", "floor ms",
              "vs_floor", "vs_network", "vs_baseline", "collectives/call"]  # fmt: skip
    rows = []
    for nodeid, runs in jobs.items():
        g = _gate_of(runs[0]["strategy"], runs)
        methods = sorted(set(g.floor_methods))
        rows.append([
            nodeid.split("::", 1)[-1], g.strategy, str(runs[0].get("layout", "?")),
            f"{runs[0].get('payload', '?')} {human_bytes(g.payload_bytes)}", str(len(runs)),
            f"{g.p50_us / 1e3:.3f}",
            "—" if g.floor_p50_us is None else f"{g.floor_p50_us / 1e3:.3f} ({', '.join(methods)})",
            _times(g.vs_floor), _times(g.vs_floor_network), _times(g.vs_baseline),
            "—" if g.collectives_per_call is None else str(g.collectives_per_call),
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:]))])

    return [
        line(header),
        *(line(r) for r in rows),
        "p50 ms/call: the strategy's p50 per call (max over ranks, barrier before each call),",
        "  pytest-benchmark's time per round under bcastbench_gate; floor ms: the fastest raw",
        "  method's p50 (the methods that won). vs_floor = p50 / floor p50: lower is better, 1x is the",
        "  floor; vs_network: over the fastest method through the collective library (all but",
        "  shm), the floor a gloo or NCCL strategy can reach. vs_baseline = p50 / pickled p50:",
        "  below 1x is faster than pickled. All are taken inside each job (same world,",
        "  interleaved calls), then the median over jobs.",
    ]


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter) -> None:
    """After pytest-benchmark's table: what each test's jobs measured (``summary_lines``)."""
    jobs = _jobs_of(terminalreporter.config)
    if not jobs:
        return
    terminalreporter.write_sep("-", SUMMARY_TITLE)
    for text in summary_lines(jobs):
        terminalreporter.write_line(text)


def _flat(strategy: str, summary: dict) -> dict:
    """The strategy's own figures at the top level, with the references' p50 and ratios."""
    # Here, not at the top: the plugin loads in every pytest session, and records bring torch.
    from harness.job.records import vs_floor  # lean: module docstring

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
        mine["vs_floor"] = vs_floor(mine["p50_us"], floor_us)
        mine["vs_floor_network"] = vs_floor(mine["p50_us"], summary.get("floor_network_p50_us"))
    if baseline is not None:
        mine["baseline_p50_us"] = baseline["p50_us"]
        mine["vs_baseline"] = mine["p50_us"] / baseline["p50_us"]
    mine["strategies"] = per
    return mine
