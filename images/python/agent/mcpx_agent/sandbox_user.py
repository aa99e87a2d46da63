"""Acting on the sandbox user's processes and files from the (root, capability-poor) supervisor.

The supervisor holds only CAP_KILL, CAP_SETUID and CAP_SETGID. It touches files with the
sandbox user's filesystem identity (setfsuid), so it never reads or writes with more rights than
user code has, and it kills with ``kill(-1)``, which signals every process but itself and init.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import stat
import time
from collections.abc import Iterator

SANDBOX_UID = 1000
SANDBOX_GID = 1000
WIPED_DIRS = ("/tmp", "/mnt/data", "/dev/shm", "/dev/mqueue")  # mqueue: POSIX message queues

_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def as_sandbox_user() -> Iterator[None]:
    """Use uid/gid 1000 for filesystem access in this (single-threaded) process.

    setfsuid is tried first; where it does not take (gVisor ignores it, and the call cannot
    report failure), the effective ids are switched instead: the real and saved ids stay 0, so
    uid 1000 still cannot signal or trace us, and switching back restores our capabilities.
    """
    _libc.setfsgid(SANDBOX_GID)
    _libc.setfsuid(SANDBOX_UID)
    effective = _libc.setfsuid(-1) != SANDBOX_UID or _libc.setfsgid(-1) != SANDBOX_GID  # -1: query only
    if effective:
        _libc.setfsuid(0)
        _libc.setfsgid(0)
        os.setresgid(-1, SANDBOX_GID, -1)
        os.setresuid(-1, SANDBOX_UID, -1)
    try:
        yield
    finally:
        if effective:
            os.setresuid(-1, 0, -1)
            os.setresgid(-1, 0, -1)
        else:
            _libc.setfsuid(0)
            _libc.setfsgid(0)


def kill_everything(reap: object, deadline_s: float = 3.0) -> bool:
    """SIGKILL every process except init and us until none is left. False if some survive.

    ``kill(-1)`` walks the task list under the kernel's lock, so a fork bomb cannot outrun it,
    and a pending SIGKILL aborts a fork in progress. ``reap`` collects our own children.
    """
    deadline = time.monotonic() + deadline_s
    pause = 0.0001
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return True
        if callable(reap):
            reap()
        remaining = deadline - time.monotonic()
        if remaining < 0:
            return False
        # Sleep until one of them has exited instead of polling (a process with a large heap
        # takes milliseconds to tear down); short pauses only while init reaps the zombies.
        if _await_an_exit(remaining):
            pause = 0.0001
        else:
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
        if callable(reap):
            reap()


def _await_an_exit(timeout_s: float) -> bool:
    """Block until some process other than init and us exits; False if none is still running."""
    me = os.getpid()
    fds: list[int] = []
    try:
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in (1, me):
                continue
            try:
                fds.append(os.pidfd_open(int(name)))
            except (OSError, AttributeError):  # gone already, or no pidfd (old kernel, gVisor)
                continue
        if not fds:
            return False
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        if poller.poll(0):
            return False  # one has exited and waits to be reaped
        poller.poll(max(1, int(timeout_s * 1000)))
        return True
    finally:
        for fd in fds:
            os.close(fd)


def wipe() -> list[str]:
    """Empty the writable places user code can reach. Returns what could not be removed."""
    leftovers: list[str] = []
    with as_sandbox_user():
        for top in WIPED_DIRS:
            try:
                entries = os.listdir(top)
            except OSError:
                continue
            for name in entries:
                path = os.path.join(top, name)
                if not _remove(path):
                    leftovers.append(path)
    remove_ipc_objects()
    return leftovers


def _remove(path: str) -> bool:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if stat.S_ISDIR(mode):
        _make_traversable(path)
        shutil.rmtree(path, onerror=_fix_and_retry)
        return not os.path.lexists(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _make_traversable(path: str) -> None:
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)


def _fix_and_retry(function: object, path: str, _exc_info: object) -> None:
    # A directory the user made unreadable or unwritable: we own it (fsuid), so open it up.
    parent = os.path.dirname(path)
    _make_traversable(parent)
    _make_traversable(path)
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def remove_ipc_objects() -> None:
    """Remove SysV IPC objects of the sandbox user (private IPC namespace, but runs share it)."""
    tables = {"shm": 0, "msg": 1, "sem": 2}
    pending: list[tuple[int, int]] = []
    for name, kind in tables.items():
        try:
            with open(f"/proc/sysvipc/{name}") as handle:
                lines = handle.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 1:
                pending.append((kind, int(fields[1])))
    if not pending:
        return
    # IPC_RMID checks the effective uid, not the fs uid: do it in a short-lived uid-1000 child.
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
            os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
            for kind, ident in pending:
                _rmid(kind, ident)
        finally:
            os._exit(0)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _rmid(kind: int, ident: int) -> None:
    ipc_rmid = 0
    if kind == 0:
        _libc.shmctl(ident, ipc_rmid, None)
    elif kind == 1:
        _libc.msgctl(ident, ipc_rmid, None)
    else:
        _libc.semctl(ident, 0, ipc_rmid)


def oom_kills() -> int | None:
    """The memory cgroup's OOM-kill counter, where the kernel exposes it.

    Read after every run, so with plain os calls: a file object costs several times as much."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            text = os.read(fd, 4096)
        except OSError:
            continue
        finally:
            os.close(fd)
        for line in text.split(b"\n"):
            name, _, value = line.partition(b" ")
            if name == b"oom_kill":
                try:
                    return int(value)
                except ValueError:
                    break
    return None
