"""Raw collectives timed as a job's strategies: ``probe:<kind>:<group size>:<bytes>`` names one
broadcast, scatter or all_gather of a uint8 buffer over the world's first ranks, so the cost
model's calibration (``bcastbench calibrate``) times its samples through the same rounds,
clock and checks as every job (``harness.job.execute.run_job``) instead of rounds of its own.

A probe takes the entry state and moves its own buffer (no header, no packing: the bytes
alone, as the α–β model counts them); ranks outside its group take no part. Its received
bytes are checked against what this rank must hold (``expected_received``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.job.label import PROBE, Label

KINDS = ("broadcast", "scatter", "all_gather")


def probe_name(kind: str, group_size: int, payload_bytes: int) -> str:
    """The name a calibration job times a probe under."""
    return str(Label.of(PROBE, kind, group_size, payload_bytes))


def is_probe(name: str) -> bool:
    return Label.parse(name).is_probe


@dataclass(frozen=True)
class ProbeShape:
    """What a probe moves: ``kind`` over the first ``group_size`` ranks, ``payload_bytes`` in
    nccl-tests' sense (a broadcast's bytes; a scatter's or all_gather's total over the group)."""

    kind: str
    group_size: int
    payload_bytes: int

    @classmethod
    def parse(cls, name: str, world_size: int) -> ProbeShape:
        label = Label.parse(name)
        parts = label.method_parts()
        if not label.is_probe or len(parts) != 3 or parts[0] not in KINDS:
            raise ValueError(f"{name!r}: expected probe:<{'|'.join(KINDS)}>:<ranks>:<bytes>")
        shape = cls(parts[0], int(parts[1]), int(parts[2]))
        if not 2 <= shape.group_size <= world_size or shape.payload_bytes < 1:
            raise ValueError(
                f"{name!r}: a group of 2..{world_size} ranks and at least 1 byte, got "
                f"{shape.group_size} ranks and {shape.payload_bytes} bytes"
            )
        return shape

    @property
    def chunk_bytes(self) -> int:
        """One rank's share of a scatter or all_gather (the model's ``Comm.nbytes``)."""
        return max(1, self.payload_bytes // self.group_size)


class Probe:
    """One raw collective, callable as a strategy (``get_data_input``) by a broadcast job."""

    raw_bytes = False

    def __init__(self, shape: ProbeShape, rank: int, group) -> None:
        self.shape, self.rank, self.group = shape, rank, group
        self.member = rank < shape.group_size
        chunk, p = shape.chunk_bytes, shape.group_size
        if shape.kind == "broadcast":
            self.sent = torch.full((shape.payload_bytes,), 7, dtype=torch.uint8)
            self.received = self.sent if rank == 0 else torch.zeros_like(self.sent)
        elif shape.kind == "scatter":
            self.chunks = [torch.full((chunk,), i, dtype=torch.uint8) for i in range(p)]
            self.received = torch.zeros(chunk, dtype=torch.uint8)
        else:
            self.mine = torch.full((chunk,), rank % 256, dtype=torch.uint8)
            self.gathered = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(p)]
            self.received = self.gathered[0]

    def prepare(self, entry) -> None:
        """Nothing to size per batch: a probe moves its own buffer."""

    def get_data_input(self, entry):
        """The collective on this rank (nothing off the group); the entry state back."""
        if not self.member:
            return entry
        kind = self.shape.kind
        if kind == "broadcast":
            dist.broadcast(self.received, src=0, group=self.group)
        elif kind == "scatter":
            dist.scatter(self.received, self.chunks if self.rank == 0 else None, src=0,
                         group=self.group)  # fmt: skip
        else:
            dist.all_gather(self.gathered, self.mine, group=self.group)
            self.received = torch.cat(self.gathered)
        return entry

    def expected_received(self) -> torch.Tensor:
        """What this rank must hold after a call (off the group: what it already holds)."""
        if not self.member:
            return self.received
        chunk, p = self.shape.chunk_bytes, self.shape.group_size
        if self.shape.kind == "broadcast":
            return torch.full((self.shape.payload_bytes,), 7, dtype=torch.uint8)
        if self.shape.kind == "scatter":
            return torch.full((chunk,), self.rank, dtype=torch.uint8)
        return torch.cat([torch.full((chunk,), r % 256, dtype=torch.uint8) for r in range(p)])


def build_probe(name: str, ctx) -> Probe:
    """The probe ``name`` on this rank; its group (the world's first ranks) made once per size
    and kept in the rank's cache (``new_group`` is collective: every rank builds the job's
    probes in the same order)."""
    shape = ProbeShape.parse(name, ctx.world_size)
    groups = ctx.cache.setdefault(("probe_groups", None), {})
    if shape.group_size not in groups:
        whole = shape.group_size == ctx.world_size
        groups[shape.group_size] = None if whole else dist.new_group(range(shape.group_size))
    return Probe(shape, ctx.rank, groups[shape.group_size])
