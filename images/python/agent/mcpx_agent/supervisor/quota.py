"""What a session's /mnt/data costs the host disk, beyond what a walk of its tree can see.

The session volume lives on the engine's disk, and no kernel quota guards it, so the supervisor
counts. A walk of the tree misses two things user code can arrange: files deleted while a
process keeps them open (their blocks stay in use, no name reaches them), and processes that
make themselves unreadable so that nobody can look at what they hold. Both are measured here,
from /proc, with the sandbox user's filesystem identity (which may read its own processes).

Usage past ``CEILING`` times the quota is not a mistake to be told about but a flood: every
process of the sandbox user is stopped and the files written since the last look are removed,
so what one check interval lets through never stays on the disk.
"""

from __future__ import annotations

import contextlib
import os
import select
import stat
import time
from typing import Any

from ..identity import SANDBOX_UID, as_sandbox_user
from ..procfs import read_small
from .tree import RESERVED, Unmeasurable, entries, with_hidden
from .wipe import WIPE_DEADLINE_S, empty_directory, reset_top

CEILING = 2
ROOT = "/mnt/data"
CHECK_S = 1.0  # how often a session's /mnt/data usage is checked while something may write


# A worker is undumpable between its setresuid and its PR_SET_DUMPABLE (a process mid-exec too):
# two system calls apart, but on a loaded machine, under the container's CPU quota or gVisor's page
# copies, that moment has lasted well past 60 ms. Such a process is looked at again until this
# deadline; one that hides for good costs its own session this long a check.
HIDDEN_WAIT_S = 1.0
HIDDEN_RETRY_S = 0.01


def held_deleted_bytes(data_device: int) -> int:
    """Bytes on ``data_device`` held by files that are deleted but still open in a process of the
    sandbox user. Raises Unmeasurable when such a process keeps its descriptors hidden (one that
    is undumpable only for a moment, as every worker is while it takes its uid, is looked at again)."""
    total = 0
    seen: set[int] = set()
    deadline = time.monotonic() + HIDDEN_WAIT_S
    with as_sandbox_user():
        hidden = [name for name in os.listdir("/proc") if name.isdigit() and _of_sandbox_user(name)]
        while True:
            hidden, held = _held_by(hidden, data_device, seen)
            total += held
            if not hidden:
                return total
            if time.monotonic() >= deadline:
                break
            select.select([], [], [], HIDDEN_RETRY_S)
    raise Unmeasurable(f"process {hidden[0]} hides its open files (it made itself undumpable)")


def _held_by(pids: list[str], data_device: int, seen: set[int]) -> tuple[list[str], int]:
    """(the pids whose descriptors could not be read, the deleted bytes the others hold)."""
    hidden: list[str] = []
    total = 0
    for name in pids:
        try:
            descriptors = os.listdir(f"/proc/{name}/fd")
        except FileNotFoundError:
            continue  # it exited meanwhile
        except PermissionError:
            hidden.append(name)
            continue
        for fd in descriptors:
            try:
                st = os.stat(f"/proc/{name}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile, or not a file
            if st.st_dev == data_device and st.st_ino not in seen and _deleted(name, fd, st):
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return hidden, total


def _deleted(pid: str, fd: str, st: os.stat_result) -> bool:
    if st.st_nlink == 0:
        return True
    # gVisor keeps a deleted file's link count; its /proc names it as Linux does.
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}").endswith(" (deleted)")
    except OSError:
        return False


def _of_sandbox_user(pid: str) -> bool:
    # /proc/<pid>/status says the real ids even when the process is undumpable (its /proc files
    # then belong to root, so their owner would hide it).
    status = read_small(f"/proc/{pid}/status", 4096)
    if status is None:
        return False
    # All four ids: a process of ours that is still taking the sandbox user's uid is not one of its.
    # A zombie holds no files (and its /proc/<pid>/fd cannot be listed).
    fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
    state = fields.get(b"State", b"").split()[:1]
    if state in ([b"Z"], [b"X"]):
        return False
    return set(fields.get(b"Uid", b"").split()) == {str(SANDBOX_UID).encode()}


def data_device() -> int:
    return os.stat(ROOT).st_dev


def limits(options: dict[str, Any]) -> tuple[int, int]:
    """The session's quota as a run's options give it: (bytes, entries); 0 for none."""
    return int(options.get("data_quota_bytes") or 0), int(options.get("data_quota_files") or 0)


