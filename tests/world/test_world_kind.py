"""A new kind of world is one class: this file defines its own (one rank, run in this process)
and runs a real job through the run path's job step, the registry and the record.

The world fills ``harness.worlds.protocol.World`` and nothing else: no launcher, runner or record
code knows about it.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.job import execute
from harness.job.record_fields import type_problems
from harness.job.spec import JobSpec
from harness.worlds.forked import ForkedWorld
from harness.worlds.protocol import RankFn, World, WorldError, WorldRegistry
from harness.worlds.rank import RankContext
from strategies.core.layout import Layout


class InProcessWorld:
    """One rank, this process: a gloo world of one over an in-memory store, torn down (its
    groups and megatron-core's state with it) at close, so the session's forked worlds fork
    from a process with no process group."""

    world_size = 1

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s, self.start_s = timeout_s, 0.0
        self.ctx: RankContext | None = None

    def start(self) -> InProcessWorld:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        self.ctx = RankContext(0, 1, "gloo", torch.device("cpu"))
        return self

    def run(
        self, fn: RankFn, *args: Any, what: str = "", timeout_s: float | None = None
    ) -> list[Any]:
        if self.ctx is None:
            raise WorldError("the in-process world is not running")
        try:
            return [fn(self.ctx, *args)]
        except Exception as exc:
            phase = self.ctx.board.phase if self.ctx.board is not None else what
            self.close()
            raise WorldError(f"rank 0 failed in {what} while {phase!r}: {exc}") from exc

    @property
    def alive(self) -> bool:
        return self.ctx is not None

    def close(self, kill: bool = False) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx is not None:
            ctx.release_groups()
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        return ((0,),)

    def record_fields(self) -> dict[str, Any]:
        return {"world": "in-process"}


class _Board:
    """Where the rank's phases land (``RankContext.board``): the last one, for the error."""

    phase = "starting"

    def write(self, rank: int, job: int, step: int, phase: str) -> None:
        self.phase = phase


SPEC = JobSpec(
    "header", Layout(), batch_size=2, seq_len=32, iters=2, warmup=1, references=("floor", "pickled")
)


@pytest.fixture
def registry():
    worlds = WorldRegistry()
    try:
        yield worlds
    finally:
        worlds.close_all()


def _start() -> InProcessWorld:
    world = InProcessWorld().start()
    world.ctx.board = _Board()
    return world


def test_the_toy_world_fills_the_protocol():
    assert isinstance(InProcessWorld(), World)


def test_a_real_job_runs_on_the_toy_world_and_is_recorded(registry):
    world = registry.get(("in-process", 1), _start)
    assert registry.get(("in-process", 1), _start) is world, "a live world is reused"
    assert world.nodes == ((0,),)
    record = execute.run_job(world, SPEC)
    assert record["status"] == "ok" and record["correct"] is True, record
    assert record["world_size"] == 1 and record["p50_us"] > 0
    assert record["world"] == "in-process"  # the world's own fields reach the record
    assert type_problems(record) == []


def test_a_failing_rank_is_named_and_the_registry_starts_a_fresh_world(registry):
    world = registry.get(("in-process", 1), _start)
    bad = JobSpec("no_such_strategy", Layout(), batch_size=2, seq_len=32, iters=1, warmup=0)
    with pytest.raises(WorldError, match="rank 0 failed in job no_such_strategy"):
        execute.run_job(world, bad)
    assert not world.alive
    again = registry.get(("in-process", 1), _start)
    assert again is not world and again.alive
    assert execute.run_job(again, SPEC)["p50_us"] > 0


def _groups_job(ctx, layout: Layout) -> int:
    ctx.groups_for(layout)
    return ctx.rank


def test_a_forked_world_started_after_an_in_process_job_does_not_hang(registry):
    """megatron-core's destroy_model_parallel leaves a global holding a group the driver made;
    a rank forked afterwards must neither destroy it (its destructor would join the driver's
    threads forever) nor see megatron-core initialised."""
    world = registry.get(("in-process", 1), _start)
    execute.run_job(world, SPEC)
    world.close()
    forked = ForkedWorld(2, timeout_s=30).start()
    try:
        assert forked.run(_groups_job, Layout(tp=2)) == [0, 1]
        assert forked.run(_groups_job, Layout(pp=2)) == [0, 1]
    finally:
        forked.close()


def test_a_forked_world_refuses_to_start_from_a_process_that_holds_a_world(registry):
    """Ranks forked from a process with a default group would inherit it and fail to start
    their own: refused in one line, before anything is forked."""
    world = registry.get(("in-process", 1), _start)
    assert world.alive
    with pytest.raises(WorldError, match=r"already holds a torch.distributed default group"):
        ForkedWorld(2, timeout_s=30).start()
