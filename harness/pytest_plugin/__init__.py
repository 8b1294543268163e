"""bcastbench's pytest plugin (entry point ``pytest11``): gate a strategy in your own CI.

Fixtures:
- ``bcastbench_gate``: ``bcastbench_gate(strategy=..., layout="tp2pp2", payload="rl_rollout",
  batch_size=8, seq_len=512, options={...})`` runs ``bcastbench_mode.rounds`` verified jobs as
  pytest-benchmark's rounds and returns a ``Gate``: the medians over rounds of the strategy's
  per-call p50 and of the same-run ratios ``vs_floor`` and ``vs_baseline``. pytest-benchmark's
  table then shows the strategy's p50 per call (one value per round), not a job's wall time,
  and ``benchmark.extra_info`` carries the ratios.
- ``bcastbench_job``: the same arguments; one interleaved, verified job (the strategy, every
  floor method and ``pickled`` in the same rounds) run by ``harness.job.execute.run_job`` as
  every command runs one, its record (``result.json``'s fields: ``p50_us``, ``vs_floor``,
  ``vs_baseline``, ``references``, ...). ``strategy`` is a registered name (built-in or from the
  ``bcastbench.strategies`` entry point) or a dotted ``package.module.Class``.
- ``bcastbench_world``: ``bcastbench_world(n)`` returns a running gloo world of ``n`` forked
  ranks, started once per session and size (restarted if a failed job tore it down).
- ``bcastbench_mode``: ``--bcastbench-mode=short|full`` as iterations, warm-up and rounds.

After the tests, a terminal section lists every test that ran jobs: the strategy's p50 per call,
the floor, ``vs_floor`` and ``vs_baseline`` (medians over its jobs), the figures a gate asserts
on; assert on the ratios, never on absolute times.

The harness is imported inside the fixtures, not at the top (``harness.pytest_plugin.jobs``):
pytest loads this plugin into every session of every project that installs bcastbench, and a
session that asks for no fixture here should not pay for torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness.job.interval import Interval, interval_fields, interval_of  # stdlib only: no torch
from harness.units import human_bytes


@dataclass(frozen=True)
class JobLength:
    name: str
    iters: int
    """Timed, interleaved iterations per job (strategy, floor and pickled each)."""
    warmup: int
    """Untimed iterations per strategy first."""
    rounds: int
    """Jobs a gate should take the median over."""


MODES = {"short": JobLength("short", 8, 1, 3), "full": JobLength("full", 30, 3, 7)}


def pytest_addoption(parser) -> None:
    group = parser.getgroup("bcastbench")
    group.addoption(
        "--bcastbench-mode",
        choices=sorted(MODES),
        default="short",
        help="bcastbench job length: short (CI) or full (numbers worth keeping)",
    )


@pytest.fixture(scope="session")
def bcastbench_mode(request) -> JobLength:
    return MODES[request.config.getoption("--bcastbench-mode")]


def _jobs():
    """The plugin's heavy half (``harness.pytest_plugin.jobs``: torch, the job, the worlds)."""
    # Lean: pytest loads this module into every session where bcastbench is installed; only a
    # session that asks for a fixture here pays for torch.
    from harness.pytest_plugin import jobs

    return jobs


@pytest.fixture(scope="session")
def bcastbench_world():
    """A factory: ``bcastbench_world(n)`` is a running gloo world of n ranks (one per n)."""
    worlds = _jobs().Worlds()
    try:
        yield worlds
    finally:
        worlds.close()


@pytest.fixture
def bcastbench_job(request, bcastbench_world, bcastbench_mode):
    """A function running one verified job and returning its record (see module docstring);
    a strategy that refuses the layout skips the test. Every record is also kept for the
    terminal section under this test's name."""

    def job(strategy: str, layout: Any = "tp2pp2", options: dict | None = None, **spec) -> dict:
        spec.setdefault("seq_len", 512)
        spec.setdefault("iters", bcastbench_mode.iters)
        spec.setdefault("warmup", bcastbench_mode.warmup)
        record = _jobs().run(bcastbench_world, strategy, layout, options, spec)
        if record["status"] == "unsupported":
            pytest.skip(f"{strategy} refuses this layout: {record['error']}")
        record_job(request, record)
        return record

    return job


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
    p50_interval: Interval | None
    """The p50's 95 % interval (µs): from every round's calls pooled, widened to each round's
    own p50 (``harness.job.stats.p50_interval``, as ``repeats`` widens a job's); without
    samples, the median over rounds of each job's interval ends."""
    vs_floor_interval: Interval | None
    """``vs_floor``'s 95 % interval: the median over rounds of each job's paired interval ends."""
    vs_floor_network_interval: Interval | None
    vs_baseline_interval: Interval | None
    payload_bytes: int
    floor_methods: tuple[str, ...]
    """The raw method that was the floor in each round."""
    rounds: list[dict] = field(repr=False)
    """Every round's job summary (``bcastbench_job``'s dict)."""

    def holds(self, **below: float) -> Held:
        """Whether every named figure's whole 95 % interval lies below its bound:
        ``gate.holds(vs_floor_below=1.5, vs_baseline_below=1.0)`` (also ``p50_us_below``,
        ``vs_floor_network_below``). A ``Held``: true or false, its repr says why."""
        return holds(self, **below)


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


SAMPLES_KEY = "samples_us"
"""What ``bcastbench_job`` adds to a record: the strategy's slowest-rank time of every timed
call (µs), read from the job's samples file before its scratch directory is removed."""


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
        p50_interval=_p50_interval(rounds),
        vs_floor_interval=_ends(rounds, "vs_floor"),
        vs_floor_network_interval=_ends(rounds, "vs_floor_network"),
        vs_baseline_interval=_ends(rounds, "vs_baseline"),
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


