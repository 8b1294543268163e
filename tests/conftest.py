"""Shared fixtures: one persistent gloo world of 4 and one of 8 ranks for the whole session.

Worlds start on first use (a test run that needs none starts none) and close at session end;
a test that tears its world down (a rank crashed or hung) gets a fresh one for the next test.
They live in the registry of live worlds (``harness.worlds.protocol.REGISTRY``), so an in-process
``bcastbench run`` of the same size reuses them too.
"""

from __future__ import annotations

import os

import pytest
import torch

# Worlds are forked from this process: keep it single-threaded from the first test on, or a
# fork after a multi-threaded OpenMP region can deadlock a rank (see harness/worlds/forked.py).
torch.set_num_threads(1)

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SLURM_JOB_ID", "SLURM_PROCID", "TORCHELASTIC_RUN_ID")  # fmt: skip
"""Variables that make a process (and every command a later test starts) believe it is a rank
of a launched world."""


@pytest.fixture(autouse=True)
def _no_launcher_variables_left():
    """A test that leaves a launcher's variables in this process's environment fails by name,
    rather than every later command failing as a rank of a world that does not exist."""
    before = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    yield
    left = {k: os.environ.get(k) for k in LAUNCHER_VARS if os.environ.get(k) != before[k]}
    assert not left, f"the test left launcher variables in the environment: {left}"


WORLD_TIMEOUT_S = 120.0
"""No-progress limit for jobs on the session worlds: every job here takes well under a second
on a quiet machine; the margin is for loaded CI runners."""


def _session_world(n: int):
    """The run path's forked world of ``n`` from the one registry of live worlds, as a handle
    that starts it again when an earlier test tore it down."""
    # Imported here: harness.worlds.launcher is light, the forked world it starts pulls in
    # megatron-core, which tier-1 runs do not need.
    from harness.worlds.launcher import forked_spec
    from harness.worlds.opening import reused_world

    # Started now, as the session's first test that asks for it expects.
    world = reused_world(forked_spec(n, timeout_s=WORLD_TIMEOUT_S)).start()
    try:
        yield world
    finally:
        world.close()


@pytest.fixture(scope="session")
def world4():
    """A running 4-rank gloo world, shared by every test of the session."""
    yield from _session_world(4)


@pytest.fixture(scope="session")
def world8():
    """A running 8-rank gloo world, shared by every test of the session."""
    yield from _session_world(8)


# -- one Slurm cluster for the session ---------------------------------------------------------
def skip_or_fail(reason: str) -> None:
    """Skip a test the machine cannot host; BCB_REQUIRE_INFRA=1 makes that a failure."""
    if os.environ.get("BCB_REQUIRE_INFRA") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A single-node Slurm with accounting (tests/infra/slurm.py), started on first use and
    stopped by PID at session end: the smoke tests and the harness's Slurm sweep share it,
    since standing up munge, MariaDB and three daemons is the slow part."""
    from infra.slurm import SlurmCluster, SlurmUnavailable

    if os.geteuid() != 0:
        skip_or_fail("a Slurm cluster for tests needs root")
    try:
        cluster = SlurmCluster().__enter__()
    except SlurmUnavailable as exc:
        skip_or_fail(f"Slurm unavailable: {exc}")
    try:
        yield cluster
    finally:
        cluster.__exit__(None, None, None)
    for name, pid in cluster.pids.items():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"{name} (pid {pid}) still running after the cluster stopped")


# -- batches every rank can rebuild from a small spec -------------------------------------------
# A spec is plain tuples and dicts (cheap to pickle to every rank); ``build_batch(spec, B, seed)``
# gives the same DataProto on every rank, so a receiver checks its result against its own copy
# and no expected data has to travel.
