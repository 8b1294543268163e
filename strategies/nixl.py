"""``nixl``: the batch through NIXL (NVIDIA Inference Xfer Library, Dynamo's data plane), one-sided
READs of host memory between NIXL agents over its UCX backend. The real package (``nixl-cu12``,
the ``engines`` extra; its CUDA build imports and moves DRAM with no GPU).

Reproduced (the agent's own Python API, as NIXL's examples use it):

- every rank makes one ``nixl_agent`` per process with the UCX backend, named after its rank and
  process, with no listener thread (metadata travels with the announcement) and no progress
  thread (NIXL's spins a core for the life of the process): a reader's agent makes progress while
  it polls its transfer, the leader's while it waits at the call's barrier;
- the leader packs the batch into the header family's message (one flat buffer, the header
  first: ``strategies.core.packed``), registers that buffer (``register_memory``) the first
  time and whenever it grows, and announces (agent name, address, length, its agent's metadata)
  over the replica's host group;
- each reader registers a buffer of its own, loads the leader's metadata where it changed
  (``add_remote_agent``: the remote keys of what the leader registered), and READs the whole
  message with ``initialize_xfer("READ", ...)``, ``transfer`` and ``check_xfer_state`` until
  ``DONE``; it deregisters its buffer and unpacks views of it: it owns its batch;
- after a barrier over the replica (no reader still reads) the leader's buffer is free for the
  next call; it is deregistered when the instance goes.

Adapted: Dynamo exchanges agents' metadata through its own store (etcd) or NIXL's listener
thread; here it rides the announcement (a few hundred bytes), so no port of NIXL's is opened.
UCX itself listens on the host's interfaces, so it starts only in a network namespace of the
job's own (``strategies.core.engine_store``); one node per replica. UCX's InfiniBand modules are
not loaded (``UCX_MODULES=^ib`` unless the user sets it): the wheel's bundled libnl crashes
every process that made an agent at exit once they are.

Options: see ``strategies.core.engine_store.EngineStore.Options`` (``max_bytes``; ``fields``:
ROLL's lazy fetch, the readers read only the named fields' bytes).

Per call: 3 collectives over the replica (the announcement's size and bytes, the barrier) and
one READ per reader from the leader's agent.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from strategies.core.engine_store import EngineStore, Where

EXTRA = "pip install 'bcastbench[engines]'"
_REGISTERED: dict[int, object] = {}
"""Leader: what ``register_memory`` returned for each address this process exposed (what
``deregister_memory`` takes back)."""
_PEERS: dict[str, bytes] = {}
"""Reader: the metadata this process's agent holds of each remote agent."""

# NIXL's Python logging prints every agent's INFO lines to standard output, read when its
# module loads; the job's own output would be buried (and a pipe reading stdout confused). A
# user's setting wins.
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
# UCX's InfiniBand modules load the wheel's bundled libnl-route, whose exit-time destructor
# crashes the process (SIGSEGV in rtnl_tc_unregister) once an agent existed: every rank would
# end in a segfault. Host memory on one node needs none of them; a user's setting wins.
os.environ.setdefault("UCX_MODULES", "^ib")


def missing_package() -> str | None:
    """Why NIXL's Python API cannot be imported here (one line naming what to install)."""
    try:
        from nixl_cu12._api import nixl_agent  # noqa: F401 -- optional: the engines extra
    except ImportError as exc:
        return f"NIXL does not import ({exc}); {EXTRA}"
    return None


def start_agent(name: str):
    """A NIXL agent with the UCX backend, as every rank starts one."""
    from nixl_cu12._api import nixl_agent, nixl_agent_config  # optional: the engines extra

    # No progress thread: NIXL's spins a core for the life of the process (its Python API
    # sets no delay), in every rank that ever made an agent. The leader makes progress
    # itself while the readers read (``Nixl.readers_through``).
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


class Nixl(EngineStore):
    """NIXL agents over UCX: the leader registers, every reader READs (module docstring)."""

    name = "nixl"
    store = "nixl"
    claims = (
        "3 collectives over the replica (the announcement's size and bytes, the barrier); "
        "one NIXL READ per reader from the leader's agent"
    )

    @staticmethod
    def missing_package() -> str | None:
        return missing_package()

    def new_engine(self):
        return start_agent(f"bcastbench-rank{self.groups.rank}-pid{os.getpid()}")

    def readers_through(self) -> None:
        # Without a progress thread a READ of the leader's memory moves only while the
        # leader's agent makes progress: it does so until the barrier completes (a failed
        # or timed-out barrier completes too, and wait() raises its error).
        work = dist.barrier(group=self.groups.cpu_replica_group, async_op=True)
        while not work.is_completed():
            self.engine.get_new_notifs()
        work.wait()

    def engine_address(self) -> str:
        return self.engine.name

    def engine_credentials(self) -> bytes:
        return self._metadata

    def expose(self, address: int, nbytes: int) -> None:
        _REGISTERED[address] = self.engine.register_memory([(address, nbytes, 0, "")], "DRAM")
        # Taken once per registration: the remote keys a reader needs to READ this range.
        self._metadata = self.engine.get_agent_metadata()

    @staticmethod
    def withdraw(engine, address: int) -> None:
        registered = _REGISTERED.pop(address, None)
        if registered is not None:
            engine.deregister_memory(registered)

    def read(self, where: Where, into: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        agent, rank = self.engine, self.groups.rank
        if _PEERS.get(where.engine) != where.credentials:
            if where.engine in _PEERS:
                agent.remove_remote_agent(where.engine)
                del _PEERS[where.engine]
            agent.add_remote_agent(where.credentials)
            _PEERS[where.engine] = where.credentials
        mine = agent.register_memory([(into.data_ptr(), where.nbytes, 0, "")], "DRAM")
        handle = None
        try:
            # One transfer of every range: NIXL posts them together.
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs([(into.data_ptr() + o, n, 0) for o, n in ranges], "DRAM"),
                agent.get_xfer_descs([(where.address + o, n, 0) for o, n in ranges], "DRAM"),
                where.engine,
            )
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)  # which makes this agent's progress
            if state == "ERR":
                raise RuntimeError(
                    f"rank {rank}: nixl: the READ of {where.nbytes} bytes from agent "
                    f"{where.engine} failed (state ERR)"
                )
        finally:
            if handle is not None:
                agent.release_xfer_handle(handle)
            agent.deregister_memory(mine)


STRATEGY = Nixl
