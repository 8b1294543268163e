"""The Strategy base class: one way to run ``get_data_input``, whose own ``get_data_input``
holds the contract for every strategy (a leader's failure reaches every rank, no rank waits).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from strategies.core.completion import Replay, distinct_groups, marks, posted_since
from strategies.core.contract import (
    DataProto,
    failure_batch,
    failure_in,
    failure_text,
    is_settled,
    leader_failed,
    resolve_lazy_views,
    settled,
    validate,
    wants_non_tensor,
)
from strategies.core.footprint import Footprint
from strategies.core.option_types import OptionTypeError, check_types
from strategies.core.process_groups import ProcessGroups


class Strategy:
    """One way to run ``get_data_input``. Subclasses set ``name`` and implement ``transfer``.

    A strategy is built once per layout with its groups and options, then called on every
    rank of the world with the entry state; it returns the exit state (docs/writing-a-strategy.md).

    ``get_data_input`` is this class's and no subclass replaces it: it holds the contract for
    every strategy, a user's included. On the leader it refuses, before any collective, every
    leaf kind no strategy can carry (``contract.validate``) and whatever the strategy's
    ``check`` refuses; a failure there, or in the strategy's own leader work before its first
    collective (encoding, pickling), travels as a failure batch through the strategy's own
    ``transfer``, and every receiver raises ``LeaderFailed`` naming the leader's rank and
    error. A failure after the leader's first collective went out is finished by replaying
    its send path with the collectives already posted answered locally
    (``strategies.core.completion``): every collective the receivers wait for goes out with
    the batch's bytes, then the leader raises. Either way no rank waits, and the next call on
    the same instance starts from a state every rank agrees on.

    What ``transfer`` must keep to for that: it posts collectives only on ``self.groups``'
    groups (those are the ones counted), and its leader does nothing that can fail after its
    first collective (a replay repeats a failure of its own code and cannot finish it).

    A subclass written against the older interface (its own ``get_data_input``) has that
    method taken as its ``transfer``, so it gets the same protocol.
    """

    name: ClassVar[str] = ""
    selectable: ClassVar[bool] = True
    """False for the floor, which is a measured limit rather than a way to ship data."""
    claims: ClassVar[str] = ""
    """Collectives per call, in words (checked by the tests that count them)."""
    raw_bytes: ClassVar[bool] = False
    """True for a strategy that moves bytes ``prepare`` packed rather than the batch it is
    handed (the floor): ``get_data_input`` runs its ``transfer`` as it is."""
    world: ClassVar[str | None] = None
    """The world a strategy needs when it cannot run on every torch.distributed world:
    ``"ray"`` (its ranks are connected Ray actors, ``world=ray``). Elsewhere it raises
    ``Unsupported`` at construction, on every rank; a job naming it is refused at config time."""
    actor_cpus: ClassVar[float] = 0
    """Ray CPUs the strategy's own actors reserve beside the ranks' (a store's controller and
    storage units on ``world=ray``): a harness that starts its own cluster advertises them
    too, so the strategy runs with the default cluster size."""
    footprint: ClassVar[Footprint] = Footprint()
    """Copies of the batch one call holds at its peak, by where they live
    (``strategies.core.footprint``): what a harness predicts a node's memory from before a job
    allocates anything; the node memory phase measures it."""
    phased: ClassVar[bool] = False
    """True where the leader's call marks its copy and its hand-over on
    ``strategies.core.phase_clock.CLOCK``, so a harness can split the call into plan, copy and
    signal (the header family and shm); elsewhere the whole call would read as plan."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("get_data_input")
        if own is None or own is Strategy.get_data_input:
            return
        if "transfer" in cls.__dict__:
            raise TypeError(
                f"{cls.__qualname__} defines both get_data_input and transfer; define transfer "
                "only (Strategy.get_data_input runs it and holds the contract)"
            )
        cls.transfer = own  # the older interface: its body is the hook
        cls.get_data_input = Strategy.get_data_input

    @dataclass(frozen=True, kw_only=True)
    class Options:
        """A strategy's options, one typed field each (none here). A strategy with options
        subclasses its base's ``Options`` as a nested ``@dataclass(frozen=True, kw_only=True)
        class Options``: one field per option with its default, a docstring under each field,
        ``Literal[...]`` for fixed choices, and the checks of their values in
        ``__post_init__``, whose messages show the value and what was expected."""

        def __post_init__(self) -> None:
            """Check each value against its field's annotation (``option_types.check_types``:
            ``views=maybe`` for a bool); a subclass's calls its base's first, then checks the
            values."""
            check_types(self)

    def __init__(self, groups: ProcessGroups, **options: Any) -> None:
        self.groups = groups
        self.options = self.options_of(**options)
        """The options this instance was built with (``Options``), checked."""

    @classmethod
    def options_of(cls, **options: Any) -> Options:
        """``cls.Options`` of these keyword options: an unknown one is refused in the one line
        ``check_options`` gives, a bad value by ``Options.__post_init__`` (its type first:
        ``option_types``), the strategy named in front of a wrong type."""
        who = cls.name or cls.__qualname__
        known = {f.name for f in fields(cls.Options)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise unknown_option(who, unknown[0], accepted_options(cls))
        try:
            return cls.Options(**options)
        except OptionTypeError as exc:
            raise OptionTypeError(f"{who}: {exc}") from None

    @classmethod
    def footprint_for(cls, **options) -> Footprint:
        """The footprint of an instance built with ``options`` (most strategies have one)."""
        return cls.footprint

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this strategy cannot run in this installation (an optional package missing), in
        one line naming what to install; None where it can. Checked before any rank starts."""
        return None

    def prepare(self, batch: DataProto) -> None:
        """Untimed set-up before a run of calls (the floor packs its buffer here)."""

    def set_aside(self) -> None:
        """Let go of what this strategy keeps between calls (a pack buffer) because another
        serves the calls that follow (``auto``'s switch); its next call rebuilds it. State
        its ranks share (a node channel's segments, agreed sizes) is kept: one rank alone
        must not drop it."""

    def delivers(self, key: tuple[str, ...]) -> bool:
        """Whether a receiver's batch holds the leaf at ``key`` (its key path): every leaf,
        unless the strategy's options say its receivers read only some (a lazy fetch's
        ``fields``). What a job checks a receiver's batch against."""
        return True

    def check(self, batch) -> None:
        """Leader, before any collective: raise for anything this strategy cannot carry that
        the contract allows (a dtype, a jagged leaf, a shape). The batch has passed
        ``contract.validate`` already; what this raises reaches every rank."""

    def transfer(self, batch) -> DataProto:
        """The collectives of one call, on every rank of the replica: the leader sends what it
        holds (or a failure batch, which it sends like any other); a receiver returns the
        object it was handed with what arrived set on it. Leader-side work that can fail
        belongs before the first collective."""
        raise NotImplementedError(f"strategy {self.name!r} implements no transfer")

    def get_data_input(self, batch: DataProto) -> DataProto:
        """ROLL's call, on every rank of the world (see the class docstring)."""
        g = self.groups
        if self.raw_bytes:
            return self.transfer(batch)
        if g.replica_ranks == (g.rank,):
            return batch  # a replica of one: nothing to send
        if not g.is_leader:
            out = self.transfer(batch)
            text = failure_in(out)
            if text is not None:
                raise settled(leader_failed(g, text))
            return out
        try:
            sending = self.leader_view(batch)
        except Exception as exc:  # noqa: BLE001 -- any type: it travels to the receivers
            self._ship(batch, exc)
            raise
        watched = self._watched_groups() if self.posts_collectives() else ()
        before = marks(watched)
        try:
            self.transfer(sending)
        except Exception as exc:  # noqa: BLE001 -- see below: finished, then raised
            if is_settled(exc):
                raise
            posted = posted_since(watched, before)
            if posted == {}:  # nothing went out: the failure can still take the batch's place
                self._ship(batch, exc)
            elif posted is not None:
                self._finish(sending, posted, exc)
            settled(exc)
            raise
        return batch

    def posts_collectives(self) -> bool:
        """Leader, before ``transfer``: whether this call may post a collective on the groups.
        The contract counts them (``completion.marks``) to finish a call that fails after its
        first one; a strategy that knows its call posts none (shm on one node, once connected:
        its signals are socket messages) answers False and the count is skipped: a failure is
        then shipped in the batch's place, as one before any collective is."""
        return True

    def leader_view(self, batch):
        """Leader, before any collective: validate ``batch`` (every leaf kind), run ``check``
        and return what ``transfer`` sends (``batch``, or a copy with lazy views resolved). A
        strategy overrides it only to do the same work faster (``PackedStrategy`` caches it
        per batch structure)."""
        lazy: list = []
        validate(batch, self.groups.rank, self.groups.device, lazy=lazy)
        self.check(batch)
        return resolve_lazy_views(batch, lazy)

    def _ship(self, batch, exc: Exception) -> None:
        """Leader: send a failure batch for ``exc`` through ``transfer`` and mark ``exc``
        settled (the caller raises it)."""
        g = self.groups
        sent = failure_batch(failure_text(exc), wants_non_tensor(batch), g.device)
        try:
            self.transfer(sent)
        except Exception as ship_exc:  # noqa: BLE001 -- reported with the leader's own error
            exc.add_note(
                f"rank {g.rank}: shipping this failure to the replica failed too "
                f"({failure_text(ship_exc)}); {self._abandoned(exc)}"
            )
        settled(exc)

    def _finish(self, sending, posted: dict[int, int], exc: Exception) -> None:
        """Leader: post every collective of this call that had not gone out when ``exc``
        was raised, with the batch's bytes (``completion.Replay``)."""
        try:
            with Replay(posted):
                self.transfer(sending)
        except Exception as replay_exc:  # noqa: BLE001 -- reported with the leader's own error
            exc.add_note(
                f"rank {self.groups.rank}: finishing the collectives announced before this "
                f"failure failed too ({failure_text(replay_exc)}); {self._abandoned(exc)}"
            )

    def abandon(self, text: str) -> bool:
        """Leader: ``text`` (its failure) could not reach the receivers through ``transfer``
        (shipping it failed too). Make them raise it instead of waiting, where this strategy
        has a way besides its collectives, and return whether no receiver is left waiting; by
        default there is none (False: they wait as long as their collective does, the group's
        timeout, and raise there)."""
        return False

    def _abandoned(self, exc: Exception) -> str:
        """``abandon`` for ``exc``, in words for the leader's error."""
        try:
            told = self.abandon(failure_text(exc))
        except Exception as abandon_exc:  # noqa: BLE001 -- reported with the leader's own error
            return f"telling the receivers otherwise failed too: {failure_text(abandon_exc)}"
        if told:
            return "no receiver is left waiting for it, and the strategy cannot be used again"
        return "its receivers may still wait (up to the group's timeout)"

    def _watched_groups(self) -> tuple:
        watched = self.__dict__.get("_watched")
        if watched is None:
            g = self.groups
            watched = distinct_groups(
                (
                    g.tp_cp_group,
                    g.pp_group,
                    g.replica_group,
                    g.cpu_tp_cp_group,
                    g.cpu_pp_group,
                    g.cpu_replica_group,
                )
            )
            self.__dict__["_watched"] = watched
        return watched

    @classmethod
    def plan(cls, layout, spec):
        """The collectives and local work of one call, for every replica (strategies.core.plan)."""
        raise NotImplementedError(f"strategy {cls.name!r} states no plan")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.groups.rank})"


def accepted_options(cls: type[Strategy]) -> list[str] | None:
    """The keyword options ``cls(groups, **options)`` accepts: the named parameters of the
    ``__init__``s along its MRO (a user's strategy may take plain keyword arguments), then,
    where an ``__init__`` with ``**options`` hands them down to ``Strategy.__init__``, the
    fields of ``cls.Options``. None when the chain ends in an ``__init__`` that takes
    ``**kwargs`` of its own (anything may be accepted)."""
    accepted: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if init is Strategy.__init__:
            return accepted + [f.name for f in fields(cls.Options) if f.name not in accepted]
        params = list(inspect.signature(init).parameters.values())[2:]  # self, groups
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        accepted += [p.name for p in params if p.kind in named and p.name not in accepted]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return accepted
    return None


def unknown_option(strategy: str, option: str, accepted: list[str] | None) -> TypeError:
    """The one-line error for an option ``strategy`` does not take, naming those it does."""
    return TypeError(
        f"strategy {strategy!r} has no option {option!r}; accepted options: "
        f"{sorted(accepted or []) or 'none'}"
    )
