"""What every reader of a user's file (recording or schema) shares: the one error, the options a
refusal names, the limits on what a file may claim, and opening it read-only, sizes checked."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in DTYPE_NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
"""The tensor dtypes a recording or a schema may name (``torch.<name>``), and no other
attribute of ``torch``."""

MAX_DEPTH = 32
"""Deepest nesting of keys (TensorDicts inside TensorDicts) read from a file or a schema."""
MAX_LEAVES = 10_000
"""Most leaves (and nested TensorDicts) one recording or schema may hold."""
MAX_DIMS = 16
"""Most dimensions one leaf may have."""


def is_dims(value) -> bool:
    """Whether ``value`` is a shape as a file may write one: a list of at most ``MAX_DIMS``
    non-negative ints (never bools, floats or strings), each below 2**48."""
    ok = isinstance(value, list) and len(value) <= MAX_DIMS
    return ok and all(type(d) is int and 0 <= d < 1 << 48 for d in value)


class PayloadFileError(ValueError):
    """A recorded batch that cannot be used; raised before any rank starts."""


@dataclass(frozen=True)
class Flags:
    """How the command reading a recording spells its options, so a refusal names the one to
    type: ``bcastbench run`` takes ``payload.*`` overrides, ``bcastbench schema`` its flags."""

    prefix: str = "payload.path: "
    """Starts every message (the option that named the file)."""
    trust: str = "payload.trust=true"
    """Lifts the allow-list."""
    max_bytes: str = "payload.max_bytes"
    """Raises the byte limit."""


RUN_FLAGS = Flags()
SCHEMA_FLAGS = Flags(prefix="", trust="--trust", max_bytes="--max-bytes")


def trust_hint(flags: Flags = RUN_FLAGS) -> str:
    return f"if you trust this file, add {flags.trust} (it may run code when loaded)"


def default_max_bytes() -> int:
    """A quarter of this machine's physical memory: every replica leader on a host holds its
    batch and the strategy's buffers next to the recording being read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (AttributeError, OSError, ValueError):  # no sysconf: a 64 GiB host's quarter
        return 16 << 30


@dataclass(frozen=True)
class ReadPolicy:
    """What one read may do: run pickles (trust), allocate how much, and how to say so."""

    trust: bool
    max_bytes: int
    flags: Flags

    @property
    def limit(self) -> str:
        """The byte limit as the user would set it (``payload.max_bytes=N``)."""
        return f"{self.flags.max_bytes}={self.max_bytes:,}"

    def too_big(self, what: str, rows: int, row_bytes: int) -> str | None:
        total = rows * row_bytes
        if total <= self.max_bytes:
            return None
        return (
            f"{what}: {rows:,} rows × {row_bytes:,} bytes per row = {total:,} bytes > {self.limit}"
        )


def one_line(text) -> str:
    return " ".join(str(text).split())


# -- opening files: regular files only, read-only, sizes checked ---------------------------------
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symlink",
}


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, from its ``st_mode``."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: Path, size: int | None = None, follow: bool = True):
    """``path`` opened read-only as a binary file, after checking (on the open descriptor, so a
    file swapped for a FIFO in between is caught) that it is a regular file of ``size`` bytes.
    O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever. ``follow=False`` for
    a path already resolved and checked: a symlink put there since is refused."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
        os.close(fd)
        what = file_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else f"{st.st_size:,} bytes"
        raise PayloadFileError(f"{path} changed while being read (now {what})")
    return os.fdopen(fd, "rb")


def read_exact(f, buffer: memoryview, path: Path) -> None:
    """``buffer`` filled from ``f``; a file shorter than it is said to be truncated."""
    got = 0
    while got < len(buffer):
        n = f.readinto(buffer[got:])
        if not n:
            raise PayloadFileError(f"{path} is truncated: {got:,} of {len(buffer):,} bytes read")
        got += n


def read_bytes(path: Path, size: int, follow: bool = True) -> bytes:
    """The ``size`` bytes of the regular file at ``path`` (``open_regular``)."""
    data = bytearray(size)
    with open_regular(path, size, follow) as f:
        read_exact(f, memoryview(data), path)
    return bytes(data)
