"""``make test``'s runner: the benchmark tier alone, then the other tiers in two pytest sessions
side by side.

Most of the suite's wall time is waiting, not computing: Slurm scheduling, daemons, Ray
clusters and network namespaces coming up, worlds starting, fault tests waiting out a hung
rank. One session leaves one of two cores idle most of the time, so the infra tier (with the
world tier's Ray tests, which mostly wait for their clusters) runs in a session of its own
beside the unit and world tiers. The benchmark tier times strategies against each other and
needs a quiet machine, so it runs first, alone. (Three sessions, the world tier apart from the
unit tier, were slower: the infra session, the longest, lost more to contention than the
split saved.)

Each session has its own temporary directory (``--basetemp``) and no cache, so the two never
write the same file. The unit+world session prints as it goes; the other's output goes to
``results/ci/infra+ray.log`` and is printed when it ends. The exit status is 0 only when every
session passed (a session that collected nothing exits 5: a failure). SIGTERM or Ctrl-C reaches
the sessions, which clean up as a single pytest would (worlds, clusters, namespaces).

Usage: ``python tests/run_tiers.py [extra pytest arguments]`` (``make test`` runs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "results" / "ci"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10"]
BENCH = ["tests/benchmarks", "--benchmark-enable", "--benchmark-json", str(CI / "benchmarks.json")]
RAY_FILES = ["tests/world/test_ray_world.py"]
RAY_TESTS = [
    "tests/world/test_nothing_left.py::test_kill_9_of_a_ray_driver_leaves_nothing",
    "tests/world/test_nothing_left.py::test_ctrl_c_ends_a_ray_sweep_within_5_s",
]
"""The world tier's tests that wait on Ray clusters of their own: run with the infra tier."""
EVEN_FILES = [
    "tests/world/test_joined_world.py",
    "tests/world/test_engines.py",
    "tests/world/test_byo.py",
]
"""World tests run with the infra tier so the two sessions end together: with them in it, the
unit and world session ran longer than the other (``--durations=0``: about a hundred seconds
before the joined world's tests moved, thirty-five before the engines' did, and seventy
before the user's plugin's did, once the Ray tests started one world instead of three), and
these wait on launchers, a Slurm-style sweep, engine processes and a package install more than
they compute."""
SIDE_BY_SIDE = {
    "unit+world": [
        "tests/unit",
        "tests/world",
        *(f"--ignore={f}" for f in RAY_FILES + EVEN_FILES),
        *(f"--deselect={t}" for t in RAY_TESTS),
    ],
    "infra+ray": ["tests/infra", *RAY_FILES, *EVEN_FILES, *RAY_TESTS],
}
"""The sessions that run together, of about equal length; the first prints live, the others to
results/ci/<name>.log."""


@dataclass
class _Session:
    """One pytest session: its process, and the log it writes to (None: the terminal)."""

    name: str
    proc: subprocess.Popen
    log: Path | None
    out: IO | None

    @classmethod
    def start(cls, name: str, args: list[str], scratch: Path, log: Path | None) -> _Session:
        cmd = [*PYTEST, f"--basetemp={scratch / name.replace('+', '_')}", *args]
        print(f"[run_tiers] {name}: {' '.join(cmd[1:])}" + (f" > {log}" if log else ""), flush=True)
        out = open(log, "w") if log is not None else None  # noqa: SIM115 -- closed in finish
        err = subprocess.STDOUT if out else None
        return cls(name, subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err), log, out)

    def finish(self, t0: float) -> int:
        """Wait for the session, say how it ended and print what it logged; its exit status."""
        rc = self.proc.wait()
        print(f"[run_tiers] {self.name}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
        if self.out is not None:
            self.out.close()
            sys.stdout.write(f"\n[run_tiers] ---- {self.name} session output ----\n")
            sys.stdout.write(self.log.read_text(errors="replace"))
            sys.stdout.flush()
        return rc


def main(extra: list[str]) -> int:
    CI.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bcastbench-tests-"))
    sessions: list[_Session] = []

    def forward(signum, _frame):
        for session in sessions:
            if session.proc.poll() is None:
                session.proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    t0 = time.monotonic()
    failed: list[str] = []
    try:
        sessions.append(_Session.start("benchmarks", BENCH + extra, scratch, None))
        if sessions[0].finish(t0) != 0:
            failed.append("benchmarks")
        t1 = time.monotonic()
        side = [
            _Session.start(name, args + extra, scratch, None if i == 0 else CI / f"{name}.log")
            for i, (name, args) in enumerate(SIDE_BY_SIDE.items())
        ]
        sessions.extend(side)
        failed += [session.name for session in side if session.finish(t1) != 0]
    except KeyboardInterrupt:  # the sessions got the same Ctrl-C; let them clean up
        for session in sessions:
            session.proc.wait()
        raise
    print(
        f"[run_tiers] {'FAILED: ' + ', '.join(failed) if failed else 'all sessions passed'} in "
        f"{time.monotonic() - t0:.0f} s",
        flush=True,
    )
    if not failed:
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        print(f"[run_tiers] temporary files kept in {scratch}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("BCASTBENCH_BENCH", "short")
    sys.exit(main(sys.argv[1:]))
