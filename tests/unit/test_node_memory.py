"""The node's memory, without a process group: what /proc says of a known allocation, the
sampler, the phase's fold into node figures, each strategy's footprint, the memory model's
arithmetic and the refusal it makes before a job starts."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

import strategies
from harness.job.fits import fitted, footprints
from harness.job.label import Label
from harness.job.node_memory import NodeMemory, Sampler, resident
from harness.job.results import RankResult
from harness.job.spec import JobSpec
from harness.model import memory
from harness.worlds.forked_answers import exit_reason
from strategies.core.footprint import Footprint
from strategies.core.layout import Layout

MIB = 2**20


def fresh_pages(nbytes: int):
    """``nbytes`` of anonymous memory mapped anew and written (every page resident), never
    pages the heap already holds (a freed block reused would add nothing to the resident set);
    the mapping and an array over it."""
    mapping = mmap.mmap(-1, nbytes)
    block = np.frombuffer(mapping, dtype=np.uint8)
    block[:] = 1
    return mapping, block


def test_resident_counts_a_known_allocation():
    before = resident()
    mapping, block = fresh_pages(64 * MIB)
    after = resident()
    # The block is a shared anonymous mapping, so its pages are the PSS's shared part. The whole
    # PSS also moves when another process maps or unmaps the libraries this one shares (a test
    # session starting beside this one), by more than a tenth of the block: read the block's.
    assert after.pss_shmem - before.pss_shmem >= 0.9 * block.nbytes
    assert after.rss - before.rss >= 0.9 * block.nbytes
    del block
    mapping.close()


def test_a_watched_strategy_is_read_apart_from_what_the_others_keep(monkeypatch):
    """``Watch``'s arithmetic on scripted reads: each call's peak above what the rank held when
    it began, plus what the strategy itself kept from its earlier calls (or was credited);
    what the others keep, and grow between its calls, is in none of its figures."""
    from types import SimpleNamespace

    import torch

    from harness.job import node_memory as nm

    reads = iter([])
    monkeypatch.setattr(nm, "resident", lambda: next(reads))
    monkeypatch.setattr(nm, "rss_now", lambda: 0)
    monkeypatch.setattr(nm, "rss_peak", lambda: 0)
    monkeypatch.setattr(nm, "rss_peak_reset", lambda: True)
    monkeypatch.setattr(nm, "release_free_heap", lambda full=False: True)

    def at(mib):
        return nm.Resident(pss=mib * MIB, rss=mib * MIB, pss_shmem=0)

    def sampled(peak_mib):
        return SimpleNamespace(peak=at(peak_mib), mean_interval_s=0.004)

    idle = at(1000)  # the job's batches and the harness
    watch = nm.Watch(torch.device("cpu"), idle, 0)
    # First call: the others keep 300 MiB; the call peaks 500 above that and keeps 200.
    reads = iter([at(1300), at(1500)])
    watch.begin("s")
    watch.end(sampled(1800))
    # The others grew by 100 before its second call, which peaks 400 above and keeps nothing.
    reads = iter([at(1600), at(1600)])
    watch.begin("s")
    watch.end(sampled(2000))
    # A raw method credited the 250 MiB packed buffer the harness shares: its call adds 100.
    reads = iter([at(1600), at(1600)])
    watch.begin("raw", credit=250 * MIB)
    watch.end(sampled(1700))
    entry = watch.results()["node_memory"]
    assert entry["s"]["peak_pss"] == (1000 + 600) * MIB  # 200 kept + the second call's 400
    assert entry["s"]["kept_pss"] == (1000 + 200) * MIB and entry["s"]["idle_pss"] == idle.pss
    assert entry["raw"]["peak_pss"] == (1000 + 350) * MIB
    assert entry["raw"]["kept_pss"] == (1000 + 250) * MIB


def test_the_sampler_sees_a_peak_that_is_gone_by_the_end():
    """A block allocated and freed inside the window: the samples taken while it lived (the
    wait is for samples, not for a clock) hold it. Read as shared memory (the block is a
    shared anonymous mapping): the process's whole PSS also moves when another process maps
    or unmaps the libraries it shares (another test session starting a world), by more than
    the block."""
    base = resident().pss_shmem
    with Sampler(interval_s=0.001) as sampler:
        mapping, block = fresh_pages(32 * MIB)
        seen = sampler.samples
        while sampler.samples < seen + 3:
            np.add(block[:4096], 0, out=block[:4096])  # keep the block alive meanwhile
        del block
        mapping.close()
    assert sampler.peak.pss_shmem - base >= 0.9 * 32 * MIB
    assert sampler.taken == 0 and sampler.mean_interval_s >= 0.001


def test_a_block_takes_a_read_where_it_knows_the_peak():
    base = resident().pss_shmem  # as above: shared libraries' PSS moves with other processes
    with Sampler(interval_s=3600) as sampler:  # the thread never reads in time
        mapping, block = fresh_pages(16 * MIB)
        sampler.take()
        del block
        mapping.close()
    assert sampler.taken == 1 and sampler.peak.pss_shmem - base >= 0.9 * 16 * MIB


def _rank(rank: int, leader: bool, idle: int, peak: int, kept: int, host="h", shm=0):
    memory = {"s": {"host": host, "idle_pss": idle, "peak_pss": peak, "peak_shm": shm,
                    "hwm": peak + 7, "kept_pss": kept}}  # fmt: skip
    return RankResult(rank, leader, payload_bytes=100 * MIB if leader else None,
                      node_memory=memory, base_pss_bytes=idle - (100 * MIB if leader else 0))  # fmt: skip


def test_the_fold_sums_a_node_and_counts_copies_in_batches():
    """Leader: idle 150 MiB (its batch in it), peak 350 (a 200 MiB segment); receiver idle
    50, peak 150 (its own copy): 1 + (500 - 200) / 100 = 4 copies; the harness holds the batch."""
    results = [
        _rank(0, True, 150 * MIB, 350 * MIB, 350 * MIB, shm=200 * MIB),
        _rank(1, False, 50 * MIB, 150 * MIB, 50 * MIB),
    ]
    figures = NodeMemory().fold(None, "s", results)
    assert figures.node_peak_bytes == 500 * MIB and figures.node_idle_bytes == 200 * MIB
    assert figures.node_copies == 4.0 and figures.harness_copies == 1.0
    assert figures.node_kept_bytes == 200 * MIB and figures.node_shm_bytes == 200 * MIB
    assert figures.rank_peak_bytes == 350 * MIB + 7 and figures.node_ranks == 2


def test_the_fold_takes_the_busiest_node():
    results = [
        _rank(0, True, 150 * MIB, 250 * MIB, 150 * MIB, host="a"),
        _rank(1, False, 50 * MIB, 60 * MIB, 50 * MIB, host="a"),
        _rank(2, False, 50 * MIB, 400 * MIB, 50 * MIB, host="b"),
    ]
    figures = NodeMemory().fold(None, "s", results)
    assert figures.node_ranks == 1 and figures.node_peak_bytes == 400 * MIB
    assert figures.node_copies == 3.5  # no leader there: (400 - 50) / 100


def test_a_footprint_counts_shared_memory_once_per_node():
    shm = Footprint(leader=0, receiver=0, node=2)
    assert shm.node_copies(leaders=1, receivers=7) == 3  # the batch and two slots
    assert shm.node_copies(leaders=1, receivers=0) == 1  # a replica of one maps nothing
    flat = Footprint(leader=1, receiver=1, leader_kept=1)
    assert flat.node_copies(1, 7) == 9 and flat.kept_copies(1, 7) == 1
    with pytest.raises(ValueError, match=r"leader_kept \(2\) > leader \(1\)"):
        Footprint(leader=1, leader_kept=2)
    with pytest.raises(ValueError, match="receiver must be >= 0"):
        Footprint(receiver=-1)


def test_every_strategy_declares_a_footprint():
    for name in strategies.names(include_floor=True):
        assert isinstance(strategies.get_class(name).footprint, Footprint), name


def test_the_busiest_node_of_a_large_layout():
    """16k ranks, 8 a node, TP 8: every node holds one leader and seven receivers."""
    layout = Layout(dp=2048, tp=8)
    assert memory.busiest_node(layout, 8) == memory.NodeShare(1, 7)
    assert memory.busiest_node(Layout(tp=2, pp=2)) == memory.NodeShare(1, 3)


def test_a_job_holds_every_kept_part_and_one_peak():
    node = memory.NodeShare(1, 1)
    fps = {"a": Footprint(leader=1, receiver=1, leader_kept=1), "b": Footprint(0, 3)}
    base = memory.base_bytes(node, 100 * MIB)
    assert base == 2 * memory.RANK_BASE_BYTES + int((1 + memory.HARNESS_COPIES) * 100 * MIB)
    # kept: a's buffer (1) and a receiver's heap after its largest call (b's 3); the largest
    # peak above what its strategy keeps: b's receiver (3); the job's own slack
    copies = 7 + memory.JOB_SLACK_COPIES
    assert memory.job_need(fps, node, 100 * MIB) == base + int(copies * 100 * MIB)
    assert memory.strategy_need(fps["a"], node, 100 * MIB) == base + 2 * 100 * MIB


def test_a_job_that_does_not_fit_is_refused_in_one_line_with_its_bytes():
    node = memory.NodeShare(1, 1)
    fps = {"pickled": strategies.get_class("pickled").footprint}
    assert memory.refusal("job x", fps, node, MIB, 64 * 2**30) is None
    line = memory.refusal("job x", fps, node, 2**30, 4 * 2**30)
    assert line.startswith("memory: job x needs ") and "\n" not in line
    assert "this host has available" in line and "pickled" in line and "batch_size" in line


def _spec(**kw) -> JobSpec:
    refs = tuple(strategies.names_for_world("forked")) + ("floor",)
    return JobSpec(strategy="shm", layout=Layout(tp=2), references=refs, **kw)


def test_the_floors_methods_keep_one_buffer_between_them():
    fps = footprints(_spec())
    floors = [fp for name, fp in fps.items() if Label.parse(name).is_floor]
    assert len(floors) > 1 and sum(fp.leader_kept for fp in floors) == 1


def test_a_job_too_large_leaves_references_out_and_a_cell_too_large_is_refused():
    spec = _spec(batch_size=5689, seq_len=4096)  # 1 GiB
    fits = fitted(spec, True, available=16 * 2**30)
    assert isinstance(fits, JobSpec) and fits.left_out
    assert "shm" not in dict(fits.left_out) and "floor" in fits.references
    for name, line in fits.left_out:
        assert name not in fits.references and line.startswith(
            f"memory: job shm on tp2 with {name}"
        )
    assert fitted(spec, True, available=64 * 2**30) == spec  # room for all
    assert fitted(spec, False, available=1) == spec  # ranks elsewhere: not priced here
    refused = fitted(spec, True, available=2 * 2**30)
    assert isinstance(refused, str) and refused.startswith("memory: job shm on tp2 needs")


def test_a_rank_killed_by_sigkill_is_named_as_the_oom_killers():
    said = exit_reason(-9)
    assert "signal 9 (SIGKILL)" in said and "OOM killer" in said and "MemAvailable" in said
    assert exit_reason(-15) == "was killed by signal 15 (SIGTERM)"
    assert exit_reason(3) == "exited with code 3"


def _records(copies: dict[str, float], payload: int = 256 * MIB):
    import pandas as pd

    node = memory.busiest_node(Layout(tp=2))
    rows = []
    for name, c in copies.items():
        measured = memory.base_bytes(node, payload) + (c - 1) * payload
        rows.append(dict(status="ok", layout="tp2", dp=1, pp=1, tp=2, cp=1, world_size=2,
                         payload_bytes=payload, strategy=name, node_copies=c,
                         node_peak_bytes=measured, harness_copies=1.0, node_ranks=2))  # fmt: skip
    return pd.DataFrame(rows)


def test_the_report_lists_copies_and_the_models_error():
    from harness.report.memory_section import memory_markdown, memory_table

    # shm's footprint says 2 copies on two ranks, flat's 1 + 1 + 1: measured exactly so.
    df = _records({"shm": 2.0, "flat": 3.0})
    table = memory_table(df)
    assert list(table["model_error"].round(6)) == [0.0, 0.0]
    text = memory_markdown(df)
    assert "## Memory on the node" in text and "| shm | 2.00 |" in text
    assert "median error of 0% over 2 points (within the 15% target)" in text


def test_the_report_has_no_memory_section_without_node_memory():
    import pandas as pd

    from harness.report.memory_section import memory_markdown

    assert memory_markdown(pd.DataFrame([{"status": "ok", "strategy": "shm"}])) == ""


def test_the_largest_batch_a_host_holds():
    from harness.report.memory_section import largest_batch_bytes

    host = 100 * 2**30
    room = 0.8 * host - 2 * memory.RANK_BASE_BYTES
    assert largest_batch_bytes(2.0, 2, host) == int(room / (2.0 + memory.HARNESS_COPIES))
    assert largest_batch_bytes(2.0, 2, 1) == 0
