"""Sizes as people read them: binary units, the way the sweep names its payloads. Here, below the
job and the report, because a job's one-line summary and the report's tables both print them."""

from __future__ import annotations

import math


# -- labels ---------------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    """Binary units, as the sweep names its sizes (69 KiB, 2.9 MiB)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "?"
    scales = (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20))
    for unit, scale in (*scales, ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(n)} B"
