"""bcastbench strategies: interchangeable implementations of ROLL's ``get_data_input``.

``names()`` lists the strategies a user can pick; ``get(name, groups, **options)`` builds one.
A strategy is one module in this package that sets ``STRATEGY = <class>``; nothing else needs
to change to add one.

Strategies from outside the package come two ways: an installed distribution that declares
entry points in the group ``bcastbench.strategies`` (each naming a ``Strategy`` subclass, or a
module that sets ``STRATEGY``) is listed by ``names()`` like a built-in; and a dotted import
path (``my_pkg.mod.MyStrategy``, Hydra's ``_target_`` convention) is accepted wherever a name
is, so a class needs no install at all. ``check_options`` compares options with the class's
``Options`` fields (``Strategy.Options``; a plain ``__init__``'s keyword arguments for a class
without them) before any world starts.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "bcastbench.strategies"
"""Where installed packages declare their strategies (``[project.entry-points."..."]``)."""

_EXPORTS = {
    "NON_TENSOR_FLAG": "strategies.core.contract",
    "ContractError": "strategies.core.contract",
    "DataProto": "strategies.core.contract",
    "LeaderFailed": "strategies.core.contract",
    "Unsupported": "strategies.core.contract",
    "GroupMismatch": "strategies.core.groups",
    "ProcessGroups": "strategies.core.process_groups",
    "Strategy": "strategies.core.strategy_base",
    "accepted_options": "strategies.registry",
    "check_options": "strategies.registry",
    "get": "strategies.registry",
    "get_class": "strategies.registry",
    "has_plan": "strategies.registry",
    "is_target": "strategies.registry",
    "names": "strategies.registry",
    "names_for_world": "strategies.registry",
    "resolve_target": "strategies.registry",
}
"""Every public name and the module that defines it, imported on first use (PEP 562): the
pure parts of the package (``strategies.core.layout``, the rank maths) import without torch,
so a config can be checked before anything heavy loads."""

__all__ = sorted([*_EXPORTS, "ENTRY_POINT_GROUP", "installed_names"])


def installed_names() -> list[str]:
    """The names installed distributions declare in ``ENTRY_POINT_GROUP``, read from their
    metadata without importing them (a config lists them as ``strategy=`` choices before any
    strategy is loaded)."""
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'strategies' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
