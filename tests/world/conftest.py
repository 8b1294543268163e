"""Tier 2: real multi-process gloo worlds (the session's 4- and 8-rank worlds in tests/conftest.py,
or a CLI run that starts its own). Correctness of every strategy on every rank lives here.
"""

from tiers import marking

pytest_collection_modifyitems = marking(__file__, "world")
