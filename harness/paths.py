"""Where the project's files are: the repository root and its ``conf/`` directory, in one
place so that no module counts parent directories of its own."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
"""The checkout (or install prefix) that holds ``harness/`` and ``strategies/``."""
CONF_DIR = (Path(__file__).resolve().parent / "conf").resolve()
"""Hydra's configuration tree: one group per folder. ``harness/conf`` is a link to the
checkout's ``conf/``, and the same tree as package data in a wheel (pyproject's
``[tool.setuptools.package-data]``), so an installed ``bcastbench`` finds it from any
directory."""
