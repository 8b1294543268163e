"""The one-sided engine store: the base of every strategy whose replica leader exposes its packed
message in a transfer engine's registered memory and sends its replica only where the message
lies; every other rank then reads it with a one-sided READ into a buffer of its own, and the
leader's CPU takes no part in the reads. ``mooncake`` (Mooncake's Transfer Engine) and ``nixl``
(a NIXL agent over UCX) fill it.

Built on the two bases it joins, not beside them: the call's shape is the pulled store's
(``strategies.core.pulled_store.PulledStore``: the leader's put, the signal over the replica's
host group, a barrier so the leader's buffer outlives every read, a failure in the signal's
place), and the message is the header family's (``strategies.core.packed.PackedStrategy``: one
flat buffer, its header first, unpacked as views), so a READ of one contiguous range moves the
whole batch, the non-tensor blob included.

An engine says how it starts in this process (``new_engine``, once per process: its listening
ports and threads are the process's, not an instance's), how a reader reaches it
(``engine_address``, and ``engine_credentials`` where an address is not enough: a NIXL agent's
metadata, with the keys of what it registered), how the leader's buffer is exposed and withdrawn
(``expose``, ``withdraw``) and how a reader reads a range into its own buffer (``read``). The
leader's send buffer is reused from call to call and exposed again only when it grows; a reader's
buffer is new on every call (the batch it returns is made of views of it, and the caller keeps
them).

Where the engines here listen: Mooncake's TCP transport binds every interface whatever it is told,
and UCX's listens on the host's interfaces, so an engine starts only where every interface the rank
sees is loopback (a network namespace of the job's own: the forked world's as root, a Ray world's);
elsewhere the strategy refuses on every rank, before any collective, saying where it runs. One node
only: the leader announces a loopback address, or a file on its node.
"""

from __future__ import annotations

import socket
import weakref
from dataclasses import dataclass

import torch

from strategies.core.contract import Unsupported
from strategies.core.footprint import Footprint
from strategies.core.header_format import DEFAULT_MAX_BYTES, Header, HeaderError, read_header
from strategies.core.lazy_fields import FieldsOptions, LazyFields
from strategies.core.netns import unavailable_reason
from strategies.core.packed import PackedStrategy
from strategies.core.pulled_store import PulledStore
from strategies.core.trace import WORK
from strategies.core.unpacker import unpack
from strategies.core.wire import Wire

_ENGINES: dict[str, object] = {}
"""This process's engines, by strategy name (``EngineStore.start_engine``)."""


@dataclass(frozen=True)
class Where:
    """What the leader announces: the engine to read from, the message's address in the
    leader's process and its length in bytes, and what else a reader needs to reach that engine
    (``EngineStore.engine_credentials``; empty for an engine an address reaches)."""

    engine: str
    address: int
    nbytes: int
    credentials: bytes = b""
    header_bytes: int = 0
    """The header's length: what a reader that reads only some fields reads first."""


def no_private_network_here() -> str | None:
    """Why no world here can give its ranks a network namespace of their own (the worlds' own
    check, ``strategies.core.netns``), or None: checked before any rank starts, so a job or a
    sweep leaves the engine out with this line instead of every rank refusing it."""
    reason = unavailable_reason()
    if reason is None:
        return None
    return (
        "its transport listens on every interface, and no world here can give the ranks a "
        f"loopback-only network namespace of their own ({reason}: a driver running as root "
        "with iproute2's ip makes one)"
    )


def private_network_problem() -> str | None:
    """Why an engine that listens on every interface may not start in this process (None: it
    may): the interfaces this process sees besides loopback."""
    names = sorted(name for _, name in socket.if_nameindex() if name != "lo")
    if not names:
        return None
    return (
        f"this rank's network has interfaces besides loopback ({', '.join(names)}), and the "
        "engine's transport listens on every interface; run it where the ranks have a "
        "loopback-only network namespace of their own: a forked world started as root, or "
        "world=ray as root"
    )


