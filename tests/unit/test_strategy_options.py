"""Strategy options as typed values: every strategy's ``Options`` dataclass documents each field
and checks its values, an unknown option is one line, and a user's strategy with plain keyword
arguments (no ``Options``) still has them accepted."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap

import pytest

import strategies
from strategies import ProcessGroups, Strategy
from strategies.core.strategy_base import accepted_options

NAMES = strategies.names(include_floor=True)


def field_docs(options_cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its annotated assignment, read from the
    source of each ``Options`` class along ``options_cls``'s MRO (a field is documented where
    it is declared)."""
    docs: dict[str, str] = {}
    for klass in reversed(options_cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, Strategy.Options)):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, after in zip(body, body[1:] + [None]):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = after.value.value
    return docs


def groups() -> ProcessGroups:
    """Groups for building a strategy without a process group (never used to send)."""
    return ProcessGroups(
        tp_cp_group=None,
        pp_group=None,
        replica_group=None,
        tp_cp_ranks=(0, 1),
        pp_ranks=(0,),
        replica_ranks=(0, 1),
        pp_rank=0,
        tp_cp_rank=0,
        rank=0,
    )


@pytest.mark.parametrize("name", NAMES)
def test_every_option_is_a_documented_field_of_a_frozen_keyword_only_dataclass(name):
    cls = strategies.get_class(name)
    options = cls.Options
    assert dataclasses.is_dataclass(options) and issubclass(options, Strategy.Options)
    params = options.__dataclass_params__
    assert params.frozen, f"{name}: {options.__qualname__} is not frozen"
    names = [f.name for f in dataclasses.fields(options)]
    assert sorted(accepted_options(cls)) == sorted(names), name
    assert all(f.kw_only for f in dataclasses.fields(options)), name
    docs = field_docs(options)
    undocumented = [n for n in names if not docs.get(n, "").strip()]
    assert undocumented == [], f"{name}: {options.__qualname__} fields without a docstring"
    if names:  # the prose moved to the fields: the module docstring points there
        module_doc = inspect.getmodule(cls).__doc__
        assert "Options" in module_doc, f"{name}: the module docstring does not name Options"


def test_the_field_docstring_reader_reads_what_is_under_a_field():
    docs = field_docs(strategies.get_class("shm").Options)
    assert docs["views"].startswith("Receivers view the segment in place")
    assert docs["max_bytes"].startswith("Readers refuse a header")  # the base's, NodeStore's


def test_options_are_built_once_and_read_typed():
    s = strategies.get("flat", groups(), initial_bytes=8192)
    assert s.options == strategies.get_class("flat").Options(initial_bytes=8192)
    assert s.options.max_bytes == strategies.get_class("flat").Options().max_bytes
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.options.initial_bytes = 1
    with pytest.raises(TypeError):
        strategies.get_class("flat").Options(8192)  # keyword only


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        (
            "flat",
            {"initial_bytes": 100},
            "initial_bytes must be >= 4096 (one header page), got 100",
        ),
        ("direct", {"direct_min_bytes": 0}, "direct_min_bytes must be >= 1, got 0"),
        (
            "scatter_allgather",
            {"header_bytes": 100},
            "header_bytes must be a multiple of 64 and >= ",
        ),
        ("shm", {"slots": 0}, "shm: slots must be >= 1, got 0"),
        (
            "shm",
            {"early_min_bytes": -1},
            "shm: early_min_bytes must be a byte count (an int >= 0) or None, got -1",
        ),
        ("floor", {"chunks": 0}, "floor: chunks must be >= 1, got 0"),
        (
            "vllm_shm_broadcast",
            {"max_chunks": 0},
            "vllm_shm_broadcast: max_chunk_bytes must be >= 2 and max_chunks >= 1, got "
            "16777216 and 0",
        ),
    ],
)
def test_a_bad_value_is_refused_by_the_dataclass_naming_it(name, options, message):
    cls = strategies.get_class(name)
    with pytest.raises(ValueError) as err:
        cls.Options(**options)
    text = str(err.value)
    assert text.startswith(message), text
    assert len(text.splitlines()) == 1
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        cls.options_of(**options)  # the way the strategy builds it


def test_an_unknown_option_is_one_line_at_construction_as_in_the_config_check():
    with pytest.raises(TypeError) as built:
        strategies.get("direct", groups(), direct_min_byte=1)
    with pytest.raises(TypeError) as checked:
        strategies.check_options("direct", {"direct_min_byte": 1})
    line = (
        "strategy 'direct' has no option 'direct_min_byte'; accepted options: "
        "['direct_min_bytes', 'eager_max_bytes', 'initial_bytes', 'max_bytes']"
    )
    assert str(built.value) == str(checked.value) == line
    with pytest.raises(TypeError) as none:
        strategies.get("megatron_broadcast_data", groups(), x=1)
    assert str(none.value) == (
        "strategy 'megatron_broadcast_data' has no option 'x'; accepted options: none"
    )


class PlainKeywords(Strategy):
    """A user's strategy as written before ``Options``: a plain keyword argument."""

    name = "plain_keywords"

    def __init__(self, groups, coalesce: bool = False) -> None:
        super().__init__(groups)
        self.coalesce = coalesce


