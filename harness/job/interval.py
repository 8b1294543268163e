"""A figure's 95 % interval as one value (``Interval``), and the one place that names the record
keys it is stored under (``interval_keys``): writers and readers of records ask here instead of
spelling ``<field>_lo``/``_hi`` themselves.

A record keeps an interval flat, beside its figure, as two keys: ``vs_floor`` has
``vs_floor_lo``/``vs_floor_hi``; a figure whose name ends in its unit keeps the unit last
(``p50_us`` has ``p50_lo_us``/``p50_hi_us``). A record without an interval holds None in both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

LEVEL = 0.95
"""The coverage every interval of the harness is computed for (``harness.job.stats``)."""
UNITS = ("_us", "_ms")
"""Unit suffixes an interval's keys keep last (``p50_us`` -> ``p50_lo_us``)."""
ENDS = ("lo", "hi")


@dataclass(frozen=True)
class Interval:
    """The low and high end of a figure's interval, at ``level`` coverage. It unpacks as the
    pair ``(lo, hi)`` (``lo, hi = interval``; its ``len`` is 2), the shape the statistics in
    ``harness.job.stats`` compute and take."""

    lo: float
    hi: float
    level: float = LEVEL

    def __iter__(self) -> Iterator[float]:
        return iter((self.lo, self.hi))

    def __len__(self) -> int:
        return 2

    @classmethod
    def of(cls, ends, level: float = LEVEL) -> Interval | None:
        """``ends`` as an Interval: an Interval as it is, a ``(lo, hi)`` pair wrapped; None where
        there are no ends or either is missing (None or NaN)."""
        if ends is None or isinstance(ends, Interval):
            return ends
        lo, hi = ends
        if _missing(lo) or _missing(hi):
            return None
        return cls(float(lo), float(hi), level)

    def scaled(self, k: float) -> Interval:
        """The interval of the figure times ``k`` (a unit change: ``scaled(1e6)`` s -> µs)."""
        lo, hi = sorted((self.lo * k, self.hi * k))
        return Interval(lo, hi, self.level)

    def inverted(self) -> Interval:
        """The interval of 1 / the figure (a ratio turned round): its ends swap."""
        return Interval(1 / self.hi, 1 / self.lo, self.level)

    def contains(self, x: float) -> bool:
        """Whether ``x`` lies inside, ends included (a ratio's interval holding 1: a tie)."""
        return self.lo <= x <= self.hi


def widest(intervals: Iterable[Interval]) -> Interval:
    """The smallest interval that covers every one of ``intervals`` (several jobs of one cell:
    each job's own is honest, together they cover every job's answer)."""
    intervals = list(intervals)
    return Interval(min(i.lo for i in intervals), max(i.hi for i in intervals),
                    min(i.level for i in intervals))  # fmt: skip


def interval_keys(field: str) -> tuple[str, str]:
    """The record keys of ``field``'s interval, low end first: ``vs_floor`` ->
    (``vs_floor_lo``, ``vs_floor_hi``), ``p50_us`` -> (``p50_lo_us``, ``p50_hi_us``)."""
    for unit in UNITS:
        if field.endswith(unit):
            stem = field.removesuffix(unit)
            return f"{stem}_{ENDS[0]}{unit}", f"{stem}_{ENDS[1]}{unit}"
    return f"{field}_{ENDS[0]}", f"{field}_{ENDS[1]}"


def interval_end(key: str) -> str | None:
    """Which end of an interval ``key`` holds (``lo`` or ``hi``, as ``interval_keys`` names
    them); None for a key that holds no interval's end."""
    for unit in ("", *UNITS):
        if key.endswith(unit):
            stem = key.removesuffix(unit) if unit else key
            for end in ENDS:
                if stem.endswith(f"_{end}"):
                    return end
    return None


def interval_fields(field: str, interval: Interval | None) -> dict[str, float | None]:
    """What a record stores for ``field``'s interval: its two keys, None in both where there
    is no interval."""
    lo, hi = interval_keys(field)
    interval = Interval.of(interval)
    if interval is None:
        return {lo: None, hi: None}
    return {lo: interval.lo, hi: interval.hi}


def interval_of(record: Mapping, field: str) -> Interval | None:
    """``field``'s interval read back from a record (a dict, or a pandas row); None where
    either end is absent, None or NaN."""
    lo, hi = interval_keys(field)
    return Interval.of((record.get(lo), record.get(hi)))


def _missing(end) -> bool:
    if end is None:
        return True
    try:
        return math.isnan(float(end))
    except (TypeError, ValueError):  # no number (pandas' NA, a word): no end
        return True
