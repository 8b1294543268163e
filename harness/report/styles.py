"""One colour and one marker per strategy, the same in every figure of every report, so a
reader who has learnt that ``shm`` is the blue circle finds it there on the next figure too;
and which lines to draw prominently (the strategies a report recommends) and which to mute.

A built-in strategy keeps its place in ``BUILTIN`` (its colour does not move when another
strategy is added or a sweep leaves one out); a registered plug-in comes after them in name
order; any other name (a dispatch mode, an options label's variant) gets a place from a hash
of its name, stable from run to run.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import strategies  # light: the registry is read only when names() is called

BUILTIN = (
    "shm", "auto", "flat", "header", "direct", "pp_first", "scatter_allgather",
    "megatron_broadcast_data", "nemo_rl_leader_broadcast", "vllm_tensor_dict",
    "vllm_shm_broadcast", "tensordict_broadcast", "pickled", "ray_object_store", "transferqueue",
    "independent_fetch", "pickled_pickle5", "pickled_verl_numpy", "areal_broadcast",
    "mindspeed_transfer_dock", "torch_shared", "mooncake", "nixl", "self_load",
)  # fmt: skip
"""The shipped strategies, in the order they take colours (the usual winners first: the
most distinct colours go to the lines a reader looks for)."""
COLOURS = (
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#bcbd22", "#7f7f7f", "#393b79", "#637939", "#843c39", "#ad494a", "#6b6ecf", "#e7ba52",
    "#8c6d31", "#7b4173", "#a55194", "#5254a3", "#3182bd", "#e6550d", "#31a354", "#756bb1",
    "#636363", "#9c9ede", "#b5cf6b", "#e7969c", "#de9ed6", "#fd8d3c", "#74c476", "#9e9ac8",
)  # fmt: skip
"""Thirty-two colours told apart on white (tab10, then shades of tab20b/c): room for the
built-ins and a dozen strategies more before two share one."""
MARKERS = ("o", "s", "D", "^", "v", "<", ">", "P", "X", "*", "h", "p", "d", "H", "8", "1", "2",
           "3", "4", "+")  # fmt: skip
PROMINENT = {"lw": 2.4, "ms": 6.5, "alpha": 1.0, "zorder": 4}
MUTED = {"lw": 1.1, "ms": 4.0, "alpha": 0.6, "zorder": 2}


def _registered() -> list[str]:
    """Every strategy a user can pick (built-ins and installed plug-ins); the built-ins alone
    where the registry cannot be read (a report must draw even then)."""
    try:
        return list(strategies.names())
    except Exception:  # a broken plug-in must not stop a report of records already made
        return list(BUILTIN)


def _place(name: str, extra: list[str]) -> int:
    bare = name.split(" [")[0]
    if bare in BUILTIN:
        return BUILTIN.index(bare)
    if bare in extra:
        return len(BUILTIN) + extra.index(bare)
    return zlib.crc32(bare.encode())


def style(name: str, extra: list[str] | None = None) -> dict:
    """``{"color", "marker"}`` of a strategy (an options variant, ``pickled [x=y]``, keeps its
    strategy's and is dashed). ``extra``: the registered names beyond ``BUILTIN``."""
    if extra is None:
        extra = sorted(set(_registered()) - set(BUILTIN))
    i = _place(name, extra)
    out = {"color": COLOURS[i % len(COLOURS)], "marker": MARKERS[i % len(MARKERS)]}
    if " [" in name:
        out["ls"] = "--"
    return out


def styles(names: Iterable[str]) -> dict[str, dict]:
    """The style of each of ``names``."""
    extra = sorted(set(_registered()) - set(BUILTIN))
    return {name: style(name, extra) for name in names}


def draw_order(names: Iterable[str], recommended: Iterable[str]) -> list[str]:
    """``names`` with the recommended ones first (legend order), each group in name order."""
    chosen = set(recommended)
    return sorted(names, key=lambda n: (n not in chosen, n))


def emphasis(name: str, recommended: Iterable[str]) -> dict:
    """Line width, marker size, alpha and z-order: the recommended strategies on top and bold,
    the rest thin and pale, so thirteen lines stay readable."""
    return dict(PROMINENT if name in set(recommended) else MUTED)
