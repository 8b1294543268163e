"""Tier 1: no process group. Maths, configuration, encoding, reports; every test here runs in one
process in well under a second, and the folder is what `make test-fast` runs first.
"""

from tiers import marking

pytest_collection_modifyitems = marking(__file__, "unit")