def shed(options: dict[str, Any]) -> list[str]:
    """Bring /mnt/data back under the quota after a flood (every process of the sandbox user is
    dead): the largest files go first, whenever they were written, since no record of what is
    new can be trusted (mtimes are the user's to set). When the tree cannot be walked whole or a
    file cannot be removed, /mnt/data is emptied. Returns the paths removed."""
    quota_bytes, quota_files = limits(options)
    sizes: list[tuple[int, str]] = []
    total = count = 0
    try:
        with as_sandbox_user():
            for path, st in entries(strict=True):
                count += 1
                total += st.st_blocks * 512
                if stat.S_ISREG(st.st_mode):
                    sizes.append((st.st_blocks * 512, path))
                if quota_files and count > quota_files:
                    raise Unmeasurable("too many entries to sort out one by one")
            removed = []
            for size, path in sorted(sizes, reverse=True):
                if not quota_bytes or total <= quota_bytes:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(ROOT, path))
                total -= size
                removed.append(path)
            return removed
    except (Unmeasurable, OSError, ValueError):
        with as_sandbox_user():
            empty_directory(ROOT, time.monotonic() + WIPE_DEADLINE_S)
            reset_top(ROOT)
        return ["everything in /mnt/data"]


def usage(max_files: int) -> tuple[int, int]:
    """(bytes on disk, entries) under /mnt/data, counting at most ``max_files + 1`` entries, and
    the blocks of deleted files still held open. Raises Unmeasurable."""
    total = count = 0
    with as_sandbox_user():
        for _, st in entries(strict=True):
            count += 1
            total += st.st_blocks * 512
            if count > max_files:
                break
    return total + held_deleted_bytes(data_device()), count


def reserved_usage() -> tuple[int, int] | None:
    """(bytes, entries) of /mnt/data/.mcpx, itself included; None when it cannot all be counted."""
    try:
        with as_sandbox_user():
            top = os.lstat(f"{ROOT}/{RESERVED}")
    except FileNotFoundError:
        return (0, 0)
    except OSError:
        return None
    below = with_hidden((0, 0), [RESERVED])
    return None if below is None else (below[0] + top.st_blocks * 512, below[1] + 1)


def with_held(measured: tuple[int, int] | None) -> tuple[int, int] | None:
    """A tree's usage (a ``survey``'s) with the deleted files held open added; None when those
    cannot be counted (``quota_state`` then measures again, and says so)."""
    if measured is None:
        return None
    try:
        return measured[0] + held_deleted_bytes(data_device()), measured[1]
    except Unmeasurable:
        return None


def if_grown(over: str | None, measured: tuple[int, int] | None, before: tuple[int, int] | None) -> str | None:
    """``over`` for a run that changed no visible file: only if the usage grew since ``before`` (bytes
    put where the user does not look, such as /mnt/data/.mcpx), or cannot be compared. What earlier
    runs left stays theirs, as it does for the visible files."""
    if over is None or measured is None or before is None:
        return over
    return over if measured[0] > before[0] or measured[1] > before[1] else None


def quota_error(options: dict[str, Any], extra_bytes: int = 0, measured: tuple[int, int] | None = None) -> str | None:
    """A sentence when /mnt/data is over the session's quota (bytes or entries), else None.
    ``measured``: (bytes, entries) already counted, deleted files held open included (``usage``,
    or a ``survey`` passed through ``with_held``)."""
    over, _ = quota_state(options, extra_bytes, measured)
    return over


def quota_state(
    options: dict[str, Any], extra_bytes: int = 0, measured: tuple[int, int] | None = None
) -> tuple[str | None, bool]:
    """``quota_error``'s sentence, and whether usage is past the ceiling (CEILING times it)."""
    quota_bytes, quota_files = limits(options)
    if not quota_bytes and not quota_files:
        return None, False
    try:
        used, count = usage(CEILING * quota_files or 1 << 30) if measured is None else measured
    except (OSError, ValueError) as exc:  # Unmeasurable, or whatever the tree did to the walk
        # Over, so the run stops; never a flood, so no file is removed for it.
        reason = str(exc) if isinstance(exc, Unmeasurable) else f"{exc!r:.200}"
        return f"the use of /mnt/data cannot be measured ({reason}); it counts as over the quota", False
    if (quota_bytes and used + extra_bytes > quota_bytes) or (quota_files and count > quota_files):
        flooded = (quota_bytes and used > CEILING * quota_bytes) or (quota_files and count > CEILING * quota_files)
        # Past the filesystem nothing floods: a count above it is the count's error (gVisor reports
        # a sparse file at its full size), and shedding files for it would lose the user's work.
        flooded = flooded and options.get("disk_enforced") is not True
        return (
            f"/mnt/data holds {used / 2**20:.0f} MiB in {count} entries; this session's quota is "
            f"{quota_bytes / 2**20:.0f} MiB and {quota_files} entries. Delete files to continue."
        ), bool(flooded)
    return None, False


__all__ = [
    "CEILING",
    "CHECK_S",
    "Unmeasurable",
    "if_grown",
    "limits",
    "quota_error",
    "quota_state",
    "reserved_usage",
    "shed",
    "usage",
    "with_held",
]
