"""The dispatch modes' names and their parsed form (``leader:<strategy>``, ``all_ranks[:raw]``,
``rdt[:raw]``, ``cgraph[:raw]``, ``edge_stages[:raw]``, ``chain[:raw]``): what the job's config checks and its records name,
apart from the code that runs them (``harness.job.dispatch``, which imports the config and the
records)."""

from __future__ import annotations

from dataclasses import dataclass

import strategies
from harness.model.dispatch_ranks import ALL_RANKS, CGRAPH, KINDS, LEADER, RDT

UNLED = tuple(kind for kind in KINDS if kind != LEADER)
"""The families named alone, with an optional ``:raw`` (every one but ``leader``)."""
FLOORS = {LEADER: f"{LEADER}:floor", **{kind: f"{kind}:raw" for kind in UNLED}}
"""Each family's floor: the same path with the chunk as one flat uint8 array."""


@dataclass(frozen=True)
class DispatchMode:
    """One way to get the chunks to the ranks, parsed from ``leader:<strategy>`` or
    ``<family>[:raw]`` (``all_ranks``, ``rdt``, ``cgraph``, ``edge_stages``, ``chain``)."""

    kind: str
    """``leader``, ``all_ranks``, ``rdt``, ``cgraph``, ``edge_stages`` or ``chain``."""
    strategy: str | None = None
    """The broadcast strategy after a leader dispatch (``floor`` for the raw floor)."""
    raw: bool = False
    """True for a floor: the same bytes as one flat uint8 array, no DataProto."""

    @property
    def name(self) -> str:
        if self.kind == LEADER:
            return f"{LEADER}:{self.strategy}"
        return FLOORS[self.kind] if self.raw else self.kind

    @classmethod
    def parse(cls, text: str) -> DispatchMode:
        kind, _, rest = text.strip().partition(":")
        if kind == LEADER:
            if rest == "floor":
                return cls(LEADER, "floor", raw=True)
            if rest not in strategies.names():
                raise ValueError(
                    f"dispatch mode {text!r}: unknown strategy {rest!r}; after 'leader:' name one "
                    f"of {sorted(strategies.names())} or 'floor'"
                )
            return cls(LEADER, rest)
        if kind in UNLED and rest in ("", "raw"):
            return cls(kind, raw=rest == "raw")
        raise ValueError(
            f"dispatch mode {text!r}: expected 'leader:<strategy>', 'leader:floor', or one of "
            f"{list(UNLED)} with an optional ':raw'"
        )


def under_test(dispatch: str, strategy: str) -> str:
    """The mode a ``bcastbench run`` dispatch job measures: ``leader:<strategy>`` for
    ``ray.dispatch=leader``, ``all_ranks`` for ``ray.dispatch=all_ranks``."""
    return f"{LEADER}:{strategy}" if dispatch == LEADER else ALL_RANKS


def with_floors(names: tuple[str, ...] | list[str]) -> list[DispatchMode]:
    """``names`` parsed, in order, then each family's floor where one of its modes is there and
    its floor is not; a name given twice is refused."""
    modes = [DispatchMode.parse(m) for m in names]
    for kind in FLOORS:
        if any(m.kind == kind for m in modes) and FLOORS[kind] not in [m.name for m in modes]:
            modes.append(DispatchMode.parse(FLOORS[kind]))
    names = [m.name for m in modes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"dispatch modes {dupes} named more than once")
    if {m.kind for m in modes} >= {RDT, CGRAPH}:
        raise ValueError(
            "dispatch modes rdt and cgraph cannot run in one job: a compiled graph's loop holds "
            "each actor's system concurrency group, where Ray Direct Transport's transfers run "
            "(Ray 2.60: they hang); time them in jobs of their own"
        )
    return modes
