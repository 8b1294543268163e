"""The node channel's ring of segments: memfds the node leader maps shared and packs into, and
its readers map copy-on-write; a slot a reader still holds is retired, never overwritten.

Segments are memfds (``os.memfd_create``): anonymous, never named in /dev/shm, so nothing is
left behind by any ending, kill -9 included: the kernel frees a segment with the last process
that holds it. Python's resource tracker never sees them (no ``multiprocessing.shared_memory``).

The ring: ``slots`` segments used in turn. A reader maps the segment copy-on-write
(``MAP_PRIVATE``) for every message, so the batch it returns is its own (writing to it never
reaches the other ranks or the segment) while no byte is copied, and it holds that mapping
for as long as any tensor of the batch lives; when the last one dies, a finalizer reports the
release. The leader writes into a slot only when every reader has released the message it
held; a slot some reader still holds is retired instead (the leader drops its mapping and
makes a new segment for the slot; the holder keeps the old one until it lets go), so the
leader never waits for a reader and never overwrites bytes a reader views.
"""

from __future__ import annotations

import mmap
import os
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from strategies.core.node_signals import ShmError
from strategies.core.packer import Packer

REUSE_MIN_BYTES = 32 * 2**20
"""From a message this large on, the writer writes the next one into the same slot when its
readers have let it go, instead of taking the next slot in turn: a ring of large slots keeps
one copy of the batch resident instead of one per slot (three), and a slot's pages are faulted
in once. Below it the turn stays (readers map the next slot while they wait); readers guess the
same rule from the last message's size."""


def reuses(last_nbytes: int) -> bool:
    """Whether the message after one of ``last_nbytes`` goes into the same slot when free."""
    return last_nbytes >= REUSE_MIN_BYTES


@dataclass
class Segment:
    """One memfd and the writer's shared mapping of it."""

    fd: int
    capacity: int
    generation: int
    mapping: mmap.mmap
    view: torch.Tensor

    @classmethod
    def make(cls, capacity: int, generation: int) -> Segment:
        fd = os.memfd_create("bcastbench-shm", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(capacity, 1))
            mapping = mmap.mmap(fd, max(capacity, 1), flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        view = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8, count=capacity))
        return cls(fd, capacity, generation, mapping, view)

    def close(self) -> None:
        """Drop the writer's hold (readers that map it keep their own)."""
        self.view = None  # type: ignore[assignment]
        try:
            self.mapping.close()
        except BufferError:  # a tensor of it is still alive: the mapping goes with it
            pass
        os.close(self.fd)


@dataclass
class Slot:
    """One place of the ring on the writer: its current segment and who still holds it."""

    index: int
    segment: Segment | None = None
    generation: int = 0
    sequence: int = -1
    holders: set[int] = field(default_factory=set)
    """Readers (global ranks) that have not released this slot's last message."""
    delivered: set[int] = field(default_factory=set)
    """Readers that have this segment's fd."""
    packer: Packer = field(init=False)
    """Packs a batch straight into this slot's segment (its allocator makes the segments)."""

    def __post_init__(self) -> None:
        self.packer = Packer(allocate=self.allocate)

    def buffer(self, capacity: int) -> torch.Tensor:
        """A shared view of at least ``capacity`` bytes: the current segment, or a new one
        (readers get its fd with the next signal)."""
        if self.segment is None or self.segment.capacity < capacity:
            self.retire()
            self.generation += 1
            self.segment = Segment.make(capacity, self.generation)
        return self.segment.view

    def allocate(self, capacity: int, device: torch.device) -> torch.Tensor:
        """``Packer``'s allocator: a new segment of exactly ``capacity`` bytes (host memory:
        only host groups pack straight into it, and ``validate`` refuses a batch off the
        groups' device)."""
        self.retire()
        self.generation += 1
        self.segment = Segment.make(capacity, self.generation)
        return self.segment.view

    def retire(self) -> None:
        """Let go of the segment (and the packer's view of it): the next write makes one."""
        self.packer.forget()
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.delivered = set()
        self.holders = set()


def map_private(fd: int, nbytes: int | None, rank: int, on_release, *args) -> torch.Tensor:
    """The first ``nbytes`` of a segment (None: all of it), mapped copy-on-write, as a uint8
    tensor; ``on_release(*args)`` runs when the last tensor viewing it dies (the array the
    tensor's storage holds is what dies last)."""
    size = os.fstat(fd).st_size
    if nbytes is None:
        nbytes = size
    if nbytes > size or nbytes == 0:
        raise ShmError(
            f"rank {rank}: shm: a message of {nbytes} bytes announced for a {size}-byte segment"
        )
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    array = np.frombuffer(mapping, dtype=np.uint8)
    weakref.finalize(array, on_release, *args)
    return torch.from_numpy(array)


@dataclass
class Premap:
    """A reader's mapping of the segment it expects the next message in (``premap``)."""

    index: int
    generation: int
    view: torch.Tensor
    """The whole segment, copy-on-write."""
    claim: list[int]
    """The sequence of the message that took this mapping, once one has: its release."""


def release_claimed(claim: list[int], report, *args) -> None:
    # A premap no message took held nothing the writer waits for; one that a message took is
    # released as that message (``report(*args, its sequence)``, the reader's ``_release``).
    if claim:
        report(*args, claim[0])
