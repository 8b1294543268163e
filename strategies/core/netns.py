"""Whether this process can give what it starts a network namespace of its own: the one check
the harness's worlds (a forked world's ranks, a private Ray cluster, emulated nodes) and the
strategies whose engines listen on every interface (``strategies.core.engine_store``) share.
"""

from __future__ import annotations

import ctypes
import os
import shutil


def libc():
    """The C library, with errno kept (``unshare``, ``setns``)."""
    return ctypes.CDLL(None, use_errno=True)


def unavailable_reason() -> str | None:
    """Why this process cannot make a private network (None: it can)."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    if not hasattr(libc(), "unshare") or not hasattr(libc(), "setns"):
        return "no unshare/setns in the C library"
    return None
