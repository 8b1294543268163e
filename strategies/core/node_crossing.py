"""The node channel across nodes: the replica leader's message to every other node's leader,
whole or in stripes that the ranks of the leader's node send to their peers on that node.

A part of ``NodeChannel`` (``strategies.core.node_channel``), which sets the state every part
reads (``groups``, ``nodes``, ``stripe_min_bytes``); this part keeps its own
(``_init_crossing``). The sends are point-to-point on the replica's gloo group.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import time

import numpy as np
import torch
import torch.distributed as dist

from strategies.core.groups import Stripe, stripes
from strategies.core.node_signals import RELEASE, SIGNAL, STRIPE_MAGIC, STRIPED, ShmError
from strategies.core.phase_clock import CLOCK
from strategies.core.segment_ring import Slot


class NodeCrossing:
    """The crossing of nodes of a ``NodeChannel``: ``hand_over`` on the replica leader,
    ``receive_from_leader`` on every other node's leader, and a stripe per rank in between."""

    def _init_crossing(self) -> None:
        self._stripes_of: tuple[int, tuple] = (-1, ())  # (message bytes, its stripes)

    def hand_over(self, slot: Slot, buf: torch.Tensor, announce: bool) -> None:
        """Replica leader: ``buf`` (the message in ``slot``'s segment) to every other node's
        leader and to this node's readers. The point-to-point sends (the size first when
        ``announce``, then the bytes or this rank's stripes of them) are posted before this
        node is signalled, so the other nodes' transfers run while it signals; then they are
        waited for. A send that fails to post leaves nobody waiting for a signal: nothing was
        signalled yet."""
        g = self.groups
        before = CLOCK.switch("signal")
        others = g.node_leaders[1:]
        handles = []
        if announce and others:
            size = torch.tensor([buf.numel()], dtype=torch.int64)
            handles += [dist.isend(size, dst, group=g.cpu_replica_group) for dst in others]
        handles += self._send_stripes(buf, buf.numel())
        self.publish(slot, max(buf.numel(), 1))
        for h in handles:
            h.wait()
        CLOCK.switch(before)

    def receive_from_leader(self, nbytes: int | None, max_bytes: int) -> torch.Tensor:
        """A node leader other than the replica leader: the replica leader's bytes straight into
        this node's segment (``nbytes``, or the size it announces first when None), signalled
        to this node; returns this rank's own copy-on-write view of them."""
        g = self.groups
        if nbytes is None:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, g.leader, group=g.cpu_replica_group)
            nbytes = int(size[0])
            if not 0 < nbytes <= max_bytes:
                raise ShmError(
                    f"rank {g.rank}: shm: the leader announced {nbytes} bytes; expected 1 to "
                    f"max_bytes={max_bytes}"
                )
        slot = self.writer_slot()
        view = slot.buffer(max(nbytes, 1))
        mine, *theirs = self._node_stripes(nbytes)
        if theirs:
            self._request_stripes(slot, theirs, nbytes)
        dist.recv(view[mine.lo : mine.hi], mine.sender, group=g.cpu_replica_group)
        if theirs:
            self._wait_striped([s.receiver for s in theirs], self.sequence + 1)
        self.publish(slot, max(nbytes, 1))
        return self.view_own(slot, max(nbytes, 1))[:nbytes]

    def _node_stripes(self, nbytes: int) -> tuple[Stripe, ...]:
        """This rank's node's stripes of a message of ``nbytes`` (a node other than the
        replica leader's), its node leader's first."""
        me = self.groups.rank
        return next(node for node in self._stripes(nbytes) if any(s.receiver == me for s in node))

    def _stripes(self, nbytes: int) -> tuple[tuple[Stripe, ...], ...]:
        """``groups.stripes`` for this replica's nodes, remembered for the last size (a
        stream of same-sized messages asks for the same stripes on both sides every call)."""
        if self._stripes_of[0] != nbytes:
            self._stripes_of = (nbytes, stripes(self.nodes, nbytes, self.stripe_min_bytes))
        return self._stripes_of[1]

    def _send_stripes(self, buf: torch.Tensor, nbytes: int) -> list:
        """Post this rank's stripes of the message in ``buf`` to the other nodes (the replica
        leader's node only); returns the sends' handles."""
        g = self.groups
        return [
            dist.isend(buf[s.lo : s.hi], s.receiver, group=g.cpu_replica_group)
            for node in self._stripes(nbytes)
            for s in node
            if s.sender == g.rank
        ]

    def _request_stripes(self, slot: Slot, theirs, nbytes: int) -> None:
        """Node leader: hand each stripe's receiver the slot's segment to write its stripe of
        the next message into. A request that cannot be sent leaves a stripe nobody writes:
        the channel closes, so every rank of the node learns at once."""
        seg = slot.segment
        msg = SIGNAL.pack(STRIPE_MAGIC, slot.index, seg.generation, self.sequence + 1, nbytes)
        for s in theirs:
            sock = self.socks.get(s.receiver)
            try:
                if sock is None:
                    raise ShmError(self.broken.get(s.receiver, "not connected"))
                socket.send_fds(sock, [msg], [] if s.receiver in slot.delivered else [seg.fd])
            except Exception as exc:  # noqa: BLE001 -- named in the error below
                self.close()
                raise ShmError(
                    f"rank {self.groups.rank}: shm: node-local rank {s.receiver} cannot be asked "
                    f"for its stripe ({type(exc).__name__}: {exc}); the channel is closed"
                ) from None
            slot.delivered.add(s.receiver)

    def _wait_striped(self, ranks: list[int], sequence: int) -> None:
        """Node leader: block until every rank of ``ranks`` has reported its stripe of message
        ``sequence`` written, as long as a gloo receive would wait; a rank that dies closes the
        channel, so the node's other ranks learn at once."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._drain()
            left = [r for r in ranks if self.striped_upto.get(r, 0) < sequence]
            if not left:
                return
            gone = [r for r in left if r not in self.socks]
            why = None
            if gone:
                why = "; ".join(f"rank {r}: {self.broken.get(r)}" for r in gone)
            elif time.monotonic() >= deadline:
                why = f"no report within {self.timeout_s:.0f} s (the replica's gloo timeout)"
            if why:
                self.close()
                raise ShmError(
                    f"rank {self.groups.rank}: shm: node-local ranks {left} did not write their "
                    f"stripes ({why}); the channel is closed"
                )
            select.select([self.socks[r] for r in left], [], [], deadline - time.monotonic())

    def _write_stripe(self, index: int, generation: int, sequence: int, nbytes: int) -> None:
        """A stripe receiver: this rank's stripe of message ``sequence`` straight from its
        sender into the slot's segment (a shared mapping, dropped at once), then the report."""
        rank = self.groups.rank
        fd = self._fd(index, generation)
        size = os.fstat(fd).st_size
        mine = [s for s in self._node_stripes(nbytes) if s.receiver == rank]
        if nbytes > size or len(mine) != 1 or mine[0].sender == self.groups.leader:
            raise ShmError(
                f"rank {rank}: shm: a stripe request for {nbytes} bytes in a {size}-byte "
                f"segment that gives this rank no stripe of its own"
            )
        s = mine[0]
        mapping = mmap.mmap(fd, s.hi, flags=mmap.MAP_SHARED)
        array = np.frombuffer(mapping, dtype=np.uint8)
        try:
            dist.recv(
                torch.from_numpy(array[s.lo :]), s.sender, group=self.groups.cpu_replica_group
            )
        finally:
            del array
            try:
                mapping.close()
            except BufferError:  # still viewed by a failed receive's frame: it goes with it
                pass
        try:
            self.sock.send(RELEASE.pack(STRIPED, index, generation, sequence))
        except OSError as exc:
            raise ShmError(
                f"rank {rank}: shm: node leader rank {self.node_leader}: its stripe report "
                f"failed ({exc})"
            ) from None
