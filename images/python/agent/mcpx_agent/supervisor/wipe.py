"""Emptying everything a stateless run could leave for the next one: files and IPC objects.

The wipe runs after every process of the sandbox user is dead, so nothing changes under it.
It must not be made to fail by what the run built: trees are walked without recursion and
without a descriptor per level (a tree thousands of levels deep is fine), modes are opened up
(the sandbox user owns everything it made), and any name is handled. What it cannot remove is
reported, and the host then discards the container instead of reusing it.

It never leaves the filesystem it empties: symlinks are not followed, and a directory on another
device (a mount point, such as a host directory the user mounted) is never entered. Host
directories live under /mnt/host, which is not wiped: what a run writes there stays, by design.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time

from ..identity import LIBC, SANDBOX_GID, SANDBOX_UID, as_sandbox_user

WIPED_DIRS = ("/tmp", "/mnt/data", "/dev/shm", "/dev/mqueue")  # mqueue: POSIX message queues
TOP_MODES = {"/mnt/data": 0o755}  # directories the sandbox user owns: its chmod must not carry over
# Every wipe gives the tops these access and modification times: the owner of a top (the sandbox
# user owns /mnt/data) can set them to any value, and a run that touches a top sets them to the
# moment it chose, so left as they were they would carry bits from one run to the next. The agent's
# start, the same for every run of the container, tells a run nothing of another.
TOP_TIMES_NS = (time.time_ns(),) * 2
WIPE_DEADLINE_S = 10.0
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class WipeFailed(Exception):
    pass


def wipe() -> list[str]:
    """Empty the writable places user code can reach. Returns what is wrong (empty: all clean)."""
    problems: list[str] = []
    deadline = time.monotonic() + WIPE_DEADLINE_S
    with as_sandbox_user():
        for top in WIPED_DIRS:
            try:
                empty_directory(top, deadline)
                reset_top(top)
            except FileNotFoundError:
                continue  # not mounted here (gVisor has no /dev/mqueue)
            except (OSError, WipeFailed) as exc:
                problems.append(f"{top}: {exc}")
    problems += reset_times()
    problems += remove_ipc_objects()
    return problems


def reset_times() -> list[str]:
    """Give every top its times back (the wipe's own removals moved them too). Only the owner may
    set a file's times: the sandbox user's tops are set as that user, root's (/tmp, /dev/shm) as
    root; both kinds are mount points of fixed paths under root's read-only directories."""
    problems = []
    for top in WIPED_DIRS:
        try:
            if os.stat(top, follow_symlinks=False).st_uid == SANDBOX_UID:
                with as_sandbox_user():
                    os.utime(top, ns=TOP_TIMES_NS, follow_symlinks=False)
            else:
                os.utime(top, ns=TOP_TIMES_NS, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"{top}: its times cannot be reset: {exc}")
    return problems


def empty_directory(top: str, deadline: float) -> None:
    """Remove everything below ``top``, depth first, holding one directory open at a time.

    Going back up by ``..`` is safe only because nothing else runs (see the module docstring).
    """
    fd = os.open(top, DIR_FLAGS)
    device = os.fstat(fd).st_dev
    path: list[str] = []  # names from top down to the directory ``fd`` is
    cleared: list[bool] = [False]  # per level: its files are gone, only directories may remain
    try:
        while True:
            if time.monotonic() > deadline:
                raise WipeFailed("took too long")
            child = _next_subdirectory(fd, files_done=cleared[-1])
            cleared[-1] = True
            if child is not None:
                if os.stat(child, dir_fd=fd, follow_symlinks=False).st_dev != device:
                    raise WipeFailed(f"{child!r} is a mount point; nothing in it was touched")
                with contextlib.suppress(OSError):
                    os.chmod(child, 0o700, dir_fd=fd)  # an unreadable or unwritable directory of the user's
                sub = os.open(child, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = sub
                path.append(child)
                cleared.append(False)
                continue
            if not path:
                if os.listdir(fd):
                    raise WipeFailed("entries remain")
                return
            parent = os.open("..", DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            os.rmdir(path.pop(), dir_fd=fd)
            cleared.pop()
    finally:
        os.close(fd)


def settle_tops() -> None:
    """Give the tops, before the first run, the state every wipe leaves them in (Docker copies the
    image directory's mode onto a fresh tmpfs, whatever mode the mount asked for)."""
    with as_sandbox_user():
        for top in TOP_MODES:
            with contextlib.suppress(OSError, WipeFailed):  # the first wipe says what is wrong
                reset_top(top)


def reset_top(top: str) -> None:
    """Undo what the sandbox user may change on a top directory itself: its mode and its xattrs."""
    if top in TOP_MODES and os.stat(top, follow_symlinks=False).st_uid == SANDBOX_UID:
        os.chmod(top, TOP_MODES[top])  # a session volume's top is root's: its mode is not the user's to change
    try:
        names = os.listxattr(top, follow_symlinks=False)
    except OSError:  # no xattr support on this filesystem: nothing can have been stored
        return
    for name in names:
        with contextlib.suppress(OSError):
            os.removexattr(top, name, follow_symlinks=False)
    if [name for name in os.listxattr(top, follow_symlinks=False) if name.startswith("user.")]:
        raise WipeFailed("extended attributes remain")


def _next_subdirectory(fd: int, *, files_done: bool) -> str | None:
    """Unlink every non-directory in ``fd`` (unless that was done) and name a subdirectory, if any."""
    found: str | None = None
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if found is None:
                    found = entry.name
                    if files_done:
                        break
                continue
            try:
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except PermissionError:
                os.fchmod(fd, 0o700)  # a directory the user made unwritable
                os.unlink(entry.name, dir_fd=fd)
    return found


# -- SysV IPC ---------------------------------------------------------------------------------
# The IPC namespace is the container's, so objects outlive the run that made them. gVisor has no
# /proc/sysvipc, and its *_STAT commands take ids where Linux takes indices; the *_INFO commands
# count the objects on both, which says when the removal is complete.
IPC_RMID = 0
KINDS = {
    # kind: (ctl, INFO command, STAT command, index of the object count in the info struct)
    "shm": ("shmctl", 14, 13, 0),  # struct shm_info: used_ids
    "msg": ("msgctl", 12, 11, 0),  # struct msginfo (MSG_INFO): msgpool, the number of queues
    "sem": ("semctl", 19, 18, 7),  # struct seminfo (SEM_INFO): semusz, the number of sets
}
IPC_ID_LIMIT = 32768  # gVisor hands out ids below this
IPC_DEADLINE_S = 2.0


def _ctl(kind: str, ident: int, command: int, buf: object) -> int:
    name, *_ = KINDS[kind]
    if kind == "sem":
        return int(LIBC.semctl(ident, 0, command, buf))
    return int(getattr(LIBC, name)(ident, command, buf))


def ipc_counts() -> dict[str, int]:
    buf = (ctypes.c_int * 64)()
    counts = {}
    for kind, (_, info, _, index) in KINDS.items():
        counts[kind] = buf[index] if _ctl(kind, 0, info, buf) >= 0 else 0
    return counts


def remove_ipc_objects() -> list[str]:
    """Remove the sandbox user's SysV IPC objects; the kinds some of which remain, if any."""
    if not any(ipc_counts().values()):
        return []
    # IPC_RMID checks the effective uid, not the fs uid: do it in a short-lived uid-1000 child.
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
            os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
            _remove_all()
            code = 0
        finally:
            os._exit(code)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    return [f"SysV {kind} objects remain" for kind, count in ipc_counts().items() if count]


def _remove_all() -> None:
    buf = (ctypes.c_int * 64)()
    deadline = time.monotonic() + IPC_DEADLINE_S
    for kind, (_, info, stat_command, _) in KINDS.items():
        if not ipc_counts()[kind]:
            continue
        highest = _ctl(kind, 0, info, buf)  # Linux: the highest index in use
        for index in range(max(highest, 0) + 1):
            ident = _ctl(kind, index, stat_command, buf)
            if ident >= 0:
                _ctl(kind, ident, IPC_RMID, None)
        for ident in range(IPC_ID_LIMIT):  # gVisor: try the ids themselves, until none is left
            if ident % 256 == 0 and (not ipc_counts()[kind] or time.monotonic() > deadline):
                break
            _ctl(kind, ident, IPC_RMID, None)
