"""The private Ray cluster's undertaker: a small process that outlives the driver and, once the
driver is gone however it ended (kill -9 included, which runs none of the driver's own
cleanup), stops every process the cluster started and removes the cluster's directory and the
named semaphores its processes left in /dev/shm.

Ray's own processes notice a dead driver slowly (its dashboard and runtime-env agents stay for
a minute or more), and its session folder stays on disk. The driver starts this before
``ray.init`` with the write end of a pipe it keeps, and once ``ray.init`` returns writes on it
the cluster's roots: the processes ``ray.init`` started (GCS, raylet, ...), which start every
other process of the cluster. While the pipe is open the reaper polls the roots and their
descendants (so it knows every pid, with its start time against pid reuse), and acts on EOF.
Anything else the driver runs is not the cluster's and is never touched: what it ran before
the reaper started, and what it starts beside the cluster (a Slurm test cluster, a user's own
servers). Until the roots arrive, a process the driver started after the reaper counts as the
cluster's. A driver that closes cleanly has already stopped the cluster, so the reaper finds
nothing left but the directory.

    python -m harness.worlds.ray_reaper <driver pid> <cluster dir> [pid:start_time ...]
    (fd 0: the pipe; the pids: the driver's descendants when it started the reaper)
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil

POLL_S = 0.5
"""How often the driver's descendants are listed while it lives."""
GRACE_S = 3.0
"""How long the cluster's processes get to end after SIGTERM before SIGKILL."""


def descendants(pid: int, recursive: bool = True) -> dict[int, float]:
    """pid → start time of every live descendant of ``pid`` (its children alone where not
    ``recursive``)."""
    try:
        return {p.pid: p.create_time() for p in psutil.Process(pid).children(recursive=recursive)}
    except psutil.Error:
        return {}


def _still(pid: int, started: float) -> psutil.Process | None:
    """The process ``pid`` if it is still the one seen (same start time), else None."""
    try:
        proc = psutil.Process(pid)
        return proc if abs(proc.create_time() - started) < 1e-3 else None
    except psutil.Error:
        return None


def stop_all(seen: dict[int, float], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every process of ``seen`` still alive (and whatever it started since), then
    SIGKILL what remains after ``grace_s``; the pids stopped."""
    procs = [p for p in (_still(pid, t) for pid, t in seen.items()) if p is not None]
    for proc in list(procs):
        try:
            procs += [c for c in proc.children(recursive=True) if c not in procs]
        except psutil.Error:
            pass
    end_processes(procs, grace_s)
    return [p.pid for p in procs]


def end_processes(procs: list, grace_s: float, terminate: bool = True) -> None:
    """SIGTERM ``procs`` (unless ``terminate`` is False: they are already ending by
    themselves), wait ``grace_s`` for them, SIGKILL the ones left."""
    if terminate:
        for proc in procs:
            try:
                proc.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


SEMAPHORES = Path("/dev/shm")
"""Where POSIX named semaphores live (``sem_open``'s ``/name`` is ``/dev/shm/sem.name``)."""


def remove_semaphores(pids) -> list[Path]:
    """Remove the named semaphores Ray's processes of ``pids`` left (a compiled graph's channels:
    ``sem.hdr<pid>-…`` and ``sem.obj<pid>-…``, which Ray unlinks only in an orderly raylet
    exit, never after the SIGTERM or SIGKILL that ends a cluster); the files removed. Only
    names carrying one of ``pids`` are touched: those processes have ended."""
    removed = []
    for pid in pids:
        for kind in ("hdr", "obj"):
            for path in SEMAPHORES.glob(f"sem.{kind}{int(pid)}-*"):
                try:
                    path.unlink()
                except OSError:
                    continue
                removed.append(path)
    return removed


def watch(
    driver: int, cluster_dir: Path, pipe_fd: int = 0, before: dict[int, float] | None = None
) -> None:
    """Until ``pipe_fd`` reaches EOF (the driver closed it or died), keep the list of the
    cluster's processes (``cluster_processes``, from the roots the driver writes on the pipe;
    ``before``: the driver's descendants when it started the reaper, never the cluster's);
    then stop them and remove ``cluster_dir``."""
    me = os.getpid()
    before = descendants(driver) if before is None else before
    roots: dict[int, float] | None = None
    seen: dict[int, float] = {}
    pending = b""
    while True:
        ready, _, _ = select.select([pipe_fd], [], [], POLL_S)
        arrived = False
        if ready:
            data = os.read(pipe_fd, 4096)
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                roots, arrived = parse_roots(line.decode()), True
        found = cluster_processes(driver, roots, before)
        if arrived:  # what was counted before the roots came and is none of theirs: not ours
            seen = {p: t for p, t in seen.items() if p in found}
        seen.update(found)
    # A last look, for what started since the last poll (a dead driver's children are no
    # longer its own: then the roots' and what the polls saw).
    seen.update(cluster_processes(driver, roots, before))
    seen.pop(me, None)
    stop_all(seen)
    remove_semaphores(seen)
    shutil.rmtree(cluster_dir, ignore_errors=True)


def cluster_processes(
    driver: int, roots: dict[int, float] | None, before: dict[int, float] | None = None
) -> dict[int, float]:
    """pid → start time of the cluster's live processes: ``roots`` (the processes ``ray.init``
    started, pid → start time) that are still those processes, and their descendants; with no
    roots yet, every descendant of ``driver`` not in ``before``."""
    if roots is None:
        return {p: t for p, t in descendants(driver).items() if before is None or p not in before}
    out: dict[int, float] = {}
    for pid, started in roots.items():
        proc = _still(pid, started)
        if proc is not None:
            out[pid] = started
            out.update(descendants(pid))
    return out


def roots_line(roots: dict[int, float]) -> bytes:
    """The line the driver writes on the reaper's pipe: ``pid:start_time`` for each root."""
    return (" ".join(f"{pid}:{t!r}" for pid, t in sorted(roots.items())) + "\n").encode()


def parse_roots(line: str) -> dict[int, float]:
    """``roots_line``'s roots back (pid → start time)."""
    return {int(p): float(t) for p, t in (w.split(":") for w in line.split())}


def start(cluster_dir: Path) -> tuple[int, subprocess.Popen]:
    """Start a reaper for this process's private cluster in ``cluster_dir``; returns the pipe's
    write end, which the caller keeps open for as long as the cluster lives (closing it tells
    the reaper the driver is done), and the reaper's process."""
    read_fd, write_fd = os.pipe()
    os.set_inheritable(write_fd, False)
    before = roots_line(descendants(os.getpid())).decode().split()
    # Its own session: a Ctrl-C or kill of the driver's process group does not reach it.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.worlds.ray_reaper",
            str(os.getpid()),
            str(cluster_dir),
            *before,
        ],  # fmt: skip
        stdin=read_fd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    os.close(read_fd)
    return write_fd, proc


def main(argv: list[str] | None = None) -> int:
    """``<driver pid> <cluster dir> [pid:start_time ...]``: the driver's descendants when it
    started the reaper follow its directory."""
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's Ctrl-C is not ours
    watch(int(args[0]), Path(args[1]), before=parse_roots(" ".join(args[2:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
