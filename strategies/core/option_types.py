"""Each strategy option's value checked against its field's annotation (``Strategy.Options``'s
``__post_init__``, before a strategy's own checks of the values):
a Hydra override such as ``+strategy.options.views=maybe`` reaches a strategy as a string,
which a ``bool`` field would otherwise take as true. Pure: no torch.

The annotations the options use are checked: ``bool``, ``int``, ``float``, ``str``,
``Literal[...]``, unions of them with ``None``, and ``tuple[X, ...]`` or ``list[X]`` of them; any
other annotation (a user's own type) is left to the strategy's ``__post_init__``.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from functools import cache
from typing import Any, Literal, get_args, get_origin


class OptionTypeError(ValueError):
    """An option's value is not of its field's type (``check_types``); ``Strategy.options_of``
    names the strategy in front of it."""


def check_types(options: Any) -> None:
    """Raise OptionTypeError (one line) naming the first field of the dataclass ``options``
    whose value its annotation refuses, the value and what was expected."""
    hints = _hints(type(options))
    for f in fields(options):
        hint = hints.get(f.name)
        value = getattr(options, f.name)
        if hint is None or _fits(value, hint) or value is f.default:
            continue  # a default is the author's: a user's ``x: int = None`` stands
        bad = _bad_item(value, hint)
        if bad is not None:
            raise OptionTypeError(
                f"option {f.name!r}: item {bad!r} is not {describe(_item_hint(hint))} "
                f"(got {value!r})"
            )
        raise OptionTypeError(f"option {f.name!r} must be {describe(hint)}, got {value!r}")


@cache
def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 -- an annotation that does not resolve: nothing to check
        return {}


def _fits(value: Any, hint: Any) -> bool:
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return True
    if hint is bool:
        return type(value) is bool
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float)
    if hint is str:
        return isinstance(value, str)
    if hint is type(None):
        return value is None
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        item = args[0] if args and (origin is list or args[-1] is Ellipsis) else None
        return item is None or all(_fits(v, item) for v in value)
    return True  # an annotation this module does not know: the strategy checks it


_WORDS = {"true": True, "false": False, "null": None, "none": None}


def from_text(options_cls: type, values: dict[str, str]) -> dict[str, Any]:
    """``values`` (option name -> its text, as a label ``shm[stage=false]`` gives it) read by
    each field's annotation in ``options_cls``: ``true``/``false`` for a bool, ``null`` for
    None, digits for an int or float, ``a+b`` for a list; any other text stays text (a string
    option, or a value the strategy's checks then refuse)."""
    hints = _hints(options_cls)
    return {k: _read(v, hints.get(k)) if isinstance(v, str) else v for k, v in values.items()}


def _read(text: str, hint: Any) -> Any:
    if hint is None:
        return text
    if _item_hint(hint) is not None and not _fits(text, hint):  # a list, joined by ``+``
        return tuple(text.split("+"))
    word = _WORDS.get(text.strip().lower(), text)
    if word is not text and _fits(word, hint):
        return word
    for kind in (int, float):
        try:
            number = kind(text)
        except ValueError:
            continue
        if _fits(number, hint):
            return number
    return text


def _item_hint(hint: Any) -> Any:
    """The item annotation of ``hint``'s list or tuple (in a union, the first one's); None
    where it has none."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return next((_item_hint(a) for a in args if _item_hint(a) is not None), None)
    if origin in (tuple, list) and args and (origin is list or args[-1] is Ellipsis):
        return args[0]
    return None


def _bad_item(value: Any, hint: Any) -> Any:
    """The first item of a list ``value`` that ``hint``'s item annotation refuses; None where
    ``value`` is no list or ``hint`` holds none."""
    item = _item_hint(hint)
    if item is None or not isinstance(value, (tuple, list)):
        return None
    return next((v for v in value if not _fits(v, item)), None)


def describe(hint: Any) -> str:
    """What ``hint`` accepts, in words (``true or false``, ``an int``, one of the literals)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an int"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if hint is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe(a) for a in args))  # tuple | list: one
    if origin in (tuple, list):
        item = args[0] if args else None
        return "a list" + (f" of ({describe(item)})" if item is not None else "")
    return getattr(hint, "__name__", str(hint))
