"""What the hostile-file tests share: small valid recordings in every format (to break), a
pickle that would create a marker file if it ran, a snapshot that tells whether a file was
changed, and the job CLI run in process with launching forbidden."""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from harness.payload import payload_schema, recording, user_files
from strategies import DataProto

QUICK_S = 5.0
"""A loader's answer to any input here (it reads kilobytes), with room for a loaded machine."""
CLI_S = 30.0
"""The whole command in process, Hydra's composition included, on a loaded machine."""


class RunsCode:
    """Pickles as a call to ``open(marker, "w")``: loading it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class RunsShell:
    """Pickles as ``os.system("touch marker")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Tag:
    """A harmless class of the user's own: safe loading refuses it, trust loads it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other) -> bool:
        return isinstance(other, Tag) and other.name == self.name


def small_batch(rows: int = 4) -> TensorDict:
    """A TensorDict with every leaf kind a memmap directory stores: dense (int, bfloat16, bool),
    nested TensorDict, nested tensor, a key that needs encoding, JSON-able non-tensor data and
    a non-tensor stack."""
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():  # the strided nested layout, the one memmap can write
        warnings.simplefilter("ignore", UserWarning)
        ragged = torch.nested.nested_tensor(
            [torch.randn(i + 1, 2, generator=g) for i in range(rows)]
        )
    return TensorDict(
        {
            "input_ids": torch.randint(0, 100, (rows, 9), generator=g),
            "mask": torch.rand(rows, 9, generator=g) > 0.5,
            "nest": TensorDict({"logp": torch.randn(rows, 5).bfloat16()}, batch_size=[rows]),
            "ragged": ragged,
            "odd/key": torch.arange(rows, dtype=torch.float32),
            "note": NonTensorData("hello", batch_size=[rows]),
            "texts": NonTensorStack.from_list([f"text {i}" for i in range(rows)]),
        },
        batch_size=[rows],
    )


def memmap_recording(path: Path, rows: int = 4) -> Path:
    small_batch(rows).memmap(path)
    return path


def evil_memmap(path: Path, marker: Path, stack: bool = False) -> Path:
    """A memmap recording whose non-tensor leaf is pickled (other.pickle, or a stack's
    pickle.pkl) and would create ``marker`` when unpickled."""
    rows = 3
    evil = (
        NonTensorStack.from_list([RunsCode(marker)] * rows)
        if stack
        else NonTensorData(RunsCode(marker), batch_size=[rows])
    )
    TensorDict({"x": torch.ones(rows, 2), "evil": evil}, batch_size=[rows]).memmap(path)
    return path


def tagged_memmap(path: Path) -> Path:
    rows = 2
    TensorDict(
        {"x": torch.ones(rows, 2), "tag": NonTensorData(Tag("mine"), batch_size=[rows])},
        batch_size=[rows],
    ).memmap(path)
    return path


def torch_recording(path: Path, rows: int = 4) -> Path:
    """This project's own recording (torch.save of a DataProto with non-tensor arrays)."""
    batch = TensorDict({"input_ids": torch.arange(rows * 9).reshape(rows, 9)}, batch_size=[rows])
    uid = np.array([f"uid-{i}" for i in range(rows)], dtype=object)
    recording.save(DataProto(batch, {"uid": uid}, {"step": 1}), path)
    return path


def snapshot(*roots: Path) -> dict:
    """Every path under ``roots`` with its type, size, mtime and (regular files) content hash;
    symlinks and special files are looked at, never followed or opened."""
    out = {}
    for root in roots:
        paths = [root]
        if root.is_dir() and not root.is_symlink():
            for parent, dirs, files in os.walk(root):
                paths += [Path(parent) / name for name in dirs + files]
        for path in paths:
            if not os.path.lexists(path):
                out[str(path)] = None
                continue
            st = os.lstat(path)
            digest = (
                hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
            )
            out[str(path)] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return out


def one_line_error(call) -> tuple[str, float]:
    """``call()`` must raise one of the loaders' errors, in one line; its text and the time."""
    start = time.monotonic()
    try:
        call()
    except (user_files.PayloadFileError, payload_schema.SchemaError) as exc:
        took = time.monotonic() - start
        text = str(exc)
        assert "\n" not in text and "Traceback" not in text, text
        return text, took
    raise AssertionError("the hostile input was accepted")


def _no_launch(*_args, **_kwargs):
    raise AssertionError("a hostile file passed validation and would have started ranks")


def run_cli(argv: list[str], capsys, monkeypatch) -> tuple[int, list[str], float]:
    """``bcastbench ARGV`` in process: its exit status, its stderr lines, its time. Starting
    ranks is forbidden: every input here must stop at validation."""
    from harness.commands import cli
    from harness.job import app

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setattr(app, "run_job", _no_launch)
    capsys.readouterr()
    start = time.monotonic()
    status = cli.main(argv)
    took = time.monotonic() - start
    return status, capsys.readouterr().err.strip().splitlines(), took
