"""``pickled_verl_numpy``: ROLL's ``pickled`` (its two hops, two collectives per hop, unchanged)
with verl's ``numpy`` DataProto serializer (``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``):
each tensor as (dtype, shape, uint8 array) carried out of band by pickle protocol 5, receivers
copying each into a ``bytearray`` and ``torch.frombuffer``-ing it (``strategies.core.oob_pickle``
says what it reproduces and adapts).

A strategy of its own rather than ``pickled``'s option only so that one job can time it beside
``pickled`` (``references=[pickled]``: ``vs_baseline``); it is ``Pickled`` with
``serialization="verl_numpy"`` and takes no options.
"""

from __future__ import annotations

from strategies.core.footprint import Footprint
from strategies.pickled import FixedSerialization


class PickledVerlNumpy(FixedSerialization):
    name = "pickled_verl_numpy"
    footprint = Footprint(leader=1, receiver=2)
    """Measured by the node memory phase (receivers copy each array out of the received bytes)."""
    fixed = "verl_numpy"


STRATEGY = PickledVerlNumpy