def _ends(rounds: list[dict], field: str) -> Interval | None:
    """The median over rounds of each job's interval ends of ``field``; None unless every
    round has both."""
    intervals = [interval_of(r, field) for r in rounds]
    if not intervals or None in intervals:
        return None
    return Interval(statistics.median(i.lo for i in intervals),
                    statistics.median(i.hi for i in intervals))  # fmt: skip


def _p50_interval(rounds: list[dict]) -> Interval | None:
    """The p50's interval from every round's calls pooled (``SAMPLES_KEY``), widened to each
    round's own p50; the median of the jobs' interval ends where a round kept no samples."""
    if not rounds or any(not r.get(SAMPLES_KEY) for r in rounds):
        return _ends(rounds, "p50_us")
    from harness.job import stats  # numpy: only once a gate has rounds to pool

    pooled = [t for r in rounds for t in r[SAMPLES_KEY]]
    blocks = [i for i, r in enumerate(rounds) for _ in r[SAMPLES_KEY]]
    return Interval.of(stats.p50_interval(pooled, blocks))


@dataclass(frozen=True)
class Held:
    """A gate's answer: true only when every interval asked about lies wholly below its
    bound; otherwise false, and its repr (what pytest prints for a failed ``assert``) says
    which figure, its interval and the bound."""

    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return self.message


def holds(gate: Gate, **below: float) -> Held:
    """``gate.holds(vs_floor_below=1.5)``: see ``Gate.holds``."""
    from harness.job import stats  # the rule compare uses: the whole interval, not the median

    figures = {"p50_us": gate.p50_interval, "vs_floor": gate.vs_floor_interval,
               "vs_floor_network": gate.vs_floor_network_interval,
               "vs_baseline": gate.vs_baseline_interval}  # fmt: skip
    failed = []
    for name, bound in below.items():
        figure = name.removesuffix("_below")
        if not name.endswith("_below") or figure not in figures:
            raise TypeError(f"holds(): unknown bound {name!r}; valid: "
                            f"{', '.join(f'{f}_below' for f in figures)}")  # fmt: skip
        interval = figures[figure]
        if not stats.wholly_below(interval, bound):
            shown = "no interval" if interval is None else f"[{interval.lo:.3g}, {interval.hi:.3g}]"
            failed.append(f"{figure} {shown} is not wholly below {bound:g}")
    what = ", ".join(f"{n.removesuffix('_below')} < {b:g}" for n, b in below.items())
    if failed:
        return Held(False, f"gate of {gate.strategy} does not hold: " + "; ".join(failed))
    return Held(True, f"gate of {gate.strategy} holds: {what} (whole 95 % intervals)")


def _extra_info(result: Gate, timed: str, job: dict) -> dict:
    """What pytest-benchmark saves beside the stats (``--benchmark-json``, autosave)."""
    return {
        "stats_are": timed,
        "strategy": result.strategy,
        "options": dict(job.get("options") or {}),  # compare keys a cell by them too
        "layout": str(job.get("layout", "tp2pp2")),
        "payload": job.get("payload", "rl_rollout"),
        "payload_bytes": result.payload_bytes,
        "p50_us": result.p50_us,
        "floor_p50_us": result.floor_p50_us,
        "floor_methods": list(result.floor_methods),
        **interval_fields("p50_us", result.p50_interval),
        "vs_floor": result.vs_floor,
        **interval_fields("vs_floor", result.vs_floor_interval),
        "vs_floor_network": result.vs_floor_network,
        "vs_baseline": result.vs_baseline,
        **interval_fields("vs_baseline", result.vs_baseline_interval),
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
    header = ["test", "strategy", "layout", "payload", "jobs", "p50 ms/call", "floor ms",
              "vs_floor", "vs_network", "vs_baseline", "collectives/call"]  # fmt: skip
    rows = []
    for nodeid, runs in jobs.items():
        g = _gate_of(runs[0]["strategy"], runs)
        methods = sorted(set(g.floor_methods))
        rows.append([
            nodeid.split("::", 1)[-1], g.strategy, str(runs[0].get("layout", "?")),
            f"{runs[0].get('payload', '?')} {human_bytes(g.payload_bytes)}", str(len(runs)),
            f"{g.p50_us / 1e3:.3f}" + _between(g.p50_interval, 1e3, "{:.3f}"),
            "—" if g.floor_p50_us is None else f"{g.floor_p50_us / 1e3:.3f} ({', '.join(methods)})",
            _times(g.vs_floor, g.vs_floor_interval),
            _times(g.vs_floor_network, g.vs_floor_network_interval),
            _times(g.vs_baseline, g.vs_baseline_interval),
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
        "  interleaved calls), then the median over jobs. [lo, hi]: 95 % intervals (the p50's",
        "  from every job's calls pooled; a ratio's, the median of its jobs' interval ends).",
    ]


def _times(value: float | None, interval=None) -> str:
    return "—" if value is None else f"{value:.2f}x" + _between(interval)


def _between(interval, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    """`` [lo, hi]``: a 95 % interval after its figure; nothing when there is none."""
    if interval is None:
        return ""
    return " [" + ", ".join(fmt.format(v / scale) for v in interval) + "]"


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter) -> None:
    """After pytest-benchmark's table: what each test's jobs measured (``summary_lines``)."""
    jobs = _jobs_of(terminalreporter.config)
    if not jobs:
        return
    terminalreporter.write_sep("-", SUMMARY_TITLE)
    for text in summary_lines(jobs):
        terminalreporter.write_line(text)
