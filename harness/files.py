"""The one way the project writes a file: whole or not at all, and readable by the team.

Every record, table, report, figure and calibration goes through ``write_atomic``: the bytes go
to a temporary file in the same directory, are flushed to disk, get mode 0644 and replace the
target in one rename, so a reader (or a crash, or Ctrl-C) never sees half a file, and a
result written on a shared cluster is readable by the rest of the team (``mkstemp`` alone
creates 0600 files).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

MODE = 0o644
"""Owner writes, everyone reads: results are meant to be shared."""
DIR_MODE = 0o755
"""The same for directories (a umask of 077 would otherwise hide every record in them)."""


def make_dirs(path: Path | str) -> Path:
    """``path`` and any missing parents, each one this call creates readable by everyone
    (``DIR_MODE``, whatever the umask); directories that existed are left as they are."""
    path = Path(path)
    missing = []
    for parent in (path, *path.parents):
        if parent.exists():
            break
        missing.append(parent)
    path.mkdir(parents=True, exist_ok=True)
    for made in missing:
        os.chmod(made, DIR_MODE)
    return path


def share_tree(root: Path | str) -> None:
    """What another program (Hydra) wrote under ``root`` made readable as records are:
    directories ``DIR_MODE``, files ``MODE``; only entries this user owns are touched."""
    root = Path(root)
    uid = os.getuid()
    for here, _dirs, names in os.walk(root):
        for path, mode in [(here, DIR_MODE)] + [(os.path.join(here, n), MODE) for n in names]:
            try:
                st = os.lstat(path)
                if st.st_uid == uid and not os.path.islink(path) and st.st_mode & 0o777 != mode:
                    os.chmod(path, mode)
            except OSError:
                continue  # gone meanwhile, or not ours to change


def share_hydra_files(out: Path | str) -> None:
    """The files Hydra writes into a run directory (``.hydra/`` and the job's ``*.log``) made
    readable as records are. Only those: the directory may be one the harness did not make (a
    rank that writes nothing runs in the temporary directory itself), and nothing else in it is
    ours to change."""
    out = Path(out)
    if (out / ".hydra").is_dir():
        share_tree(out / ".hydra")
    uid = os.getuid()
    for log in out.glob("*.log"):
        try:
            st = os.lstat(log)
            if st.st_uid == uid and not log.is_symlink() and st.st_mode & 0o777 != MODE:
                os.chmod(log, MODE)
        except OSError:
            continue


def write_atomic(path: Path | str, data: str | bytes | Callable[[IO], Any]) -> Path:
    """Write ``data`` (text, bytes, or a function that writes to a binary file object, such as
    ``fig.savefig`` or ``df.to_csv``) to ``path`` atomically; returns the path."""
    path = Path(path)
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, str):
                f.write(data.encode())
            elif isinstance(data, bytes | bytearray | memoryview):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, MODE)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json(path: Path | str, obj: Any) -> Path:
    """``obj`` as indented JSON (non-JSON values through ``str``), atomically."""
    return write_atomic(path, json.dumps(obj, indent=1, default=str) + "\n")


def write_csv(path: Path | str, df) -> Path:
    """A pandas DataFrame as CSV without its index, atomically."""
    return write_atomic(path, df.to_csv(index=False))


def write_figure(path: Path | str, fig, dpi: int = 110) -> Path:
    """A matplotlib figure, in the format its suffix names, atomically."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    return write_atomic(path, lambda f: fig.savefig(f, dpi=dpi, format=fmt))
