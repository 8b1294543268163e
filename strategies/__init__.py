"""bcastbench strategies: interchangeable implementations of ROLL's ``get_data_input``.

``names()`` lists the strategies a user can pick; ``get(name, groups, **options)`` builds one.
A strategy is one module in this package that sets ``STRATEGY = <class>``; nothing else needs
to change to add one.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from strategies.core.contract import (
    NON_TENSOR_FLAG,
    ContractError,
    DataProto,
    LeaderFailed,
    ProcessGroups,
    Strategy,
    Unsupported,
)
from strategies.core.groups import GroupMismatch

__all__ = [
    "NON_TENSOR_FLAG",
    "ContractError",
    "DataProto",
    "GroupMismatch",
    "LeaderFailed",
    "ProcessGroups",
    "Strategy",
    "Unsupported",
    "get",
    "get_class",
    "names",
]


@cache
def _registry() -> dict[str, type[Strategy]]:
    found: dict[str, type[Strategy]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        cls = getattr(module, "STRATEGY", None)
        if cls is not None:
            found[cls.name] = cls
    return dict(sorted(found.items()))


def names(include_floor: bool = False) -> list[str]:
    """Strategies a user can choose (``floor`` is the measured limit, not a choice)."""
    return [n for n, c in _registry().items() if c.selectable or include_floor]


def get_class(name: str) -> type[Strategy]:
    try:
        return _registry()[name]
    except KeyError:
        raise KeyError(
            f"unknown strategy {name!r}; valid names: {names(include_floor=True)}"
        ) from None


def get(name: str, groups: ProcessGroups, **options) -> Strategy:
    """Build strategy ``name`` on these groups (options as in its module docstring)."""
    return get_class(name)(groups, **options)
