"""Test tiers are folders: each folder's conftest marks every test under it with its tier, so
`pytest -m unit` (or world, infra, benchmark) selects a tier wherever a test is named from."""

from __future__ import annotations

from pathlib import Path

import pytest


def marking(conftest_file: str, marker: str):
    """A ``pytest_collection_modifyitems`` hook that marks the tests below ``conftest_file``."""
    here = Path(conftest_file).resolve().parent
    mark = getattr(pytest.mark, marker)

    def pytest_collection_modifyitems(items) -> None:
        for item in items:
            if here in Path(item.path).parents:
                item.add_marker(mark)

    return pytest_collection_modifyitems
