"""Tier 3: infrastructure the tests stand up themselves: a single-node Slurm, network namespaces
with shaped links, torchrun across emulated hosts. Skips where the machine cannot host it
(BCB_REQUIRE_INFRA=1 turns a skip into a failure).
"""

from tiers import marking

pytest_collection_modifyitems = marking(__file__, "infra")
