"""``shm``: the batch reaches the ranks of a node through shared memory, not a socket.

The leader packs the batch once (the ``header`` family's message: binary header + one flat
buffer) straight into a shared segment, and tells each rank of its node with one socket
message once the header and the non-tensor blob are in, and again (a shared completion word,
or a second message where ranks share cores) once the leaves are; those ranks build their
batch as views of the segment, with no copy and no collective (``strategies.core.node_channel``
has the ring, the signals and the readers' reports of what they took and let go of). While a
receiver waits for the signal it maps the slot the message most likely lands in and views there
the header that most likely comes (``NextShape``); when the header bytes that arrive are those
(a stream of same-shaped batches, or a cycle of shapes), only the non-tensor blob is left to
read. The leader replays its plan of a structure it packed into the same slot before (``_replay``): the leaves
and the blob copied into the views made then, and the signal. Across
nodes it is hierarchical: the leader sends the message to one rank per other node (its node
leader, two point-to-point sends: the size, then the bytes straight from the segment), which
receives it into its own node's segment and signals its node the same way; each node link
carries the message once. A large message crosses in stripes (``stripe_min_bytes`` below):
the other ranks of the leader's node send their slices of it to their peers on the other
node, which write them into that node's segment before it is signalled.

A receiver's batch is copy-on-write: writing into it changes only that rank's copy, never the
segment or another rank's batch, and a batch held across calls is never overwritten (its slot
is not reused until every tensor of it is gone).

Batches on a GPU are staged: the segment is host memory, so the leader packs on its device and
copies the message into the segment (device to host, once), and every receiver copies it onto
its own device (host to device) and unpacks views of that copy, then lets the segment go. The
ranks of a node share the host, not the device, so this is one D2H and one H2D per rank
instead of a collective (CUDA IPC, which would skip the host, is not used).

Options: see ``Shm.Options``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from strategies.core.contract import DataProto, deliver, failure_text, settled, wants_non_tensor
from strategies.core.footprint import Footprint
from strategies.core.header_format import DIRECT, KIND_DENSE, Header
from strategies.core.node_signals import check_size_option
from strategies.core.node_store import NodeStore
from strategies.core.packer import NO_DIRECT
from strategies.core.parts import encode_non_tensor
from strategies.core.recent import NextShape
from strategies.core.segment_ring import Premap, Slot
from strategies.core.unpacker import unpack_non_tensor, unpack_tensors

DEFAULT_EARLY_MIN_BYTES = 0
"""Messages from this size on are signalled early (``early_min_bytes``): every one."""


def dense_only(header: Header) -> bool:
    """Whether every entry is a dense leaf in the message: its views read no byte, so they can
    be made before the bytes are written."""
    return all(e.kind == KIND_DENSE and e.offset != DIRECT for e in header.entries)


class Shm(NodeStore):
    """The node store whose readers view the message in place (see the module docstring)."""

    name = "shm"
    footprint = Footprint(leader=0, receiver=0, node=1)
    """Measured by the node memory phase (one slot of the segment: a large message reuses its
    slot once let go (a ring of small ones holds up to three); receivers view it)."""
    claims = (
        "no collective on a node: one socket message per node-local rank, and the completion "
        "word (a second message where ranks share cores); two point-to-point sends per other "
        "node of the replica"
    )

    @dataclass(frozen=True, kw_only=True)
    class Options(NodeStore.Options):
        views: bool = True
        """Receivers view the segment in place; False gives every receiver owned copies (one
        copy each) and releases the segment at once."""
        stage: bool | None = None
        """Stage through the groups' device (None: True for groups on a device, else False):
        the leader packs on its device and copies the message into the segment, every
        receiver copies it onto its own device; on host groups it gives owned copies the way
        a GPU job gets them (what the CPU tests check of the GPU path); False on a device is
        refused (a segment cannot be viewed there)."""
        early_min_bytes: int | None = DEFAULT_EARLY_MIN_BYTES
        """On one node, a message at least this large is signalled early: the leader writes
        the header and the non-tensor blob, signals, then copies the leaves and completes the
        message (``poll_us``), so each receiver checks the header, unpickles the blob and
        views the leaves while the leader copies; a failure meanwhile reaches every receiver
        as the leader's. Even the smallest batch gains (measured side by side against
        ``None``: the receivers' work overlaps the leader's copy, and the completion is in by
        the time they look for it). None: every message is signalled once, whole."""

        def __post_init__(self) -> None:
            super().__post_init__()
            check_size_option("early_min_bytes", self.early_min_bytes)

    def __init__(self, groups, **options) -> None:
        stage = self.options_of(**options).stage  # refused before the channel is made
        on_device = groups.device.type != "cpu"
        if stage is None:
            stage = on_device
        if on_device and not stage:
            raise ValueError(
                f"rank {groups.rank}: shm: stage=False views the shared segment in place, which "
                f"is host memory; groups on {groups.device} need stage=True (their default)"
            )
        super().__init__(groups, **options)
        self.stage = stage
        """Whether the message goes through the groups' device (``Options.stage`` resolved)."""
        self._next = NextShape()  # a reader: the header bytes that followed each one
        self._predicted: tuple[bytes, Header] | None = None
        """A reader: the next message's most likely header bytes and header (``_follow``);
        None after a message whose leaves are not all dense."""
        self.guessed = 0
        """A reader: calls whose batch was built while it waited (``_guess`` held)."""
        self.replayed = 0
        """The leader: calls that replayed their slot's plan of the structure (``_replay``)."""

    def publish(self, slot: Slot, batch: DataProto) -> tuple[Header, int]:
        """Leader: the slot's plan of this structure replayed (``_replay``), or the message put
        into the slot; signalled whole, or early (``_early``: the header and the blob first,
        the leaves copied after)."""
        replayed = self._replay(slot, batch)
        if replayed is not None:
            return replayed
        buf, header, total, fill = self.put(slot, batch)
        self.connect()
        if fill is not None and self._early(total):
            self._write_early(slot, total, fill)
        else:
            if fill is not None:
                fill(total)
            self.channel.hand_over(slot, buf[:total], announce=True)
        return header, total

    def take(self, batch: DataProto) -> DataProto:
        """A reader: the message viewed in the segment (guessed while it waited, or read when
        it came), or, staged or without views, copied."""
        g = self.groups
        guess = None if self.channel.is_node_leader else self._guess()
        buf = self.receive(guess.premap if guess else None)
        header, td, non_tensor = self._read(buf, guess)
        total = header.total_bytes
        self.agree(header, total)
        if td is not None:  # guessed, or viewed while the leaves were copied
            if guess is not None and td is guess.td:
                self.guessed += 1
            return deliver(batch, td, non_tensor)
        if self.stage:  # onto this rank's device; the segment goes with buf
            staged = torch.empty(total, dtype=torch.uint8, device=g.device)
            staged.copy_(buf[:total])
            del buf
            return deliver(batch, unpack_tensors(staged, header), non_tensor)
        td = unpack_tensors(buf[:total], header)
        if not self.options.views:
            td = td.clone()  # owned copies: the views (and the segment's hold) go with buf
        return deliver(batch, td, non_tensor)

    def _read(self, buf: torch.Tensor, guess: Guess | None):
        """A reader: (the header, the TensorDict or None, the non-tensor batch) of the message
        in ``buf``. Signalled early (``channel.pending``: the leader still copies the leaves),
        the blob is decoded and a batch of dense leaves viewed meanwhile; the completion is
        awaited whatever happens here, so the channel stays in step."""
        ch = self.channel
        try:
            header, td = self._header_of(buf, guess)
            host = guess.host if td is not None else None  # the guessed mapping's bytes
            early = ch.pending is not None
            if early:
                non_tensor = unpack_non_tensor(buf, header, host)
                if td is None and self.options.views and not self.stage and dense_only(header):
                    td = unpack_tensors(buf[: header.total_bytes], header)
        finally:
            ch.wait_complete()
        if not early:
            non_tensor = unpack_non_tensor(buf, header, host)
        return header, td, non_tensor

    def _guess(self) -> Guess | None:
        """A reader, before it waits: the channel's ``premap`` of the segment the next message
        most likely arrives in and, when the last message's header was of dense leaves only,
        the batch's tensors viewed in that mapping as the next header most likely lays them
        out: the one that followed the last header the last time it arrived (a job cycling
        shapes, batch after batch), else the last header again. None when there is no segment
        to guess."""
        premap = self.channel.premap()
        if premap is None:
            return None
        predicted = self._predicted
        if predicted is None or not self.options.views or self.stage:
            return Guess(premap)
        raw, header = predicted
        if header.total_bytes > premap.view.numel():
            return Guess(premap)
        td = unpack_tensors(premap.view, header)
        return Guess(premap, raw, header, td, memoryview(premap.view.numpy()))

    def _header_of(self, buf: torch.Tensor, guess: Guess | None):
        """The message's header (checked against the segment), and the guessed TensorDict
        when the message is in the guessed mapping and its header bytes are the guessed ones
        (else None)."""
        if guess is not None and guess.td is not None and guess.holds(buf):
            self._follow((guess.raw, guess.header))
            return guess.header, guess.td
        raw, header = self.stored_header(buf)
        self._follow((raw, header) if dense_only(header) else None)
        return header, None

    def _follow(self, now: tuple[bytes, Header] | None) -> None:
        """A reader: ``now`` (the header bytes and header of the message that arrived; None when
        not every leaf is dense) follows the last one; the next message's most likely header is
        what followed ``now`` the last time (``NextShape``), decoded already (``_headers``),
        else ``now`` again."""
        if now is None:
            self._predicted = None
            return
        raw = self._next.observe(now[0])
        header = now[1] if raw == now[0] else self._headers.get(raw)
        self._predicted = (raw, header) if header is not None else now

    def _replay(self, slot: Slot, batch: DataProto) -> tuple[Header, int] | None:
        """Leader, the plan per structure: when the slot's last message was laid out as this
        batch's (``Packer.replay``: its structure, checked by ``leader_view``, and its blob
        room; the header is in the segment, the views made), copy the leaves and the blob and
        signal, nothing else; returns the message's header and bytes. None (nothing written,
        the blob kept for ``pack``) for any other batch, a staged one, or a replica across
        nodes (those are ``put``)."""
        checked = self._checked
        if self.stage or checked is None or checked[0] is not batch.batch:
            return None
        ch = self.channel
        if not ch.node_local:
            return None
        blob = encode_non_tensor(batch.non_tensor_batch) if wants_non_tensor(batch) else None
        last = slot.packer.replay(
            checked[2], NO_DIRECT, blob, self.wire.next_expect, self.wire.expect, self.groups.device
        )
        if last is None:
            self._encoded = (batch, blob)
            return None
        self._checked = None
        parts, total = checked[1], last.total
        fill = slot.packer.filler(last, parts, blob)
        if self._early(total):
            self._write_early(slot, total, fill)
        else:
            fill(total)
            ch.publish(slot, total)
        self.replayed += 1
        return last.header, total

    def _early(self, total: int) -> bool:
        """Signal this message early (header and non-tensor blob first, the leaves after): on
        one node, from ``early_min_bytes`` on, so the readers check the header and decode the
        blob while the leader copies the leaves."""
        ch = self.channel
        early_min_bytes = self.options.early_min_bytes
        return (
            early_min_bytes is not None
            and total >= early_min_bytes
            and len(ch.nodes) == 1
            and bool(ch.readers)
        )

    def _write_early(self, slot, total: int, fill) -> None:
        """Leader, ``_early``: the non-tensor blob into ``slot`` (the header is in), the early
        signal, the leaves, the completion. A failure while the leaves are copied reaches
        every reader as this leader's (``abort``)."""
        fill.blob()
        self.channel.publish(slot, total, early=True)
        try:
            fill(total)
        except BaseException as exc:
            self.channel.abort(slot, failure_text(exc))
            raise settled(exc) from None
        self.channel.complete(slot)


@dataclass
class Guess:
    """What a reader built while it waited (``Shm._guess``)."""

    premap: Premap
    raw: bytes | None = None
    """The last message's header bytes: the guess holds when the new message starts with them."""
    header: Header | None = None
    td: TensorDict | None = None
    """The tensors as ``header`` lays them out, viewed in ``premap``'s mapping."""
    host: memoryview | None = None
    """``premap``'s mapping as bytes: the header is compared, the blob read, in place."""

    def holds(self, buf: torch.Tensor) -> bool:
        """Whether the message ``buf`` is in the guessed mapping and laid out as guessed."""
        n = len(self.raw)
        return (
            buf.data_ptr() == self.premap.view.data_ptr()
            and buf.numel() >= max(n, self.header.total_bytes)
            and self.host[:n].tobytes() == self.raw  # one memcmp, not a compare per byte
        )


STRATEGY = Shm
