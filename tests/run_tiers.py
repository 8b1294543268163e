"""``make test``'s runner: the benchmark tier alone, then the other tiers in two pytest sessions
side by side.

Most of the suite's wall time is waiting, not computing: Slurm scheduling, daemons, Ray
clusters and network namespaces coming up, worlds starting, fault tests waiting out a hung
rank. One session leaves one of two cores idle most of the time, so the infra tier (with the
world tier's Ray world file, which mostly waits for its clusters) runs in a session of its own
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "results" / "ci"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10"]
BENCH = ["tests/benchmarks", "--benchmark-enable", "--benchmark-json", str(CI / "benchmarks.json")]
RAY_WORLD = ["tests/world/test_ray_world.py"]
SIDE_BY_SIDE = {
    "unit+world": ["tests/unit", "tests/world", *(f"--ignore={f}" for f in RAY_WORLD)],
    "infra+ray": ["tests/infra", *RAY_WORLD],
}
"""The sessions that run together, of about equal length; the first prints live, the others to
results/ci/<name>.log."""


def _start(name: str, args: list[str], scratch: Path, log: Path | None) -> subprocess.Popen:
    cmd = [*PYTEST, f"--basetemp={scratch / name.replace('+', '_')}", *args]
    out = open(log, "w") if log is not None else None  # noqa: SIM115 -- closed in _wait
    print(f"[run_tiers] {name}: {' '.join(cmd[1:])}" + (f" > {log}" if log else ""), flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT if out else None)
    proc.log = out  # type: ignore[attr-defined]
    return proc


def _wait(name: str, proc: subprocess.Popen, t0: float) -> int:
    rc = proc.wait()
    if proc.log is not None:  # type: ignore[attr-defined]
        proc.log.close()  # type: ignore[attr-defined]
    print(f"[run_tiers] {name}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
    return rc


def main(extra: list[str]) -> int:
    CI.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bcastbench-tests-"))
    procs: list[subprocess.Popen] = []

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    t0 = time.monotonic()
    failed: list[str] = []
    try:
        bench = _start("benchmarks", BENCH + extra, scratch, None)
        procs.append(bench)
        if _wait("benchmarks", bench, t0) != 0:
            failed.append("benchmarks")
        t1 = time.monotonic()
        names = list(SIDE_BY_SIDE)
        started = {
            name: _start(
                name, SIDE_BY_SIDE[name] + extra, scratch, None if i == 0 else CI / f"{name}.log"
            )
            for i, name in enumerate(names)
        }
        procs.extend(started.values())
        for i, (name, proc) in enumerate(started.items()):
            rc = _wait(name, proc, t1)
            if i > 0:
                sys.stdout.write(f"\n[run_tiers] ---- {name} session output ----\n")
                sys.stdout.write((CI / f"{name}.log").read_text(errors="replace"))
                sys.stdout.flush()
            if rc != 0:
                failed.append(name)
    except KeyboardInterrupt:  # the sessions got the same Ctrl-C; let them clean up
        for p in procs:
            p.wait()
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
