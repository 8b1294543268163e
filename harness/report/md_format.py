"""Markdown pieces every report text shares: a pipe table, a missing figure, a range of ratios
and fenced commands; the broadcast report, its cost section and the Ray report build on them."""

from __future__ import annotations

import math
from collections.abc import Iterable


def md_table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A pipe table; ``align`` is one letter per column (``l`` or ``r``), the first column
    left and the rest right unless given."""
    align = align or "l" + "r" * (len(header) - 1)
    marks = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def is_missing(value) -> bool:
    """No figure: None, or a float NaN (pandas' empty cell)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def ratio_range(values: list[float]) -> str:
    """Ratios as ``1.20×``, or ``1.10–1.30×`` where they spread; ``—`` when none is known."""
    vals = [v for v in values if not is_missing(v)]
    if not vals:
        return "—"
    lo, hi = min(vals), max(vals)
    return f"{lo:.2f}×" if abs(hi - lo) < 0.005 else f"{lo:.2f}–{hi:.2f}×"


def fenced_commands(commands: Iterable[str]) -> str:
    """Each command in its own code block, or a line saying the records name none."""
    return "\n".join(f"```\n{c}\n```" for c in commands) or "(the records name no command)"
