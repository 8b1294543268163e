"""Bounded memories of what was seen recently: one helper for every cache of the header path
(layouts, encoded and decoded headers, view plans, validated structures) and ``auto``'s
choices, so a run of ever-new shapes keeps each of them small.
"""

from __future__ import annotations

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
