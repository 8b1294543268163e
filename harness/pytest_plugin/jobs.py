"""The plugin's heavy half: the worlds and the jobs its fixtures run, through the same
``harness.job.execute.run_job`` every command uses. Imported by the fixtures only when a test
asks for one (``harness.pytest_plugin``), so a pytest session that uses none never imports torch.
"""

from __future__ import annotations

import csv
import gzip
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml

import strategies
from harness.errors import ConfigError
from harness.job.build import from_arguments
from harness.job.config import check_size, per_leader
from harness.job.execute import run_job
from harness.job.record_fields import Record
from harness.job.samples import SAMPLES_FILE, SLOWEST
from harness.job.spec import JobSpec
from harness.paths import CONF_DIR
from harness.payload import source
from harness.pytest_plugin import SAMPLES_KEY
from harness.worlds.launcher import forked_spec
from harness.worlds.opening import open_world
from harness.worlds.protocol import REGISTRY
from strategies.core.layout import Layout


class Worlds:
    """The session's forked gloo worlds, one per size, closed when the session ends."""

    def __init__(self) -> None:
        # Worlds fork this process: keep it single-threaded, or a fork after an OpenMP region
        # can deadlock a rank.
        torch.set_num_threads(1)
        self.used: set[tuple] = set()

    def __call__(self, n: int):
        """The registry's live world of ``n`` ranks, or a fresh one."""
        spec = forked_spec(n)
        self.used.add(spec.reuse_key)
        return open_world(spec)

    def close(self) -> None:
        for key in self.used:
            REGISTRY.close(key)


def layout_named(layout: Any) -> Layout:
    """A ``Layout`` from a conf/layout name (``"tp2pp2"``), a dict of fields, or a Layout."""
    if isinstance(layout, Layout):
        return layout
    if isinstance(layout, dict):
        return Layout(**layout)
    path = CONF_DIR / "layout" / f"{layout}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONF_DIR / "layout").glob("*.yaml"))
        raise ValueError(f"unknown layout {layout!r}; valid names: {known}")
    return Layout(**yaml.safe_load(path.read_text()))


def run(worlds: Worlds, strategy: str, layout: Any, options: dict | None, fields: dict) -> Record:
    """One verified job of ``strategy`` on ``layout`` (its other ``fields`` as ``JobSpec``
    names them), on the session's world of its size; its record."""
    options = dict(options or {})
    strategies.check_options(strategy, options)  # one line before any rank runs
    spec = check_payload(from_arguments(strategy, layout_named(layout), options, fields))
    # A scratch directory for the job's samples file: the gate pools every round's calls into
    # its p50 interval. The record written beside them is the one returned; nothing stays.
    scratch = Path(tempfile.mkdtemp(prefix="bcastbench_gate_"))
    try:
        record = run_job(worlds(spec.layout.world_size), spec, out_dir=scratch)
        return {**record, SAMPLES_KEY: strategy_samples(scratch, record)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def strategy_samples(directory: Path, record: Record) -> list[float]:
    """The strategy's slowest-rank time (µs) of every timed call of the job whose samples
    file lies in ``directory``, in round order; [] where the job kept none (a refusal)."""
    path = directory / (record.get("samples_file") or SAMPLES_FILE)
    if not path.is_file():
        return []
    with gzip.open(path, "rt", newline="") as f:
        return [float(row["wall_us"]) for row in csv.DictReader(f)
                if row["strategy"] == record["strategy"] and int(row["rank"]) == SLOWEST]  # fmt: skip


def check_payload(spec: JobSpec) -> JobSpec:
    """``spec`` with its payload opened here, by the loader every command uses: a recorded
    one (payload="file" | "schema", payload_path=...) read and checked once, so a bad or unsafe
    file fails the test with its one-line reason before any rank starts (as ``bcastbench
    run`` refuses it before any rank) and no rank reads it again; a generated one priced
    against the same limit."""
    if spec.payload not in source.RECORDED:
        shapes = per_leader(spec.distinct_shapes(), spec.seq_len)
        try:  # priced from its shapes, as bcastbench run prices it, before any rank allocates
            check_size(spec.payload, shapes, spec.payload_max_bytes)
        except (ConfigError, KeyError) as exc:
            raise ValueError(str(exc).strip("'\"")) from None
        return spec
    if not spec.payload_path:
        raise ValueError(f'payload="{spec.payload}" needs payload_path=<file>')
    try:
        return replace(spec, source=spec.payload_source())
    except source.PayloadError as exc:
        raise ValueError(str(exc)) from None
