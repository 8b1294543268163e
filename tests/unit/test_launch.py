"""Tier 1: which world runs a job, read from plain environment dicts and the config's two
choices (nothing exported), the node a joined rank is on, what makes a live world reusable,
the registry that keeps them, and the name a record gives a layout."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from harness.errors import ConfigError
from harness.job.config_schema import layout_name
from harness.worlds import launcher, opening
from harness.worlds.launcher import (
    EMULATED,
    FORKED,
    JOINED,
    RAY,
    Launch,
    WorldSpec,
    detect,
    forked_spec,
)
from harness.worlds.protocol import WorldRegistry, group_by_node
from harness.worlds.ray_cluster import RayConf
from strategies.core.layout import SEED_ORDER, Layout


@pytest.mark.parametrize(
    "env, emulate, expected",
    [
        ({}, False, Launch(FORKED, "local")),
        ({}, True, Launch(EMULATED, "emulated")),
        (
            {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4"},
            False,
            Launch(JOINED, "torchrun", 3, 4),
        ),
        # A bare env:// world (RANK, WORLD_SIZE, MASTER_ADDR) is joined the same way, and an
        # emulated job's workers are ranks of such a world, not drivers of another cluster.
        (
            {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"},
            True,
            Launch(JOINED, "torchrun", 1, 2),
        ),
        ({"RANK": "1", "WORLD_SIZE": "2"}, False, Launch(FORKED, "local")),
        (
            {
                "SUBMITIT_EXECUTOR": "slurm",
                "SLURM_NTASKS": "8",
                "SLURM_PROCID": "5",
                "SLURM_STEP_ID": "0",
                "SLURM_STEP_NUM_TASKS": "8",
            },
            False,
            Launch(JOINED, "submitit", 5, 8),
        ),  # fmt: skip
        (
            {
                "SUBMITIT_EXECUTOR": "local",
                "SUBMITIT_LOCAL_NTASKS": "4",
                "SUBMITIT_LOCAL_GLOBALID": "2",
            },
            False,
            Launch(JOINED, "submitit", 2, 4),
        ),  # fmt: skip
        ({"SUBMITIT_EXECUTOR": "slurm", "SLURM_NTASKS": "1"}, False, Launch(FORKED, "local")),
        (
            {"SLURM_STEP_ID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"},
            False,
            Launch(JOINED, "srun", 3, 4),
        ),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}, True, Launch(EMULATED, "emulated")),
    ],
)
def test_detect(env, emulate, expected):
    assert detect(env, emulate=emulate) == expected
    assert detect(env, emulate=emulate).writes_records == (expected.rank == 0)


def test_world_ray_is_chosen_where_no_launcher_or_emulation_is():
    assert detect({}, world=RAY) == Launch(RAY, "ray")
    assert detect({}, emulate=True, world=RAY).kind == EMULATED  # validation refuses this
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}
    assert detect(torchrun, world=RAY).kind == JOINED  # a launched rank is a rank


@pytest.mark.parametrize(
    "env, via, node",
    [
        ({"GROUP_RANK": "1", "RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "torchrun", 1),
        ({"RANK": "5", "LOCAL_WORLD_SIZE": "4"}, "torchrun", 1),  # a bare env:// world
        ({"SLURM_NODEID": "3", "SLURM_LOCALID": "1"}, "srun", 3),
        ({"SUBMITIT_EXECUTOR": "slurm", "SLURM_NODEID": "2"}, "submitit", 2),
        ({"SUBMITIT_EXECUTOR": "local", "SLURM_NODEID": "2"}, "submitit", 0),
    ],
)
def test_a_joined_rank_knows_its_node_from_its_launcher(env, via, node):
    from harness.worlds.joined import node_of

    assert node_of(env, via) == node


def test_ranks_are_grouped_by_node_in_node_order():
    assert group_by_node(["b", "b", "a", "a"]) == ((0, 1), (2, 3))
    assert group_by_node([0, 1, 0, 1]) == ((0, 2), (1, 3))  # srun's cyclic distribution
    assert group_by_node([]) == ()


def test_what_makes_a_world_reusable():
    assert forked_spec(4, timeout_s=6).reuse_key == forked_spec(4, timeout_s=120).reuse_key
    assert forked_spec(4).reuse_key != forked_spec(8).reuse_key
    ray = WorldSpec(Launch(RAY, "ray"), 4, ray=RayConf(timeout_s=120))
    # The Ray world serves every dispatch mode; a job's int timeout is the conf's float one.
    same = replace(ray, ray=RayConf(timeout_s=120.0, dispatch="leader", placement="STRICT_PACK"))
    assert same.reuse_key == ray.reuse_key
    assert replace(ray, ray=RayConf(num_cpus=4)).reuse_key != ray.reuse_key


class _Ranks:
    """The smallest thing the registry keeps: starts, is alive until closed."""

    def __init__(self) -> None:
        self.alive, self.closed_with = False, None

    def start(self) -> _Ranks:
        self.alive = True
        return self

    def close(self, kill: bool = False) -> None:
        self.alive, self.closed_with = False, kill


def test_the_registry_reuses_live_worlds_and_replaces_dead_ones():
    registry = WorldRegistry()
    first = registry.get(("forked", 4), lambda: _Ranks().start())
    assert registry.get(("forked", 4), lambda: _Ranks().start()) is first
    other = registry.get(("forked", 8), lambda: _Ranks().start())
    assert first.alive and other.alive, "worlds of other keys are kept side by side"
    first.alive = False  # a failed job tore it down
    fresh = registry.get(("forked", 4), lambda: _Ranks().start())
    assert fresh is not first and first.closed_with is True
    one = registry.get(("ray", 4), lambda: _Ranks().start(), alone=True)
    two = registry.get(("ray", 8), lambda: _Ranks().start(), alone=True)
    assert not one.alive and one.closed_with is False and two.alive, "one Ray world at a time"
    handle = registry.reused(("forked", 2), lambda: _Ranks().start())
    assert not handle.alive, "a handle starts nothing until asked"
    started = handle.start().world
    started.alive = False
    assert not handle.alive and handle.start().world is not started
    registry.close_all()
    assert registry.worlds == {} and not (fresh.alive or other.alive or two.alive)


class _Revivable(_Ranks):
    """A world that keeps what its ranks ran on (a Ray world its cluster) and can start its
    ranks again; ``fail`` makes the next revive raise."""

    fail = False
    revived = 0

    def revive(self):
        if self.closed_with is not None:  # closed by its owner: stays closed, as a Ray world
            return self
        if self.fail:
            raise RuntimeError("the cluster lost a node")
        self.revived += 1
        self.alive = True
        return self


def test_a_world_a_failed_job_tore_down_is_revived_where_it_can_be(caplog):
    registry = WorldRegistry()
    world = registry.get(("ray", 4), lambda: _Revivable().start(), alone=True)
    world.alive = False  # a failed job dropped its ranks
    assert registry.get(("ray", 4), lambda: _Revivable().start(), alone=True) is world
    assert world.revived == 1 and world.alive and world.closed_with is None
    world.alive, world.fail = False, True
    with caplog.at_level("WARNING"):
        fresh = registry.get(("ray", 4), lambda: _Revivable().start(), alone=True)
    assert fresh is not world and world.closed_with is True
    assert "could not start its ranks again (the cluster lost a node)" in caplog.text
    closed = registry.get(("ray", 4), lambda: _Revivable().start(), alone=True)
    closed.close()  # closed by its owner, not torn down by a job: revive keeps it closed
    caplog.clear()
    assert registry.get(("ray", 4), lambda: _Revivable().start(), alone=True) is not closed
    assert "could not start" not in caplog.text


@pytest.mark.parametrize(
    "layout, name",
    [
        (Layout(pp=2, tp=2), "tp2pp2"),
        (Layout(pp=2, tp=1), "pp2"),  # `layout=tp2pp2 layout.tp=1` is not tp2pp2
        (Layout(dp=2, pp=2, tp=2), "tp2pp2dp2"),
        (Layout(tp=2, cp=2), "tp2cp2"),
        (Layout(pp=2, cp=2), "pp2cp2"),
        (Layout(), "tp1"),
        (Layout(dp=2, pp=2, tp=2, order=SEED_ORDER), f"tp2pp2dp2@{SEED_ORDER}"),
    ],
)
def test_layout_name_describes_the_shape(layout, name):
    assert layout_name(layout) == name


def test_record_of_an_overridden_preset_names_its_shape():
    """The record path itself (records.build), for a preset overridden to another shape."""
    from harness.job import records
    from harness.job.results import Refusal
    from harness.job.spec import JobSpec

    spec = JobSpec("header", Layout(pp=2, tp=1, order=SEED_ORDER))
    rec = records.build(spec, Refusal("header: not here"))
    assert (rec["layout"], rec["world_size"], rec["order"]) == (f"pp2@{SEED_ORDER}", 2, SEED_ORDER)
    assert rec["status"] == "unsupported" and rec["supported"] is False
    failed = records.failed(spec, RuntimeError("rank 1 exited\n--- traceback ---"))
    assert failed["status"] == "failed" and failed["error"] == "rank 1 exited"
    assert {k: failed[k] for k in ("layout", "tp", "pp")} == {
        "layout": f"pp2@{SEED_ORDER}",
        "tp": 1,
        "pp": 2,
    }


def test_a_sweep_job_with_a_longer_limit_gets_a_world_whose_collectives_wait_for_it(monkeypatch):
    """A forked world's gloo timeout is fixed when it starts (the first job's ``timeout_s`` + 5).
    A later job of the same shape with a shorter limit reuses it; one with a longer limit gets
    a world started for it, so a long collective is not cut at the first job's limit."""
    from harness.worlds import launcher
    from harness.worlds.protocol import WorldRegistry

    class Fake:
        started: list = []

        def __init__(self, spec):
            self.collective_timeout_s, self.alive = spec.timeout_s + 5, True

        def start(self):
            Fake.started.append(self)
            return self

        def close(self, kill=False):
            self.alive = False

    monkeypatch.setattr(opening, "REGISTRY", WorldRegistry())
    monkeypatch.setitem(opening.KINDS, launcher.FORKED, Fake)
    first = opening.open_world(launcher.forked_spec(4, timeout_s=60))
    assert opening.open_world(launcher.forked_spec(4, timeout_s=30)) is first
    longer = opening.open_world(launcher.forked_spec(4, timeout_s=600))
    assert longer is not first and not first.alive and longer.collective_timeout_s == 605
    assert opening.open_world(launcher.forked_spec(4, timeout_s=120)) is longer
    assert len(Fake.started) == 2


