"""The dispatch modes' names and their parsed form (``leader:<strategy>``, ``all_ranks[:raw]``):
what the job's config checks and its records name, apart from the code that runs them
(``harness.job.dispatch``, which imports the config and the records)."""

from __future__ import annotations

from dataclasses import dataclass

import strategies

LEADER, ALL_RANKS = "leader", "all_ranks"


FLOORS = {LEADER: "leader:floor", ALL_RANKS: "all_ranks:raw"}


@dataclass(frozen=True)
class DispatchMode:
    """One way to get the chunks to the ranks, parsed from ``leader:<strategy>`` or
    ``all_ranks[:raw]``."""

    kind: str
    """``leader`` or ``all_ranks``."""
    strategy: str | None = None
    """The broadcast strategy after a leader dispatch (``floor`` for the raw floor)."""
    raw: bool = False
    """True for a floor: the same bytes as one flat uint8 array, no DataProto."""

    @property
    def name(self) -> str:
        if self.kind == LEADER:
            return f"{LEADER}:{self.strategy}"
        return FLOORS[ALL_RANKS] if self.raw else ALL_RANKS

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
        if kind == ALL_RANKS and rest in ("", "raw"):
            return cls(ALL_RANKS, raw=rest == "raw")
        raise ValueError(
            f"dispatch mode {text!r}: expected 'leader:<strategy>', 'leader:floor', 'all_ranks' "
            "or 'all_ranks:raw'"
        )


def under_test(dispatch: str, strategy: str) -> str:
    """The mode a ``bcastbench run`` dispatch job measures: ``leader:<strategy>`` for
    ``ray.dispatch=leader``, ``all_ranks`` for ``ray.dispatch=all_ranks``."""
    return f"{LEADER}:{strategy}" if dispatch == LEADER else ALL_RANKS


def with_floors(names: tuple[str, ...] | list[str]) -> list[DispatchMode]:
    """``names`` parsed, in order, then each family's floor where one of its modes is there and
    its floor is not; a name given twice is refused."""
    modes = [DispatchMode.parse(m) for m in names]
    for kind in (LEADER, ALL_RANKS):
        if any(m.kind == kind for m in modes) and FLOORS[kind] not in [m.name for m in modes]:
            modes.append(DispatchMode.parse(FLOORS[kind]))
    names = [m.name for m in modes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"dispatch modes {dupes} named more than once")
    return modes
