"""``direct``: ``flat``'s single hop, with the large leaves sent straight from their tensors.

``flat`` copies every byte into its send buffer before the first one moves. On a host where
the transport itself is CPU work (gloo over TCP, 2 cores) that copy is most of what separates
it from the floor at large payloads (docs/results.md). ``direct`` puts only the header, the small leaves and the non-tensor blob
into the speculative message, then broadcasts every contiguous leaf of at least
``direct_min_bytes`` from the leader's own tensor into a tensor each receiver allocates from
the header: no pack copy for those bytes, one more collective per large leaf, all issued async
so the backend overlaps them (gloo runs two at a time per group).

The threshold trades one collective's start-up against copying the leaf: the default suits
gloo on CPU, where a broadcast's start-up costs about as much as copying a MiB; on NCCL, where
device copies are far faster and start-up far shorter, a larger threshold (tens of MiB) keeps
it from sending many small collectives. Options: see ``Direct.Options``.
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies.core.footprint import Footprint
from strategies.flat import Flat

DIRECT_MIN_BYTES = 1 << 20


class Direct(Flat):
    name = "direct"
    footprint = Footprint(leader=0, receiver=1)
    """Measured by the node memory phase (large leaves straight from the leader's tensors: no
    pack copy; receivers hold what arrived)."""
    claims = (
        "1 broadcast over the replica for the message (2 when it outgrows the announced size) "
        "+ 1 per contiguous leaf of >= direct_min_bytes"
    )
    direct_min_bytes = DIRECT_MIN_BYTES  # what plan() prices when no threshold is passed

    @dataclass(frozen=True, kw_only=True)
    class Options(Flat.Options):
        direct_min_bytes: int = DIRECT_MIN_BYTES
        """Every contiguous leaf of at least this many bytes is broadcast on its own, straight
        from the leader's tensor, after the message; smaller ones are packed into it."""

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.direct_min_bytes < 1:
                raise ValueError(f"direct_min_bytes must be >= 1, got {self.direct_min_bytes}")

    def __init__(self, groups, **options) -> None:
        super().__init__(groups, **options)
        self.direct_min_bytes = self.options.direct_min_bytes


STRATEGY = Direct
