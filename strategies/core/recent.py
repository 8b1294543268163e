"""Bounded memories of what was seen recently: one helper for every cache of the header path
(layouts, encoded and decoded headers, view plans, validated structures) and ``auto``'s
choices, so a run of ever-new shapes keeps each of them small; and ``NextShape``, the next
call's shape predicted from the calls so far (``auto``'s choice, shm's guessed header).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

RECENT_SHAPES = 8
"""Batch shapes the header path remembers (layouts, headers, view plans, validated
structures): a step whose calls cycle through a few shapes (a rollout batch then micro-batches,
uneven replicas) sets each one up once, not on every change of shape."""


def remember(table: dict, key, value, keep: int = RECENT_SHAPES) -> None:
    """``table[key] = value`` as its most recent entry (a dict keeps insertion order); the
    oldest beyond ``keep`` go."""
    table.pop(key, None)
    table[key] = value
    while len(table) > keep:
        del table[next(iter(table))]


class NextShape:
    """The shape the next call will move, predicted from the shapes of the calls so far: the
    one that followed the current shape the last time it was seen, else the current one again.
    Pure bookkeeping over what every rank of a replica saw alike, so every rank predicts the
    same; the last ``KEEP`` shapes are remembered (a stream of ever-new shapes stays bounded)."""

    KEEP = 64

    def __init__(self) -> None:
        self.follows: OrderedDict[Hashable, Hashable] = OrderedDict()
        self.previous: Hashable | None = None

    def observe(self, key: Hashable) -> Hashable:
        """Record that a call moved ``key``; return the prediction for the next call."""
        if self.previous is not None:
            remember(self.follows, self.previous, key, self.KEEP)
        self.previous = key
        return self.follows.get(key, key)
