"""A node's memory priced before a job allocates anything: each strategy's ``Footprint``
(copies of the batch by where they live, ``strategies.core.footprint``) times the batch's
bytes, plus what every rank and the harness hold anyway. Pure: no process, no batch.

A job that interleaves several strategies holds what each keeps between calls at once, and one
call's peak above that at a time: ``job_need`` is the sum of the kept parts plus the largest
peak. ``strategy_need`` is one strategy alone (the node memory phase measures that, and
``bcastbench predict`` prints it); ``refusal`` says, in one line, when a job would not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.units import human_bytes
from strategies.core.footprint import Footprint

RANK_BASE_BYTES = 115 * 2**20
"""One rank's proportional set with torch, megatron-core and its gloo groups up and no batch
(the node memory phase's idle figure less the harness's copies, per rank: the median over
results/large_reference)."""

HARNESS_COPIES = 0.05
"""What the harness keeps on a leader's node beyond the batch itself, in batches (fingerprints,
the meta data): the phase's ``harness_copies`` less one, rounded up."""

JOB_SLACK_COPIES = 0.5
"""What a running job may hold beyond its strategies' footprints, per leader, in batches
(generation's and verification's transients, pages the heap has not handed back): counted
when a job is priced against the host, not in one strategy's need."""

MARGIN = 0.20
"""The part of the host's available memory a job leaves free (page cache, the driver, a
sampling miss): a job is refused above ``(1 - MARGIN) * available``."""


@dataclass(frozen=True)
class NodeShare:
    """Who of a layout sits on its busiest node: replica leaders and the other ranks."""

    leaders: int
    receivers: int

    @property
    def ranks(self) -> int:
        return self.leaders + self.receivers


def busiest_node(layout, ranks_per_node: int | None = None) -> NodeShare:
    """The node with the most ranks of a layout whose ranks fill nodes of ``ranks_per_node`` in
    rank order (None: one node holds the world, as a forked world does)."""
    per_node = ranks_per_node or layout.world_size
    leaders = {group[0] for group in layout.replica_groups()}
    best = NodeShare(0, 0)
    for start in range(0, layout.world_size, per_node):
        ranks = range(start, min(start + per_node, layout.world_size))
        mine = sum(r in leaders for r in ranks)
        share = NodeShare(mine, len(ranks) - mine)
        if (share.ranks, share.leaders) > (best.ranks, best.leaders):
            best = share
    return best


def base_bytes(node: NodeShare, payload_bytes: int) -> int:
    """A node's memory before any call: every rank's base, each leader's batch and the
    harness's own copies beside it."""
    return int(node.ranks * RANK_BASE_BYTES + node.leaders * (1 + HARNESS_COPIES) * payload_bytes)


def strategy_need(footprint: Footprint, node: NodeShare, payload_bytes: int) -> int:
    """The node's predicted peak with one strategy alone (what ``node_peak_bytes`` measures)."""
    above = footprint.node_copies(node.leaders, node.receivers) - node.leaders
    return base_bytes(node, payload_bytes) + int(above * payload_bytes)


def job_need(footprints: dict[str, Footprint], node: NodeShare, payload_bytes: int) -> int:
    """The node's predicted peak for a job interleaving ``footprints`` (every strategy it
    builds, by name): what each keeps between calls, all at once, plus the largest call's
    peak above what that strategy keeps. A receiver's heap keeps what its largest call
    allocated once it has let the batch go (measured: a receiver's resident set stays near
    its largest call's), so that is counted as kept too when the job holds several
    strategies."""
    kept = {name: fp.kept_copies(node.leaders, node.receivers) for name, fp in footprints.items()}
    peaks = [
        fp.node_copies(node.leaders, node.receivers) - node.leaders - kept[name]
        for name, fp in footprints.items()
    ]
    heap = max((fp.receiver for fp in footprints.values()), default=0.0) * node.receivers
    copies = sum(kept.values()) + max(peaks, default=0.0) + node.leaders * JOB_SLACK_COPIES
    if len(footprints) > 1:
        copies += heap
    return base_bytes(node, payload_bytes) + int(copies * payload_bytes)


def refusal(
    what: str, footprints: dict[str, Footprint], node: NodeShare, payload_bytes: int,
    available_bytes: int,
) -> str | None:  # fmt: skip
    """One line saying a job would not fit (None: it fits): the job, the predicted and the
    available bytes, who needs most and what to change."""
    need = job_need(footprints, node, payload_bytes)
    room = int((1 - MARGIN) * available_bytes)
    if need <= room:
        return None
    alone = {name: strategy_need(fp, node, payload_bytes) for name, fp in footprints.items()}
    biggest = sorted(alone, key=alone.get, reverse=True)[:3]
    largest = ", ".join(f"{n} {human_bytes(alone[n])}" for n in biggest)
    return (
        f"memory: {what} needs {human_bytes(need)} on its busiest node ({node.ranks} ranks, "
        f"{node.leaders} holding a {human_bytes(payload_bytes)} batch) > "
        f"{human_bytes(room)} ({1 - MARGIN:.0%} of the {human_bytes(available_bytes)} this "
        f"host has available); alone the largest need {largest}: lower payload.batch_size or "
        "seq_len, or time fewer references in one job"
    )
