"""The zygote: the one process that forks workers, and has never held anything of a run.

Freed heap is not zeroed: a child forked from a process that once held requests, output, results
or file bytes could read them back from its own copy of that memory (/proc/self/mem). So the
supervisor, which handles all of those, never forks a worker; it is forked off the zygote before
anything of a run exists (once the libraries are loaded; under gVisor, before). The agent's first
process imports the libraries and becomes the zygote: it only ever receives the one-byte order
"fork a worker", and answers with the worker's pid and pipe ends (SCM_RIGHTS) and, later, its exit
status. Every worker therefore starts from the same pristine memory. A recycled stateless
container has a second zygote, without the data libraries (see ``lean``), serving the same orders.

The zygote keeps effective uid 0 (it must hand the sandbox uid to its children, who then lose every
capability), but its real and saved uids are ``ZYGOTE_UID``: the kernel lets a process signal
another when their real or saved uids match, so neither sandbox code nor the
supervisor's ``kill(-1)`` as the sandbox user (real uid 0) can reach it, and nothing but root
can trace or read it.
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import signal
import socket
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..handles import WorkerHandle
from ..identity import SANDBOX_UID

if TYPE_CHECKING:  # annotations only: shell imports IPython
    from ..worker.shell import SandboxShell

READY = b"R"  # the libraries are loaded
FORK = b"F"
SPAWNED = b"P"  # + pid, with the worker's four pipe ends attached
EXITED = b"X"  # + pid, wait status
RECORD = struct.Struct("<ii")
FORK_RETRY_S = 0.02  # after a fork that failed (no pid or memory to be had): the next try
# The uid after the sandbox user's (the host hands out even ones), so it is this container's own:
# the kernel charges the workers' pipe buffers, which the zygote creates, to its real uid, and a
# uid every sandbox shared would let one tenant's grown pipes shrink another's.
ZYGOTE_UID = SANDBOX_UID + 1 if SANDBOX_UID >= 1 << 30 else 999


class Spawned:
    __slots__ = ("handle",)

    def __init__(self, handle: WorkerHandle) -> None:
        self.handle = handle


class Ready:
    __slots__ = ()


class Exited:
    __slots__ = ("pid", "status")

    def __init__(self, pid: int, status: int) -> None:
        self.pid, self.status = pid, status


class Zygote:
    """The supervisor's side: order workers, receive them and their exit statuses."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def order(self) -> None:
        self.sock.setblocking(True)
        try:
            self.sock.send(FORK)
        finally:
            self.sock.setblocking(False)

    def receive(self) -> list[Spawned | Exited | Ready] | None:
        """What has arrived (possibly nothing); None when the zygote is gone."""
        out: list[Spawned | Exited | Ready] = []
        while True:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(64, socket.CMSG_SPACE(4 * array.array("i").itemsize))
            except BlockingIOError:
                return out
            except OSError:
                return None
            if not data:
                return None
            fds = array.array("i")
            for level, kind, blob in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(blob[: len(blob) - (len(blob) % fds.itemsize)])
            if data[:1] == READY:
                out.append(Ready())
                continue
            pid, status = RECORD.unpack_from(data, 1)
            if data[:1] == SPAWNED and len(fds) == 4:
                for fd in fds[:3]:
                    os.set_blocking(fd, False)
                handle = WorkerHandle(pid=pid, stdout=fds[0], stderr=fds[1], results=fds[2], control=fds[3])
                out.append(Spawned(handle))
            elif data[:1] == EXITED:
                out.append(Exited(pid, status))
            for fd in fds if data[:1] != SPAWNED else ():
                os.close(fd)


def serve(shell: SandboxShell, sock: socket.socket) -> None:
    """Fork a worker per order; report every child's exit. Ends when the supervisor is gone."""
    from ..worker import worker

    os.setresuid(ZYGOTE_UID, -1, ZYGOTE_UID)
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sock.send(READY)
    ordered = False  # a worker is owed: the last fork failed, and is tried again
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [], FORK_RETRY_S if ordered else None)
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 4096):
                    pass
        for pid, status in _reap():
            sock.send(EXITED + RECORD.pack(pid, status))
        if sock.fileno() in ready:
            order = sock.recv(16)
            if not order:
                return
            ordered = ordered or order == FORK
        if ordered:
            ordered = not deliver_worker(sock, lambda: worker.spawn(shell))


def deliver_worker(sock: socket.socket, spawn: Callable[[], WorkerHandle]) -> bool:
    """Fork a worker and hand it to the supervisor; False when no process can be made now.

    A run's processes may hold every pid the container has (a fork bomb, or its processes not yet
    reaped after the kill) or its memory: the fork fails, and is tried again shortly (init reaps
    what the kill left, and gives no event for it), while the supervisor waits its bounded time
    for the worker. The zygote never dies of it: without it the container could run no more code.
    """
    try:
        handle = spawn()
    except OSError:
        return False
    fds = [handle.stdout, handle.stderr, handle.results, handle.control]
    sock.sendmsg(
        [SPAWNED + RECORD.pack(handle.pid, 0)],
        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
    )
    for fd in fds:
        os.close(fd)
    return True


def _reap() -> list[tuple[int, int]]:
    exits: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return exits
        if pid == 0:
            return exits
        exits.append((pid, status))
