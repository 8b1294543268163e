"""One sweep owns its directory: a second sweep into it, while the first runs or after it
wrote records there, is refused naming the other one, so no record is overwritten and no
table mixes two sweeps' numbers.

The claim is an advisory lock (``flock``) on ``<sweep>/.bcastbench-sweep.lock``, held by the
sweeping process until it exits; the kernel drops it however the process ends (kill -9
included), so a dead sweep never blocks the next one. The lock file says who holds it.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from harness.errors import ConfigError
from harness.files import MODE, make_dirs

LOCK = ".bcastbench-sweep.lock"
_HELD: dict[Path, int] = {}
"""Sweep directories this process holds, with the lock's file descriptor (kept open)."""


def _owner(fd: int) -> str:
    """Who the lock file says holds it, in words."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 65536) or b"{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "owner unknown"
    return (
        f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}: "
        f"{info.get('command')}"
    )


def claim(root: Path | str) -> Path:
    """Make ``root`` this process's sweep directory, or raise ConfigError saying which sweep
    has it (running now, or finished with records there) and what to do instead."""
    root = Path(root).resolve()
    if root in _HELD:
        return root
    make_dirs(root)
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _owner(fd)
        os.close(fd)
        raise ConfigError(
            f"hydra.sweep.dir={root} is in use by another sweep ({owner}); wait for it to end "
            "or choose another hydra.sweep.dir"
        ) from None
    earlier = sum(1 for _ in root.rglob("result.json"))
    if earlier:
        owner = _owner(fd)
        os.close(fd)
        raise ConfigError(
            f"hydra.sweep.dir={root} already holds {earlier} record(s) of an earlier sweep "
            f"({owner}); a new sweep would overwrite them: choose another hydra.sweep.dir "
            "(the default is a new timestamped one) or remove that directory"
        )
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["bcastbench", *sys.argv[1:]]),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    os.fchmod(fd, MODE)
    _HELD[root] = fd
    return root


def release(root: Path | str) -> None:
    """Give the directory up (the records stay; a later sweep into it is still refused)."""
    fd = _HELD.pop(Path(root).resolve(), None)
    if fd is not None:
        os.close(fd)
