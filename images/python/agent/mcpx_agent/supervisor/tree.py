"""The tree under /mnt/data as the sandbox user sees it: every entry, what changed, what it weighs.

Walked without recursion and without one descriptor per level, as the sandbox user, with links
never followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from typing import Any

from ..identity import as_sandbox_user

ROOT = "/mnt/data"
MAX_REPORTED_PATH = 1024  # files.MAX_PATH, the host's limit too
# Not the user's files: the session's installed packages and the wheels copied in for a cell (see
# packages.py), and the agent's own record of the session (.mcpx: its snapshot and history). Not
# listed at the top, reported as changed, or collected; counted in the quota.
RESERVED = ".mcpx"
HIDDEN = (".packages", ".wheelhouse", RESERVED)


class Unmeasurable(OSError):
    """Something under /mnt/data, or held open on it, cannot be counted."""


def entries(
    *,
    strict: bool = False,
    skipped: list[str] | None = None,
    roots: tuple[str, ...] = ("",),
    unwalked: list[str] | None = None,
) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under /mnt/data (path relative to it, lstat), depth first, links not followed.
    ``roots``: only under these directories. ``unwalked``: the hidden directories at the top are not
    walked into, only named there (their own entries are yielded).

    Call it as the sandbox user (``as_sandbox_user``); stop iterating to bound the walk. A
    directory the user made unreadable is opened up (the user owns all of /mnt/data) and one
    deeper than PATH_MAX is reached a level at a time, so no part of the tree can hide from a
    quota check. What still cannot be listed is skipped (and named in ``skipped``), or with
    ``strict`` raises Unmeasurable.
    """
    stack = list(roots)
    while stack:
        rel = stack.pop()
        try:
            entries = _list_dir(rel)
        except FileNotFoundError:
            continue  # removed while we walked
        except OSError as exc:
            problem = f"{rel[:200]!r} cannot be listed: {exc.strerror}"
            if strict:
                raise Unmeasurable(problem) from None
            if skipped is not None:
                skipped.append(problem)
            continue
        for name, st in entries:
            child = f"{rel}/{name}" if rel else name
            if stat.S_ISDIR(st.st_mode):
                if unwalked is not None and not rel and name in HIDDEN:
                    unwalked.append(child)
                else:
                    stack.append(child)
            yield child, st


def _list_dir(rel: str) -> list[tuple[str, os.stat_result]]:
    """The entries of ROOT/rel with their lstat; the modes of directories opened up on the way
    are put back afterwards, so the user's own permissions stay as the user set them."""
    shut: list[tuple[int, str, int]] = []  # (descriptor of the parent, name, mode to put back)
    try:
        fd = _open_dir(rel, shut)
        try:
            out = []
            for name in os.listdir(fd):
                with contextlib.suppress(FileNotFoundError):
                    out.append((name, os.stat(name, dir_fd=fd, follow_symlinks=False)))
            return out
        finally:
            os.close(fd)
    finally:
        for parent, name, mode in reversed(shut):
            try:
                with contextlib.suppress(OSError):
                    _chmod_entry(name, mode, parent)
            finally:
                os.close(parent)


def _open_dir(rel: str, shut: list[tuple[int, str, int]]) -> int:
    """A descriptor of ROOT/rel, however deep. A directory of the user's that is shut (no read
    or search for its owner) is opened up; it goes in ``shut``, with its parent's descriptor."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(ROOT, flags)
    parts = [*rel.split("/"), "."] if rel else ["."]
    try:
        for part in parts:
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            opened_up = stat.S_ISDIR(st.st_mode) and st.st_mode & 0o500 != 0o500
            if opened_up:
                _chmod_entry(part, stat.S_IMODE(st.st_mode) | 0o700, fd)
            try:
                sub = os.open(part, flags, dir_fd=fd)
            finally:
                if opened_up:
                    shut.append((fd, part, stat.S_IMODE(st.st_mode)))
            if not opened_up:
                os.close(fd)
            fd = sub
        return fd
    except BaseException:
        if not shut or shut[-1][0] != fd:
            os.close(fd)
        raise


def _chmod_entry(name: str, mode: int, dir_fd: int) -> None:
    """chmod of an entry of ``dir_fd``, never through a symlink. Swapped for a symlink meanwhile,
    CPython raises ValueError (the kernel's EOPNOTSUPP); it is an OSError like any other here."""
    try:
        os.chmod(name, mode, dir_fd=dir_fd, follow_symlinks=False)
    except ValueError:
        raise OSError(errno.ELOOP, "became a symbolic link", name) from None


def snapshot(limit: int = 2000) -> dict[str, tuple[int, int]]:
    """Regular files under /mnt/data: path -> (size, mtime_ns). At most ``limit`` files."""
    return survey(limit)[0]


def survey(limit: int) -> tuple[dict[str, tuple[int, int]], tuple[int, int] | None]:
    """The snapshot, and the usage (bytes on disk, entries) counted on the same walk: None when
    the walk stopped at ``limit`` files, or could not list a directory, before seeing everything."""
    seen, usage, unwalked = survey_visible(limit)
    return seen, with_hidden(usage, unwalked)


def survey_visible(limit: int) -> tuple[dict[str, tuple[int, int]], tuple[int, int] | None, list[str]]:
    """``survey`` without walking into the hidden directories (the session's packages, snapshot and
    history: not the user's files, though the user may write there); the usage without theirs, and
    their paths, for ``with_hidden``. A run's survey: what it changed, and the usage only when needed."""
    seen: dict[str, tuple[int, int]] = {}
    total = count = 0
    skipped: list[str] = []
    unwalked: list[str] = []
    with as_sandbox_user():
        for path, st in entries(skipped=skipped, unwalked=unwalked):
            count += 1
            total += st.st_blocks * 512
            if stat.S_ISREG(st.st_mode) and path.split("/", 1)[0] not in HIDDEN:
                seen[path] = (st.st_size, st.st_mtime_ns)
                if len(seen) >= limit:
                    return seen, None, unwalked
    return seen, None if skipped else (total, count), unwalked


def with_hidden(usage: tuple[int, int] | None, unwalked: list[str]) -> tuple[int, int] | None:
    """``survey_visible``'s usage with what its hidden directories hold added; None when not all of
    it could be counted."""
    if usage is None:
        return None
    total, count = usage
    skipped: list[str] = []
    with as_sandbox_user():
        for _, st in entries(skipped=skipped, roots=tuple(unwalked)):
            count += 1
            total += st.st_blocks * 512
    return None if skipped else (total, count)


def reportable(path: str) -> bool:
    """Whether a path can be named to the host: within the path rules every file tool follows
    (a tree deeper than that still counts towards the quota; it just cannot be listed)."""
    return len(path.encode("utf-8", "surrogateescape")) <= MAX_REPORTED_PATH


def changed(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[dict[str, Any]]:
    out = []
    for path, (size, mtime_ns) in sorted(after.items()):
        if before.get(path) != (size, mtime_ns) and reportable(path):
            out.append({"path": path, "size": size, "modified": mtime_ns / 1e9, "new": path not in before})
    return out