def test_slurm_poll_and_result_wait_come_from_the_environment_or_are_refused(monkeypatch):
    """``BCASTBENCH_SLURM_POLL_S`` and ``BCASTBENCH_SLURM_RESULT_WAIT_S`` tune how fast a
    Slurm sweep notices a failed job; a value that is not a number of seconds is refused by
    name, with what was expected."""
    slurm = pytest.importorskip("submitit.slurm.slurm")
    monkeypatch.setattr(slurm.SlurmJob.watcher, "_delay_s", slurm.SlurmJob.watcher._delay_s)
    monkeypatch.setattr(slurm.SlurmJob, "_results_timeout_s", slurm.SlurmJob._results_timeout_s)
    monkeypatch.setenv("BCASTBENCH_SLURM_POLL_S", "2")
    monkeypatch.setenv("BCASTBENCH_SLURM_RESULT_WAIT_S", "1.5")
    launcher.prompt_slurm_failures()
    assert (slurm.SlurmJob.watcher._delay_s, slurm.SlurmJob._results_timeout_s) == (2.0, 1.5)
    for bad in ("abc", "-1", "nan", ""):
        monkeypatch.setenv("BCASTBENCH_SLURM_RESULT_WAIT_S", bad)
        with pytest.raises(ConfigError, match="BCASTBENCH_SLURM_RESULT_WAIT_S=.*expected a number"):
            launcher.prompt_slurm_failures()


