"""The model's own form: every collective costs a·α + b·β, with (a, b) from the algorithm.

Calibration fits α and β with exactly these coefficients, so a calibrated cluster reproduces
its measurements by construction; pricing uses them for every comm of a plan. Pure arithmetic.
"""

from __future__ import annotations

COLLECTIVES = ("broadcast", "scatter", "all_gather")
BROADCAST_ALGORITHMS = ("tree", "ring")
SCATTER_ALGORITHMS = ("binomial", "linear")
ALLGATHER_ALGORITHMS = ("recursive_doubling", "ring")


class ClusterError(ValueError):
    """A cluster description that cannot be priced; the message names the field and value."""


PAGE_BYTES = 4096
"""Slices of one buffer start on whole pages, so no two threads or senders touch one page."""


def chunk_bounds(nbytes: int, chunks: int) -> list[tuple[int, int]]:
    """Byte ranges of ``chunks`` page-aligned slices covering ``nbytes`` (fewer when small)."""
    step = max(PAGE_BYTES, -(-nbytes // max(chunks, 1) // PAGE_BYTES) * PAGE_BYTES)
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)] or [(0, 0)]


def ceil_log2(p: int) -> int:
    return (p - 1).bit_length() if p > 1 else 0


def coefficients(
    kind: str,
    group_size: int,
    nbytes: int,
    broadcast_algorithm: str = "tree",
    scatter_algorithm: str = "binomial",
    allgather_algorithm: str = "recursive_doubling",
) -> tuple[float, float]:
    """``(a, b)`` with T = a·α + b·β for one collective (Thakur, Rabenseifner & Gropp 2005).

    ``nbytes`` follows ``Comm.nbytes``: broadcast = bytes every rank ends with; scatter = one
    chunk (each rank's share); all_gather = total gathered bytes per rank.
    """
    p = group_size
    if p <= 1:
        return 0.0, 0.0  # a group of one moves nothing
    if kind == "broadcast":
        if broadcast_algorithm == "tree":  # binomial tree: ⌈log₂p⌉ rounds of the whole message
            rounds = ceil_log2(p)
            return float(rounds), float(rounds * nbytes)
        if broadcast_algorithm == "ring":  # pipelined chain: fill p−1 hops, then n·β
            return float(p - 1), float(nbytes)
        raise ClusterError(f"unknown broadcast_algorithm {broadcast_algorithm!r}")
    if kind == "scatter":
        # The root's p−1 chunks all leave it, whatever the tree: ((p−1)/p)·(p·chunk)·β.
        if scatter_algorithm == "binomial":
            return float(ceil_log2(p)), float((p - 1) * nbytes)
        if scatter_algorithm == "linear":  # one message per receiver, back to back
            return float(p - 1), float((p - 1) * nbytes)
        raise ClusterError(f"unknown scatter_algorithm {scatter_algorithm!r}")
    if kind == "all_gather":
        share = (p - 1) / p * nbytes
        if allgather_algorithm == "recursive_doubling":
            return float(ceil_log2(p)), share
        if allgather_algorithm == "ring":
            return float(p - 1), share
        raise ClusterError(f"unknown allgather_algorithm {allgather_algorithm!r}")
    raise ClusterError(f"unknown collective {kind!r}; valid kinds are {list(COLLECTIVES)}")


def tree_rounds(ranks: tuple[int, ...], root: int | None) -> list[list[tuple[int, int]]]:
    """Edges (sender, receiver) of each round of a binomial-tree broadcast, in global ranks.

    Round k sends over distance 2^k from the root in group order (0→1, then 0→2 and 1→3, …);
    node boundaries play no part, so a 4-rank broadcast over two nodes of two ranks crosses the
    slow link twice at once in its second round (two flows on one node's link).
    """
    p = len(ranks)
    start = ranks.index(root) if root is not None and root in ranks else 0
    order = ranks[start:] + ranks[:start]
    rounds = []
    d = 1
    while d < p:
        rounds.append([(order[i], order[i + d]) for i in range(min(d, p - d))])
        d *= 2
    return rounds
