"""A world's own network: the thread that starts a private Ray cluster (or forks a forked
world's ranks) moves into a new network namespace holding only a loopback interface, and
everything it starts (the GCS, the raylet, the workers and the driver's own Ray threads; the
ranks) lives there; ``visiting`` takes a thread back in for a while.

Ray's gRPC servers listen on every interface, and Ray has no setting to change that. Inside a
namespace whose only interface is loopback, "every interface" is loopback: nothing outside
this machine, and nothing on it outside the namespace, can reach them. Needs root (and
``ip``); elsewhere the cluster stays on the host's network, with its token in front.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from contextlib import contextmanager

from strategies.core.netns import libc as _libc
from strategies.core.netns import unavailable_reason

CLONE_NEWNET = 0x40000000


class PrivateNetwork:
    """Enter a fresh loopback-only network namespace on this thread; ``leave`` returns the
    thread to the one it had. Processes started in between stay in the private one."""

    def __init__(self) -> None:
        self._home: int | None = None
        self.thread: int | None = None

    @property
    def entered(self) -> bool:
        return self._home is not None

    def enter(self) -> bool:
        """Move this thread; False (and nothing changed) where that is not possible."""
        if self.entered or unavailable_reason() is not None:
            return self.entered
        home = namespace_handle()
        if _libc().unshare(CLONE_NEWNET) != 0:
            os.close(home)
            return False
        self._home, self.thread = home, threading.get_ident()
        up = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True)
        if up.returncode != 0:
            self.leave()
            return False
        return True

    def leave(self) -> None:
        """Back to the namespace this thread had (from the thread that entered)."""
        if self._home is None:
            return
        if threading.get_ident() != self.thread:
            raise RuntimeError("PrivateNetwork.leave must run on the thread that entered it")
        err = _libc().setns(self._home, CLONE_NEWNET)
        os.close(self._home)
        self._home = None
        if err != 0:
            raise OSError(ctypes.get_errno(), "setns back to the host's network failed")


def namespace_handle() -> int:
    """A handle (file descriptor) on the network namespace this thread is in now: to come back
    to, or for ``visiting`` later (the caller closes it)."""
    return os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)


@contextmanager
def visiting(namespace: int | None):
    """This thread inside ``namespace`` (a ``namespace_handle``) for the block, then back where
    it was; nothing where it is None. A driver reads its ranks' answers there: torch passes a
    tensor in an answer as a descriptor through the sender's abstract Unix socket, and an
    abstract socket is reachable only from its own network namespace."""
    if namespace is None:
        yield
        return
    home = namespace_handle()
    try:
        if _libc().setns(namespace, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns into the world's network failed")
        yield
    finally:
        err = _libc().setns(home, CLONE_NEWNET)
        os.close(home)
        if err != 0:
            raise OSError(ctypes.get_errno(), "setns back from the world's network failed")