def test_a_slurm_jobs_rendezvous_port_is_below_the_ephemeral_ports(monkeypatch):
    """Both Slurm paths (plain srun, submitit) take the port from the job and step ids, below
    where Linux's ephemeral ports begin: submitit's own choice for array task "3_0" is 59734,
    which an outgoing connection on a busy node can hold (a fresh-clone run lost a job to it)."""
    from harness.worlds.joined import PORT_BASE, PORT_SPAN, export_rendezvous, job_port

    ports = {
        job_port({"SLURM_JOB_ID": str(j), "SLURM_STEP_ID": str(s)}) for j in (4, 5) for s in (0, 1)
    }
    assert len(ports) == 4 and all(PORT_BASE <= p < PORT_BASE + PORT_SPAN <= 32768 for p in ports)
    # submitit's local executor: no Slurm ids; two local jobs at once (their controllers' pids)
    # get ports of their own, in the same range.
    local = {job_port({"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": str(pid)})
             for pid in (4242, 4243)}  # fmt: skip
    assert len(local) == 2 and all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in local)
    slurm = {"SLURM_JOB_ID": "5", "SLURM_ARRAY_JOB_ID": "3", "SLURM_ARRAY_TASK_ID": "1",
             "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
             "SLURM_JOB_NODELIST": "vm", "SLURM_STEP_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1",
             "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_ID": "0", "SUBMITIT_EXECUTOR": "slurm"}  # fmt: skip
    exported = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    for key in (*exported, "MASTER_PORT"):
        # Set, then removed: monkeypatch restores only what it touched, and submitit's export
        # writes all of these into this process's environment (every later subprocess's too).
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    export_rendezvous(Launch(JOINED, "submitit", 2))
    assert os.environ["MASTER_PORT"] == str(job_port(slurm)), os.environ["MASTER_PORT"]
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "2")
    for bad in ("abc", "0", "70000", ""):
        for key in exported:
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("MASTER_PORT", bad)
        with pytest.raises(RuntimeError, match=f"MASTER_PORT='{bad}': expected a TCP port"):
            export_rendezvous(Launch(JOINED, "submitit", 2))
