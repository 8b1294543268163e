"""Every third-party module the product imports is a declared dependency: a core one, or an
optional extra's when the import is guarded (the reason beside it in the code). A wheel
installed on a fresh machine resolves only what pyproject.toml declares, so an import that
works here through a dev-only package (psutil came with ipython) fails there.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from harness.paths import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PRODUCT = ("harness", "strategies")
OPTIONAL = {
    "ray": "ray",
    "submitit": "slurm",
    "hydra_plugins": "slurm",
    "verl": "verl",
    "transfer_queue": "transferqueue",
    "mooncake": "engines",
    "nixl_cu12": "engines",
}
"""Modules the product imports only where an optional extra is installed: module → extra."""


def _requirement_names(specs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].lower() for spec in specs}


def _imported_modules() -> dict[str, str]:
    """Top-level module → the first product file that imports it."""
    found: dict[str, str] = {}
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(REPO)))
    return found


def test_every_third_party_import_is_declared():
    project = tomllib.loads(Path(REPO, "pyproject.toml").read_text())["project"]
    core = _requirement_names(project["dependencies"])
    extras = {k: _requirement_names(v) for k, v in project["optional-dependencies"].items()}
    dists = packages_distributions()
    problems = []
    for module, where in sorted(_imported_modules().items()):
        if module in PRODUCT or module in sys.stdlib_module_names or module == "__future__":
            continue
        if module in OPTIONAL:
            extra = OPTIONAL[module]
            assert extra in extras, f"{module} ({where}) belongs to extra {extra!r}"
            continue
        names = {d.lower() for d in dists.get(module, [])}
        if not names & core:
            problems.append(f"{module} (imported by {where}; distribution {sorted(names)})")
    assert not problems, "imported but not declared in [project].dependencies: " + "; ".join(
        problems
    )
