"""The one way a job gets its batches: a ``PayloadSource`` names where they come from (a
generator, a recorded file, a schema) and, for a file, holds what was read from it, checked
once (``open_payload``). The driver opens it when the config is validated; the job's spec
carries it to every rank, so no rank opens the user's file again and a file changed after the
check is never read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.payload import generated, payload_schema, recording, schema_replay, user_files
from strategies import NON_TENSOR_FLAG, DataProto

RECORDED = ("file", "schema")
"""Payloads read from ``payload.path`` instead of generated: a recorded batch
(``harness.payload.recording``) or a schema replayed with seeded data
(``harness.payload.schema_replay``)."""

PayloadError = (user_files.PayloadFileError, payload_schema.SchemaError)
"""What opening a recorded payload raises for a bad, unsafe or oversized file (one line)."""


@dataclass(frozen=True)
class PayloadSource:
    """Where a job's batches come from; ``batch`` makes any of them."""

    name: str
    """A generated payload (rl_rollout | pretrain | multimodal) or file | schema."""
    path: str | None = None
    """The recording or schema (absolute, as every rank can name it)."""
    trust: bool = False
    """payload=file: arbitrary unpickling allowed."""
    max_bytes: int | None = None
    """The most bytes a batch may take (None: the loader's default)."""
    loaded: Any = field(default=None, compare=False, repr=False)
    """A recording's batch or a schema's checked form, as read once; None when generated."""

    def batch(
        self, rows: int, seq_len: int | None, seed: int, broadcast_non_tensor: bool | None = None
    ) -> DataProto:
        """``rows`` rows of this payload (a generated one of ``seq_len`` tokens), seeded; the
        non-tensor flag set when given."""
        if self.name == "file":
            dp = recording.resample(self.loaded, rows)
            dp = DataProto(dp.batch, dict(dp.non_tensor_batch), dict(dp.meta_info))
        elif self.name == "schema":
            dp = schema_replay.replay(self.loaded, rows, seed)
        else:
            return generated.make(self.name, rows, seq_len, seed, broadcast_non_tensor)
        if broadcast_non_tensor is not None:
            dp.meta_info[NON_TENSOR_FLAG] = broadcast_non_tensor
        return dp

    def seq_len(self, seed: int = 0) -> int | None:
        """A recorded payload's tokens per row as its batch has them (the widest 2-D leaf of
        one row); None for a generated one (its seq_len is the config's)."""
        if self.name not in RECORDED:
            return None
        return recording.seq_len_of(self.batch(1, None, seed))


def path_of(name: str, path: str | None) -> str | None:
    """``payload.path`` as every rank can open it (absolute: a rank's working directory is
    not always the user's; a schema's bare name resolved in conf/schemas/)."""
    if name not in RECORDED or not path:
        return None
    resolved = payload_schema.resolve(path) if name == "schema" else Path(path).expanduser()
    return str(resolved.resolve())


def open_payload(
    name: str,
    path: str | None = None,
    trust: bool = False,
    max_bytes: int | None = None,
    rows: int | None = None,
) -> PayloadSource:
    """The payload ``name``: a generated one as it is; a recorded one read and checked whole
    (safe to load, or trusted; within ``max_bytes`` at ``rows`` rows, the most one leader holds)
    once per content, so validation, the spec and every later job of a sweep share one read.
    Raises ``PayloadError`` (one line) for a bad file, KeyError for an unknown name."""
    if name not in RECORDED:
        if name not in generated.PAYLOADS:
            valid = sorted(generated.PAYLOADS) + list(RECORDED)
            raise KeyError(f"unknown payload {name!r}; valid names: {valid}")
        return PayloadSource(name)
    resolved = path_of(name, path)
    if resolved is None:
        raise user_files.PayloadFileError(f"payload.path: payload={name} needs payload.path=<file>")
    key = (name, resolved, _content_key(resolved), bool(trust), max_bytes, rows)
    if key not in _OPENED:
        _OPENED.clear()  # one payload held at a time: a sweep moves from file to file
        _OPENED[key] = PayloadSource(name, resolved, bool(trust), max_bytes,
                                     _read(name, resolved, trust, max_bytes, rows))  # fmt: skip
    return _OPENED[key]


def _read(name: str, path: str, trust: bool, max_bytes: int | None, rows: int | None):
    if name == "schema":
        return schema_replay.check(path, rows, max_bytes)
    return recording.load(path, bool(trust), max_bytes=max_bytes, batch_size=rows)


def _content_key(path: str) -> tuple:
    """What changes when the file (or a recording directory's entries) changes: a file
    rewritten in place after it was read is read again, never taken from the cache."""
    try:
        st = os.stat(path)
    except OSError:
        return ()
    key: tuple = (st.st_ino, st.st_size, st.st_mtime_ns)
    if os.path.isdir(path):
        for root, dirs, names in os.walk(path):
            dirs.sort()
            for name in sorted(names):
                est = os.lstat(os.path.join(root, name))
                key += (
                    os.path.relpath(os.path.join(root, name), path),
                    est.st_size,
                    est.st_mtime_ns,
                )
    return key


_OPENED: dict[tuple, PayloadSource] = {}
"""The recorded payload this process last opened, by what it was opened as."""
