"""``pickled_pickle5``: ROLL's ``pickled`` (its two hops, two collectives per hop, unchanged)
with vLLM's serializer: pickle protocol 5, every dense tensor's bytes out of band, receivers
viewing them in the bytes that arrived (``strategies.core.oob_pickle`` says what it reproduces
and adapts).

A strategy of its own rather than ``pickled``'s option only so that one job can time it beside
``pickled`` (``references=[pickled]``: ``vs_baseline``); it is ``Pickled`` with
``serialization="pickle5"`` and takes no options.
"""

from __future__ import annotations

from strategies.core.footprint import Footprint
from strategies.pickled import FixedSerialization


class PickledPickle5(FixedSerialization):
    name = "pickled_pickle5"
    footprint = Footprint(leader=0.5, receiver=1.5)
    """Measured by the node memory phase (the out-of-band buffers joined once; receivers view
    them (a forwarder holds two))."""
    fixed = "pickle5"


STRATEGY = PickledPickle5
