"""``self_load``: no hand-off: every rank loads the batch itself from a recorded copy on disk, the
way its own data loader would. The baseline Megatron-Bridge chose (its PR #491 dropped the
tensor-parallel broadcast of the batch: every rank reads its batch from the dataset, because the
broadcast cost a memcpy and NVLink bandwidth); here the hand-off becomes the loader's read.

Reproduced: each receiver reads the whole batch from a file into a buffer of its own with
``pread`` and rebuilds it (the header family's message: ``strategies.core.packed``, the header
first, then every leaf; the batch is made of views of that buffer, as a loader's collated batch
is its own). With ``cache: warm`` the file's pages are in the page cache, as a dataset read
every epoch on a host with memory to spare is; with ``cache: cold`` the leader drops them
(``posix_fadvise(DONTNEED)``, the file written through first) before every call, so the
receivers read from the disk itself, as a first epoch or a dataset larger than the host's memory
does.

Adapted:

- the record: a loader reads a dataset prepared ahead; here the leader records the batch it is
  handed, once, into an unnamed file (``O_TMPFILE``) in ``directory``, and again only when the
  batch changed (another batch object, a tensor leaf replaced or written in place, other
  non-tensor contents where the call carries them): that call pays the packing and the write,
  a steady one does not. A workload that changes every call therefore pays a record every
  call: its figure is a write plus a read through the page cache, not a loader's. The file has
  no name, so a killed job leaves nothing on disk; receivers open it through
  ``/proc/<leader pid>/fd``;
- the leader announces which record to read (a small object broadcast) and a barrier ends the
  call (``strategies.core.pulled_store``'s shape): loaders that agree on the sample order need
  neither, at the price of about a microsecond-scale collective each here;
- one node per replica (a receiver reads the leader's file); CPU groups.

Options: see ``SelfLoad.Options`` (``directory``, ``cache``) and, as for every reader of the
leader's message, ``strategies.core.engine_store.EngineStore.Options`` (``max_bytes``,
``fields``: ROLL's lazy fetch).

Per call: 3 collectives over the replica (the announcement's size and bytes, the barrier) and
one read of the record per receiver.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import weakref
from dataclasses import dataclass
from typing import Literal

import torch

from strategies.core.contract import Unsupported, wants_non_tensor
from strategies.core.engine_store import EngineStore, Where
from strategies.core.footprint import Footprint
from strategies.core.packer import Packer


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)


def _read_all(fd: int, into: memoryview, offset: int) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            raise OSError(f"the record ended after {done} of {len(into)} bytes")
        done += got


class SelfLoad(EngineStore):
    """Every receiver reads the batch from the leader's record on disk (module docstring)."""

    @dataclass(frozen=True, kw_only=True)
    class Options(EngineStore.Options):
        directory: str = ""
        """Where the record's unnamed file lives (its file system must offer ``O_TMPFILE``:
        ext4, xfs, btrfs, tmpfs); empty: the system's temporary directory. A tmpfs directory
        keeps the record in memory whatever ``cache`` says."""
        cache: Literal["warm", "cold"] = "warm"
        """``warm``: the record's pages stay in the page cache; ``cold``: the leader drops them
        before every call, so the receivers read from the disk."""

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.cache not in ("warm", "cold"):
                raise ValueError(f"self_load: cache must be 'warm' or 'cold', got {self.cache!r}")
            if not isinstance(self.directory, str):
                raise ValueError(
                    f"self_load: directory must be a path (a string), got {self.directory!r}"
                )

    name = "self_load"
    store = "page_cache"
    store_scope = "node"
    """One record on the node, each receiver reads its own copy out of the page cache."""
    listens = False
    footprint = Footprint(leader=1, receiver=1, leader_kept=0)
    """The leader's pack buffer while it records (released after), every receiver's own copy;
    the record's pages are the page cache's, which no process's resident set counts."""
    claims = (
        "3 collectives over the replica (the announcement's size and bytes, the barrier); "
        "one pread of the leader's recorded batch per receiver"
    )

    def __init__(self, groups, **options) -> None:
        super().__init__(groups, **options)
        # Refused here, on every rank, before any collective: a directory the leader could
        # not write its record into fails no call halfway. Every rank resolves the same one
        # (the option, or the temporary directory its launcher's environment names for all).
        os.close(self._unnamed_file())
        self._record: int | None = None  # leader: the record's file descriptor
        self._recorded_key = None
        self._recorded_refs: list = []
        self._cold_synced = False

    # -- the engine's hooks: a file, read through the page cache --------------------------------
    def new_engine(self):
        return None

    def engine_address(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self._record}"

    def read(self, where: Where, into: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        # Opened on every call: the leader keeps the record open until the call's barrier, and
        # a descriptor's number names another file once the leader closed it.
        fd = os.open(where.engine, os.O_RDONLY)
        try:
            view = memoryview(into.numpy())
            for offset, nbytes in ranges:
                _read_all(fd, view[offset : offset + nbytes], offset)
        finally:
            os.close(fd)

    # -- the leader: record where the batch changed, announce --------------------------------
    def _key(self, batch) -> tuple:
        """What says the batch is the one recorded, beside its objects (``_objects``): every
        tensor leaf's storage, shape, stride, dtype and version counter (bumped by any
        in-place write), and the pickled non-tensor arrays where the call carries them (numpy
        has no version counter). meta_info is not in the message: every rank holds its own."""
        td = batch.batch
        leaves = (
            ()
            if td is None
            else tuple(
                (name, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version)
                for name, t in td.items(include_nested=True, leaves_only=True)
            )
        )
        carried = wants_non_tensor(batch)
        rest = pickle.dumps(batch.non_tensor_batch, protocol=5) if carried else b""
        return (leaves, rest)

    @staticmethod
    def _objects(batch) -> tuple:
        """The TensorDict and its tensor leaves, held by weak reference while recorded: a new
        batch can take a freed one's id and addresses (its key would match), never its
        identity while the old one lives."""
        td = batch.batch
        if td is None:
            return ()
        return (td, *(t for _, t in td.items(include_nested=True, leaves_only=True)))

    def _recorded(self, batch, key) -> bool:
        """Whether ``batch`` is the batch on record, unchanged."""
        if self._record is None or key != self._recorded_key:
            return False
        objects = self._objects(batch)
        return len(objects) == len(self._recorded_refs) and all(
            ref() is obj for ref, obj in zip(self._recorded_refs, objects)
        )

    def put(self, batch):
        key = self._key(batch)
        if not self._recorded(batch, key):
            self._write_record(batch)
            self._recorded_key = key
            self._recorded_refs = [weakref.ref(obj) for obj in self._objects(batch)]
        fd = self._record
        if self.options.cache == "cold":
            if not self._cold_synced:
                os.fsync(fd)  # only written-back pages can be dropped
                self._cold_synced = True
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return Where(self.engine_address(), 0, self._nbytes, b"", self._header_len)

    def _unnamed_file(self) -> int:
        """A new unnamed file (``O_TMPFILE``) in ``Options.directory``, open for reading and
        writing; Unsupported naming the directory and why where none can be made there."""
        directory = self.options.directory or tempfile.gettempdir()
        try:
            return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError as exc:
            raise Unsupported(
                f"rank {self.groups.rank}: self_load cannot make an unnamed file in "
                f"{directory!r} ({exc.strerror}); set strategy.options.directory to a directory "
                "on a file system with O_TMPFILE (ext4, xfs, btrfs, tmpfs)"
            ) from exc

    def _write_record(self, batch) -> None:
        buf, header, total = self.pack(batch)
        fill = self.take_fill()
        if fill is not None:
            fill(total)
        fd = self._unnamed_file()
        try:
            _write_all(fd, memoryview(buf[:total].numpy()))
        except BaseException:
            os.close(fd)
            raise
        self._drop_record()
        self._record = fd
        self._finalizer = weakref.finalize(self, _close, fd)
        self._nbytes = total
        self._cold_synced = False
        self.last_header = header
        self._header_len = header.header_len
        self.packer = Packer()  # a loader keeps no packed copy: the buffer goes with the record

    def _drop_record(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._record = None

    def fetched(self, signal) -> str:
        return f"record of {signal.nbytes} bytes"


STRATEGY = SelfLoad
