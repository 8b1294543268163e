"""What a strategy keeps resident, in copies of the replica's batch: the arithmetic a harness
uses to predict a node's memory before a job allocates anything (``harness.model.memory``), and
the claim the node memory phase checks (``harness.job.node_memory``).

Counted beyond the leader's own batch (the caller's, one copy before any call): private copies
on the leader and on each receiver at a call's peak, shared-memory copies once per node (a
segment mapped by every rank of the node is one copy there), and what of it stays between calls
(a pack buffer, a segment's slots), which adds up when one job holds several strategies.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Footprint:
    """Copies of the batch one call of a strategy holds at its peak, by where they live."""

    leader: float = 1.0
    """Private to the replica leader: a packed buffer, a pickle, a staged copy."""
    receiver: float = 1.0
    """Private to each receiver: the received bytes, and a rebuilt batch where it copies."""
    node: float = 0.0
    """In shared memory, once on each node the replica reaches: a segment's slots (kept)."""
    leader_kept: float = 0.0
    """The part of ``leader`` still held once the call returned (a buffer reused next call)."""

    def __post_init__(self) -> None:
        for name in ("leader", "receiver", "node", "leader_kept"):
            if getattr(self, name) < 0:
                raise ValueError(f"Footprint.{name} must be >= 0, got {getattr(self, name)}")
        if self.leader_kept > self.leader:
            raise ValueError(
                f"Footprint.leader_kept ({self.leader_kept}) > leader ({self.leader}): what is "
                "kept between calls is part of the call's peak"
            )

    def node_copies(self, leaders: int, receivers: int) -> float:
        """Copies resident on a node holding ``leaders`` replica leaders and ``receivers``
        other ranks of those replicas, at one call's peak (the leaders' batches included)."""
        shared = self.node if leaders + receivers > 1 else 0.0
        return leaders * (1 + self.leader) + receivers * self.receiver + shared

    def kept_copies(self, leaders: int, receivers: int) -> float:
        """What stays on that node between calls, beyond the leaders' batches."""
        shared = self.node if leaders + receivers > 1 else 0.0
        return leaders * self.leader_kept + shared
