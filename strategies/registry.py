"""The strategies by name: the built-in modules that set ``STRATEGY``, those installed
distributions declare (entry point group ``bcastbench.strategies``) and dotted import paths;
``strategies`` exposes these functions (see its docstring)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings
from dataclasses import fields
from functools import cache
from importlib.metadata import entry_points

import strategies
from strategies import ENTRY_POINT_GROUP
from strategies.core.process_groups import ProcessGroups
from strategies.core.strategy_base import Strategy, accepted_options, unknown_option


@cache
def _registry() -> dict[str, type[Strategy]]:
    found: dict[str, type[Strategy]] = {}
    for info in pkgutil.iter_modules(strategies.__path__):
        module = importlib.import_module(f"strategies.{info.name}")
        cls = getattr(module, "STRATEGY", None)
        if cls is not None:
            found[cls.name] = cls
    for name, cls in _installed().items():
        if name in found:
            warnings.warn(
                f"entry point {name!r} ({ENTRY_POINT_GROUP}) is ignored: a built-in strategy "
                "has that name",
                stacklevel=2,
            )
            continue
        found[name] = cls
    return dict(sorted(found.items()))


def _installed() -> dict[str, type[Strategy]]:
    """Strategies installed distributions declare; a broken one is skipped with a warning
    naming it, so one bad package cannot hide every strategy."""
    found: dict[str, type[Strategy]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = _strategy_class(ep.load(), ep.value)
        except Exception as exc:  # noqa: BLE001 - any import failure of foreign code
            warnings.warn(
                f"entry point {ep.name!r} = {ep.value!r} ({ENTRY_POINT_GROUP}) is skipped: "
                f"{type(exc).__name__}: {exc}",
                stacklevel=3,
            )
            continue
        found[cls.name or ep.name] = cls
    return found


def _strategy_class(obj, where: str) -> type[Strategy]:
    """``obj`` as a Strategy subclass: the class itself, or a module's ``STRATEGY``."""
    cls = getattr(obj, "STRATEGY", obj) if inspect.ismodule(obj) else obj
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"{where} is not a strategies.Strategy subclass (got {cls!r})")
    return cls


def is_target(name: str) -> bool:
    """A dotted import path (``pkg.mod.Class`` or ``pkg.mod:Class``) rather than a name."""
    return "." in name or ":" in name


@cache
def resolve_target(target: str) -> type[Strategy]:
    """The Strategy class at ``target`` (``pkg.mod.Class`` or ``pkg.mod:Class``). Raises
    KeyError with one line saying what could not be imported or what it is instead."""
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise KeyError(
            f"strategy target {target!r} cannot be imported ({type(exc).__name__}: {exc}); "
            "expected an importable 'package.module.Class'"
        ) from None
    try:
        return _strategy_class(obj, target)
    except TypeError as exc:
        raise KeyError(str(exc)) from None


def names(include_floor: bool = False) -> list[str]:
    """Strategies a user can choose (``floor`` is the measured limit, not a choice)."""
    return [n for n, c in _registry().items() if c.selectable or include_floor]


def names_for_world(world: str = "forked", include_floor: bool = False) -> list[str]:
    """``names()`` less those that cannot run on ``world`` in this installation: a strategy
    needing another world (``Strategy.world``, e.g. ``ray_object_store`` needs ``ray``) or an
    optional package not installed (``Strategy.unavailable``). The named sweeps list these."""
    return [
        n
        for n in names(include_floor)
        if _registry()[n].world in (None, world) and _registry()[n].unavailable() is None
    ]


def get_class(name: str) -> type[Strategy]:
    """The class of a registered name, or of a dotted import path (see ``resolve_target``)."""
    if name not in _registry() and is_target(name):
        return resolve_target(name)
    try:
        return _registry()[name]
    except KeyError:
        raise KeyError(
            f"unknown strategy {name!r}; valid names: {names(include_floor=True)}"
        ) from None


def has_plan(name: str) -> bool:
    """Whether ``name``'s class states its plan (``plan()`` is optional: without one a
    strategy is measured but not predicted)."""
    return getattr(get_class(name).plan, "__func__", None) is not Strategy.plan.__func__


def check_options(name: str, options: dict) -> None:
    """Raise TypeError (one line: the option, the strategy, the accepted ones) if ``name``'s
    class does not accept every key of ``options`` (``accepted_options``: its ``Options``
    fields, or a plain ``__init__``'s keyword arguments), and ValueError (one line) if a value
    its ``Options`` holds is refused (``Strategy.options_of``): before any rank starts, as
    building the strategy on each rank would."""
    cls = get_class(name)
    accepted = accepted_options(cls)
    if accepted is None:
        return
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise unknown_option(name, unknown[0], accepted)
    held = {f.name for f in fields(cls.Options)}
    cls.options_of(**{k: v for k, v in options.items() if k in held})


def get(name: str, groups: ProcessGroups, **options) -> Strategy:
    """Build strategy ``name`` on these groups (options: its class's ``Options`` fields)."""
    return get_class(name)(groups, **options)
