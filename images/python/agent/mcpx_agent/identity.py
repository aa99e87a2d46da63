"""Acting with the sandbox user's identity from the (root, capability-poor) supervisor.

The supervisor holds only CAP_KILL, CAP_SETUID and CAP_SETGID. It touches files with the sandbox
user's filesystem identity, so it never reads or writes with more rights than user code has, and
it signals with the sandbox user's effective uid, so a ``kill(-1)`` reaches exactly the sandbox
user's processes (not the zygote, which is root).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

SANDBOX_GID = 1000  # the group of every sandbox user; /mnt/data is writable for it


def _sandbox_uid() -> int:
    """This container's sandbox user, as the host chose it (a uid per sandbox, so that what the
    kernel counts per uid across the host is not shared with other tenants)."""
    text = os.environ.get("MCPX_SANDBOX_UID", "")
    uid = int(text) if text.isdigit() and len(text) <= 10 else 1000
    return uid if 1000 <= uid < 1 << 31 and uid != 65534 else 1000


SANDBOX_UID = _sandbox_uid()

LIBC = ctypes.CDLL(None, use_errno=True)  # the agent's one handle on libc (errno kept)


@contextlib.contextmanager
def effective_ids(uid: int = SANDBOX_UID, gid: int = SANDBOX_GID) -> Iterator[None]:
    """Switch only the effective ids (this process is single-threaded).

    The real and saved ids stay 0, so the sandbox user still cannot signal or trace us (the
    kernel checks the target's real and saved ids), and switching back restores the
    capabilities, which the kernel keeps while one of those ids is 0.
    """
    os.setresgid(-1, gid, -1)
    os.setresuid(-1, uid, -1)
    try:
        yield
    finally:
        os.setresuid(-1, 0, -1)
        os.setresgid(-1, 0, -1)


@contextlib.contextmanager
def as_sandbox_user() -> Iterator[None]:
    """Use the sandbox user's uid and gid for filesystem access.

    setfsuid is tried first; where it does not take (gVisor ignores it, and the call cannot
    report failure), the effective ids are switched instead.
    """
    LIBC.setfsgid(SANDBOX_GID)
    LIBC.setfsuid(SANDBOX_UID)
    took = LIBC.setfsuid(-1) == SANDBOX_UID and LIBC.setfsgid(-1) == SANDBOX_GID  # -1: query only
    if took:
        try:
            yield
        finally:
            LIBC.setfsuid(0)
            LIBC.setfsgid(0)
        return
    LIBC.setfsuid(0)
    LIBC.setfsgid(0)
    with effective_ids():
        yield