class EngineStore(LazyFields, PulledStore, PackedStrategy):
    """A transfer engine the readers READ from (see the module docstring). Options:
    ``Options`` (the message crosses no broadcast, so the wire's first-message sizes are not
    among them)."""

    @dataclass(frozen=True, kw_only=True)
    class Options(FieldsOptions):
        max_bytes: int = DEFAULT_MAX_BYTES
        """Readers refuse an announcement or a header that claims more than this."""

    footprint = Footprint(leader=1, receiver=1, leader_kept=1)
    """The leader's reused send buffer (the message), every reader's own copy of it."""
    store_scope = "replica"
    """One copy, the leader's, that every reader of the replica READs (``PulledStore.plan``
    prices the announcement, the barrier and the reads at the engine's store costs)."""
    reads_header = True
    listens = True
    """Whether the engine listens on the network (and may only start where the rank sees
    loopback alone); a recorded file read from the page cache (``self_load``) does not."""

    @classmethod
    def unavailable(cls) -> str | None:
        missing = cls.missing_package()
        if missing is not None or not cls.listens:
            return missing
        return no_private_network_here()

    @staticmethod
    def missing_package() -> str | None:
        """Why the engine's package cannot be imported here (one line naming what to install),
        or None."""
        return None

    def __init__(self, groups, **options) -> None:
        super().__init__(groups, **options)
        missing = self.unavailable()
        if missing is not None:
            raise Unsupported(f"rank {groups.rank}: {missing}")
        if groups.device.type != "cpu":
            raise Unsupported(
                f"rank {groups.rank}: {self.name} moves host memory here (the engine's DRAM "
                f"path); groups on {groups.device} would need its device path; use a CPU job"
            )
        if len(groups.replica_nodes) > 1:
            raise Unsupported(
                f"rank {groups.rank}: {self.name} reads only on the leader's node (a loopback "
                f"address, a file there): one node per replica only, and this replica spans "
                f"{len(groups.replica_nodes)} nodes"
            )
        problem = private_network_problem() if self.listens else None
        if problem is not None:
            raise Unsupported(f"rank {groups.rank}: {self.name}: {problem}")
        self.engine = self.start_engine()
        self._exposed: tuple[int, int] | None = None  # leader: (address, bytes) exposed now
        self._finalizer = None
        self._headers: dict = {}

    def new_wire(self) -> Wire:
        """The message crosses no broadcast: the wire only sizes the leader's buffer."""
        return Wire(self.groups.device, self.groups.rank, max_bytes=self.options.max_bytes)

    def check(self, batch) -> None:
        super().check(batch)
        self.check_fields(batch)

    # -- an engine's hooks -------------------------------------------------------------------
    def start_engine(self):
        """This process's engine of this kind, started on first use (``new_engine``) and kept:
        its ports and threads live as long as the process, however many instances come."""
        if self.name not in _ENGINES:
            _ENGINES[self.name] = self.new_engine()
        return _ENGINES[self.name]

    def new_engine(self):
        """A new engine of this kind, started (``start_engine`` calls it once per process)."""
        raise NotImplementedError

    def engine_address(self) -> str:
        """What a reader names to reach this rank's engine."""
        raise NotImplementedError

    def engine_credentials(self) -> bytes:
        """What a reader needs besides ``engine_address`` to read what this rank exposed (sent
        with every announcement); none by default."""
        return b""

    def expose(self, address: int, nbytes: int) -> None:
        """Leader: ``nbytes`` at ``address`` readable by the replica's engines."""
        raise NotImplementedError

    @staticmethod
    def withdraw(engine, address: int) -> None:
        """Leader: the range ``engine`` exposed at ``address`` no longer readable (a static
        method: it runs when the instance is gone)."""
        raise NotImplementedError

    def read(self, where: Where, into: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        """A reader: each ``(offset, nbytes)`` of ``ranges`` of the announced message into the
        same offset of ``into`` (a buffer of ``where.nbytes`` bytes); raise on any failure the
        engine reports."""
        raise NotImplementedError

    # -- the pulled store's hooks ------------------------------------------------------------
    def put(self, batch):
        """Leader: pack the message into the reused send buffer, expose it where it grew, and
        announce where it lies."""
        buf, header, total = self.pack(batch)
        fill = self.take_fill()
        if fill is not None:
            fill(total)
        storage = buf.untyped_storage()
        span = (storage.data_ptr(), storage.nbytes())
        if self._exposed != span:
            self._withdraw_exposed()
            self.expose(*span)
            self._exposed = span
            # The engine outlives this instance: what it exposed goes when the instance does.
            self._finalizer = weakref.finalize(self, self.withdraw, self.engine, span[0])
        self.last_header = header
        return Where(
            self.engine_address(), buf.data_ptr(), total, self.engine_credentials(),
            header.header_len,
        )  # fmt: skip

    def fetched(self, signal) -> str:
        return f"message of {signal.nbytes} bytes"

    def fetch(self, signal: Where):
        """A reader: the message into a buffer of its own, read by the engine, unpacked as
        views of that buffer."""
        g, limit = self.groups, self.options.max_bytes
        if not isinstance(signal, Where) or not isinstance(signal.nbytes, int) or signal.nbytes < 1:
            raise HeaderError(
                f"rank {g.rank}: {self.name}: the leader announced {signal!r}; expected where "
                "a message of at least one byte lies (engine, address, bytes)"
            )
        if signal.nbytes > limit:
            raise HeaderError(
                f"rank {g.rank}: {self.name}: the leader's announcement claims {signal.nbytes} "
                f"bytes, more than the maximum this receiver accepts ({limit} bytes; raise "
                "max_bytes to allow it)"
            )
        own = torch.empty(signal.nbytes, dtype=torch.uint8)
        if self.options.fields:
            header = self._read_fields(signal, own)
        else:
            self.read(signal, own, [(0, signal.nbytes)])
            WORK["copied_bytes"] += signal.nbytes
            header = read_header(own, limit, g.rank, self._headers)
        if header.total_bytes != signal.nbytes:
            raise HeaderError(
                f"rank {g.rank}: {self.name}: the message's header says {header.total_bytes} "
                f"bytes, the leader announced {signal.nbytes}"
            )
        self.last_header = header
        return unpack(own, header, td_device=None)

    def _read_fields(self, signal: Where, own: torch.Tensor) -> Header:
        """A reader of some fields: the header, then the bytes of the leaves it wants (and the
        non-tensor blob), each at its own offset in ``own`` (the pages of what is not read are
        never touched, so never resident); returns the header of what was read."""
        g, limit = self.groups, self.options.max_bytes
        if not 0 < signal.header_bytes <= signal.nbytes:
            raise HeaderError(
                f"rank {g.rank}: {self.name}: the leader announced a header of "
                f"{signal.header_bytes} bytes in a {signal.nbytes}-byte message"
            )
        self.read(signal, own, [(0, signal.header_bytes)])
        wanted, ranges = self.field_ranges(read_header(own, limit, g.rank, self._headers))
        self.read(signal, own, ranges)
        WORK["copied_bytes"] += signal.header_bytes + sum(n for _, n in ranges)
        return wanted

    def _withdraw_exposed(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # withdraws the old range, once
            self._finalizer = None
        self._exposed = None
