"""Push beside pull in the report: for every cell (layout × payload size) whose records hold
both a push strategy (the leader broadcasts, or signals a segment it wrote: every strategy but
the pull ones and ``auto``) and a pull one (each rank fetches its copy from a store or an
engine: ``independent_fetch``, ``ray_object_store``, ``transferqueue``, ``mooncake``, ``nixl``;
or loads it itself: ``self_load``), the best of each family by ``vs_floor`` and the pull one's
time over the push one's, with its interval where the two were timed in the same job (paired by
round, ``sure.paired_interval``). No such cell: no section.
"""

from __future__ import annotations

import pandas as pd

from harness.job.verdict import interval_text
from harness.report.md_format import md_table, ratio_range
from harness.report.sure import bare, paired_interval
from harness.report.tables import layouts_of, strategy_table
from harness.units import human_bytes

FAMILIES = {
    "store": ("independent_fetch", "ray_object_store", "transferqueue"),
    "engine": ("mooncake", "nixl"),
    "self": ("self_load",),
}
"""The pull strategies by family: ``store``, every rank gets its copy from a store the leader
put the batch in; ``engine``, every rank READs it one-sided from the leader's transfer
engine; ``self``, no hand-off: every rank loads the batch itself from disk, as its loader
would. Every other strategy but ``NEITHER`` is a push."""
PULL = tuple(name for names in FAMILIES.values() for name in names)
"""The strategies whose ranks fetch their own copy."""
NEITHER = ("auto",)
"""A choice among push strategies, not a way of its own."""


def push_pull_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per cell with both kinds measured: the best push and pull strategy, their
    ``vs_floor``, pull over push and that ratio's paired interval (None where not paired)."""
    table = strategy_table(df)
    table = table[table["supported"] & table["vs_floor"].notna()]
    rows = []
    for layout in layouts_of(df):
        for size, cell in table[table["layout"] == layout].groupby("payload_bytes"):
            kind = cell["strategy"].map(lambda n: bare(n) in PULL)
            push = cell[~kind & ~cell["strategy"].map(lambda n: bare(n) in NEITHER)]
            pull = cell[kind]
            if push.empty or pull.empty:
                continue
            best_push = push.loc[push["vs_floor"].idxmin()]
            best_pull = pull.loc[pull["vs_floor"].idxmin()]
            over = best_pull["vs_floor"] / best_push["vs_floor"]
            families = {}
            for family, names in FAMILIES.items():
                mine = pull[pull["strategy"].map(lambda n, names=names: bare(n) in names)]
                if not mine.empty:
                    best = mine.loc[mine["vs_floor"].idxmin()]
                    families[family] = (best["strategy"], float(best["vs_floor"]))
            rows.append({
                "layout": layout, "payload_bytes": int(size),
                "push": best_push["strategy"], "push_vs_floor": best_push["vs_floor"],
                "pull": best_pull["strategy"], "pull_vs_floor": best_pull["vs_floor"],
                "pull_over_push": over,
                "families": families,
                "interval": paired_interval(df, layout, size, best_pull["strategy"],
                                            best_push["strategy"]),
            })  # fmt: skip
    return pd.DataFrame(rows)


def push_pull_markdown(df: pd.DataFrame) -> str:
    """The section (heading included), or '' when no cell measured both kinds."""
    table = push_pull_table(df)
    if table.empty:
        return ""
    header = ["layout", "payload", "best push", "vs_floor", "best pull", "vs_floor",
              "pull / push (×, paired 95 % interval)", "fastest of each pull family"]  # fmt: skip
    body = [
        [r.layout, human_bytes(r.payload_bytes), r.push, ratio_range([r.push_vs_floor]), r.pull,
         ratio_range([r.pull_vs_floor]), interval_text(r.pull_over_push, r.interval),
         _families_text(r.families)]
        for r in table.itertuples()
    ]  # fmt: skip
    return (
        "## Push or pull\n\nThe fastest strategy that pushes the batch (the leader broadcasts "
        "it, or writes and signals a segment) beside the fastest that pulls it (each rank "
        "fetches its own copy, or loads it itself), both by their `vs_floor`; above 1 the "
        "pull is slower. The interval is paired by round where the two were timed in the same "
        "job; without one, the ratio is of medians from different jobs. The last column names "
        "the fastest of each pull family measured: `store` (a store the leader put the batch "
        "in), `engine` (a one-sided READ from the leader's transfer engine) and `self` (no "
        "hand-off: every rank loads the batch from disk, as its loader would).\n\n"
        + md_table(header, body, align="lllrlrrl")
    )


def _families_text(families: dict[str, tuple[str, float]]) -> str:
    """``store: independent_fetch 8.8×; engine: mooncake 16.5×``, each family measured."""
    return "; ".join(
        f"{family}: {name} {ratio_range([vs_floor])}"
        for family, (name, vs_floor) in families.items()
    )
