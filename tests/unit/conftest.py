"""Tier 1: no process group. Maths, configuration, encoding, reports; every test here but the docs
test runs in one process in well under a second (test_docs.py takes about a minute: it runs or
checks every command the docs show), and the folder is what `make test-fast` runs first.
"""

from tiers import marking

pytest_collection_modifyitems = marking(__file__, "unit")
