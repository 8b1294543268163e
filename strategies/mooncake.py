"""``mooncake``: the batch through Mooncake's Transfer Engine, the engine ROLL's ``RemoteBatch``,
TransferQueue's Mooncake backend and slime move rollout data with: the replica leader registers
its packed message with its engine and tells the replica where it lies; every other rank reads it
with ``transfer_sync_read`` into a buffer of its own. The real package
(``mooncake-transfer-engine-non-cuda``, the ``engines`` extra; Debian's ``libibverbs1`` for its
import, installed by the Makefile).

Reproduced (the engine's own Python API, as its documentation's quick start uses it):

- every rank starts one ``TransferEngine`` per process, with the peer-to-peer handshake
  (``P2PHANDSHAKE``: no etcd or metadata server) over the TCP transport on loopback, and is
  reached at ``127.0.0.1:<get_rpc_port()>``;
- the leader packs the batch into the header family's message (one flat buffer, the header
  first: ``strategies.core.packed``), registers that buffer (``register_memory``) the first time
  and whenever it grows, and announces (engine, address, length) over the replica's host group;
- each reader reads the whole message with one ``transfer_sync_read`` into its own buffer and
  unpacks views of it: it owns its batch, as any pull gives;
- after a barrier over the replica (no reader still reads) the leader's buffer is free for the
  next call; it is unregistered when the instance goes.

Adapted: ROLL's ``RemoteBatch`` hands the readers keys through Ray and fetches fields lazily
through Mooncake Store; here the announcement goes over the replica group and the read is the
whole message, the engine's own one-sided path without the store's master. Its TCP transport
listens on every interface even when told loopback, so it starts only in a network namespace of
the job's own (``strategies.core.engine_store``); one node per replica.

Options: see ``strategies.core.engine_store.EngineStore.Options`` (``max_bytes``; ``fields``:
ROLL's lazy fetch, the readers read only the named fields' bytes).

Per call: 3 collectives over the replica (the announcement's size and bytes, the barrier) and
one READ per reader from the leader's engine.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

from strategies.core.engine_store import EngineStore, Where

EXTRA = "pip install 'bcastbench[engines]' (and Debian's libibverbs1, which make setup installs)"
HOST = "127.0.0.1"

# Mooncake's own log level, read once when its library loads (before ``missing_package`` first
# imports it): every rank's INFO lines (topology, handshakes) would bury the job's own output.
# A user's setting wins.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def missing_package() -> str | None:
    """Why ``mooncake.engine`` cannot be imported here (one line naming what to install)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401 -- optional: the engines extra
    except ImportError as exc:
        return f"mooncake's transfer engine does not import ({exc}); {EXTRA}"
    return None


def _capturing_stderr(start):
    """``start()``'s result and what it wrote to this process's standard error meanwhile: a
    started engine logs an error-level line on every rank (its own segment not yet published,
    before any logging is set up), which only a failed start should show."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            result = start()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        return result, f.read().decode(errors="replace")


class Mooncake(EngineStore):
    """Mooncake's Transfer Engine: the leader registers, every reader READs (module docstring)."""

    name = "mooncake"
    store = "mooncake"
    claims = (
        "3 collectives over the replica (the announcement's size and bytes, the barrier); "
        "one transfer_sync_read per reader from the leader's engine"
    )

    @staticmethod
    def missing_package() -> str | None:
        return missing_package()

    def new_engine(self):
        from mooncake.engine import TransferEngine  # optional: the engines extra

        engine = TransferEngine()
        rc, said = _capturing_stderr(lambda: engine.initialize(HOST, "P2PHANDSHAKE", "tcp", ""))
        if rc != 0:
            raise RuntimeError(
                f"rank {self.groups.rank}: mooncake: TransferEngine.initialize({HOST!r}, "
                f"'P2PHANDSHAKE', 'tcp') returned {rc}; it said: {said.strip() or 'nothing'}"
            )
        return engine

    def engine_address(self) -> str:
        return f"{HOST}:{self.engine.get_rpc_port()}"

    def expose(self, address: int, nbytes: int) -> None:
        rc = self.engine.register_memory(address, nbytes)
        if rc != 0:
            raise RuntimeError(
                f"rank {self.groups.rank}: mooncake: register_memory of {nbytes} bytes "
                f"returned {rc}"
            )

    @staticmethod
    def withdraw(engine, address: int) -> None:
        engine.unregister_memory(address)

    def read(self, where: Where, into: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        for offset, nbytes in ranges:
            rc = self.engine.transfer_sync_read(
                where.engine, into.data_ptr() + offset, where.address + offset, nbytes
            )
            if rc != 0:
                raise RuntimeError(
                    f"mooncake: transfer_sync_read of {nbytes} bytes at offset {offset} from "
                    f"{where.engine} returned {rc}"
                )


STRATEGY = Mooncake