class ShmWithMore(strategies.get_class("shm")):
    """A user's subclass of a built-in: one keyword of its own, the rest handed down."""

    name = "shm_with_more"

    def __init__(self, groups, label: str = "", **options) -> None:
        super().__init__(groups, **options)
        self.label = label


def test_a_strategy_without_options_keeps_its_keyword_arguments():
    assert accepted_options(PlainKeywords) == ["coalesce"]
    s = PlainKeywords(groups(), coalesce=True)
    assert s.coalesce and s.options == Strategy.Options()
    shm_fields = [f.name for f in dataclasses.fields(strategies.get_class("shm").Options)]
    assert accepted_options(ShmWithMore) == ["label", *shm_fields]
    with pytest.raises(TypeError, match="^strategy 'shm_with_more' has no option 'x'; .*'label'"):
        ShmWithMore.options_of(x=1)


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("shm", {"views": "maybe"}, "shm: option 'views' must be true or false, got 'maybe'"),
        ("shm", {"stage": 1}, "shm: option 'stage' must be true or false or null, got 1"),
        ("shm", {"slots": 2.0}, "shm: option 'slots' must be an int, got 2.0"),
        ("shm", {"poll_us": 1.5}, "shm: option 'poll_us' must be an int or null, got 1.5"),
        ("shm", {"poll_us": True}, "shm: option 'poll_us' must be an int or null, got True"),
        (
            "independent_fetch",
            {"stripe_min_bytes": "1MiB"},
            "independent_fetch: option 'stripe_min_bytes' must be an int or null, got '1MiB'",
        ),
        ("direct", {"direct_min_bytes": 1.5}, "direct: option 'direct_min_bytes' must be an int"),
        ("self_load", {"directory": 7}, "self_load: option 'directory' must be a string, got 7"),
        ("auto", {"cluster": 7}, "auto: option 'cluster' must be a string, got 7"),
        (
            "auto",
            {"candidates": "flat"},
            "auto: option 'candidates' must be a list of (one of 'flat', 'direct', ",
        ),
        (
            "floor",
            {"method": "chunks", "chunks": "4"},
            "floor: option 'chunks' must be an int, got '4'",
        ),
        (
            "pickled",
            {"serialization": "zzz"},
            "pickled: option 'serialization' must be one of 'roll', 'dataclass', 'pickle5', "
            "'verl_numpy', got 'zzz'",
        ),
        ("floor", {"method": "ring"}, "floor: option 'method' must be one of 'one', 'chunks', "),
        (
            "auto",
            {"candidates": ["flat", "bogus"]},
            "auto: option 'candidates': item 'bogus' is not one of 'flat', 'direct', ",
        ),
        ("auto", {"first": "pickled"}, "auto: option 'first' must be one of 'flat', 'direct', "),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_option_and_type(name, options, message):
    """A Hydra override reaches a strategy as YAML gives it (``views=maybe`` is a string, which a
    bool field would take as true): what passes a strategy's own checks is checked against its
    field's annotation, in one line, at construction and in the config check alike."""
    cls = strategies.get_class(name)
    with pytest.raises(ValueError) as built:
        cls.options_of(**options)
    assert str(built.value).startswith(message), str(built.value)
    assert len(str(built.value).splitlines()) == 1
    if name != "floor":  # the floor is no strategy a job selects
        with pytest.raises(ValueError) as checked:
            strategies.check_options(name, options)
        assert str(checked.value) == str(built.value)


def test_the_type_check_names_the_item_of_a_list_it_refuses_and_lets_defaults_be():
    from strategies.core.option_types import check_types

    @dataclasses.dataclass(frozen=True)
    class Opts:
        picks: tuple[str, ...] = ()
        mode: int | None = None
        size: int = None  # a user's loose default is the author's to give

    check_types(Opts(picks=("a", "b"), mode=None))  # fits: nothing raised
    check_types(Opts(picks=["a"], mode=3))  # a list where the default is a tuple
    with pytest.raises(ValueError, match=r"^option 'picks': item 2 is not a string \(got"):
        check_types(Opts(picks=("a", 2)))
    with pytest.raises(ValueError, match=r"^option 'mode' must be an int or null, got 'a'$"):
        check_types(Opts(mode="a"))
    with pytest.raises(ValueError, match=r"^option 'size' must be an int, got 'big'$"):
        check_types(Opts(size="big"))


def test_a_label_option_is_read_by_its_type():
    """predict's labels carry text; each value is read as its field's annotation reads it, so
    ``shm[stage=false]`` prices stage=False (the text 'false' is true)."""
    from harness.model.prices import parse_label

    assert parse_label("shm[stage=false,stripe_min_bytes=4096]") == (
        "shm", {"stage": False, "stripe_min_bytes": 4096}
    )  # fmt: skip
    assert parse_label("shm[stripe_min_bytes=null]") == ("shm", {"stripe_min_bytes": None})
    assert parse_label("mooncake[fields=input_ids+returns]")[1] == {
        "fields": ("input_ids", "returns")
    }
    assert parse_label("pickled[serialization=dataclass]")[1] == {"serialization": "dataclass"}
    assert parse_label("bogus[x=1]") == ("bogus", {"x": "1"})  # unknown: the caller names it
