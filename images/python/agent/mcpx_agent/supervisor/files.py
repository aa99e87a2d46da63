"""File access under /mnt/data on behalf of uid 1000, refusing anything that leaves it.

Every path is walked one component at a time with ``O_NOFOLLOW`` from a descriptor of
/mnt/data, so neither ``..`` nor a symlink planted by user code can lead outside, and all of it
happens with the sandbox user's filesystem identity (see ``identity.as_sandbox_user``).
The path rules are the host's too (``mcp_code_exec.protocol.paths``); a unit test holds them equal.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Any

from ..identity import as_sandbox_user
from . import tree

ROOT = "/mnt/data"
MAX_PATH = 1024
MAX_COMPONENT = 255


class FileError(Exception):
    """A refused or failed file operation; the message is meant for the model."""


def split_path(path: str) -> list[str]:
    if not isinstance(path, str) or not path.strip():
        raise FileError("path is empty")
    if "\x00" in path or "\\" in path:
        raise FileError("path contains a NUL byte or a backslash")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH:
        raise FileError(f"path is longer than {MAX_PATH} bytes")
    if path.startswith("/"):
        if path != ROOT and not path.startswith(ROOT + "/"):
            raise FileError("absolute paths must start with /mnt/data/")
        path = path[len(ROOT) :]
    parts = [part for part in path.split("/") if part not in ("", ".")]
    for part in parts:
        if part == "..":
            raise FileError("'..' is not allowed in paths")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT:
            raise FileError(f"a path component is longer than {MAX_COMPONENT} bytes")
    return parts


def open_dir(parts: list[str], *, create: bool = False) -> int:
    """A descriptor of the directory /mnt/data/``parts``, walked one component at a time without
    following a link (``create``: making what is missing). Call it as the sandbox user; the caller
    closes the descriptor."""
    fd = os.open(ROOT, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                # lstat first, and compare after: gVisor follows a symlink despite
                # O_NOFOLLOW when O_DIRECTORY is also given.
                before = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISDIR(before.st_mode):
                    raise OSError(errno.ENOTDIR, "not a directory")
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError as exc:
                raise FileError(f"no such directory: {part}") from exc
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise FileError(f"{part} is a symlink or not a directory; refused") from exc
                raise file_error(exc, "/".join(parts[: parts.index(part) + 1])) from exc
            after = os.fstat(child)
            if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):  # swapped for a symlink meanwhile
                os.close(child)
                raise FileError(f"{part} is a symlink or not a directory; refused")
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_error(exc: OSError, path: str) -> FileError:
    """The refusal to tell the model when an operation on ``path`` failed with ``exc``."""
    names = {
        errno.ENOENT: "no such file",
        errno.ELOOP: "is a symlink; refused",
        errno.EISDIR: "is a directory",
        errno.ENOTDIR: "not a directory",
        errno.EACCES: "permission denied",
        errno.ENOSPC: "no space left in /mnt/data",
        errno.EFBIG: "file too large for the sandbox's size limit",
        errno.EDQUOT: "disk quota exceeded",
    }
    reason = names.get(exc.errno or 0, exc.strerror or "error")
    return FileError(f"{path}: {reason}")


def check_target(dir_fd: int, name: str, path: str) -> None:
    """Refuse to put a file in place of ``name`` in ``dir_fd`` when something else than a regular file is there."""
    try:
        existing = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(existing.st_mode):
        raise FileError(f"{path}: exists and is not a regular file; refused")


def list_files(path: str, limit: int) -> dict[str, Any]:
    parts = split_path(path) if path not in ("", ".") else []
    if parts and parts[0] == tree.RESERVED:
        raise FileError(f"{tree.RESERVED} is reserved for the server")
    entries: list[dict[str, Any]] = []
    truncated = False
    with as_sandbox_user():
        fd = open_dir(parts)
        try:
            stack: list[tuple[int, str]] = [(fd, "/".join(parts))]
            while stack and not truncated:
                dir_fd, prefix = stack.pop()
                try:
                    for entry in sorted(os.scandir(dir_fd), key=lambda e: e.name):
                        if not prefix and entry.name in tree.HIDDEN:
                            continue
                        if len(entries) >= limit:
                            truncated = True
                            break
                        st = entry.stat(follow_symlinks=False)
                        rel = f"{prefix}/{entry.name}" if prefix else entry.name
                        is_dir = stat.S_ISDIR(st.st_mode)
                        entries.append(
                            {
                                "path": rel,
                                "size": 0 if is_dir else st.st_size,
                                "is_dir": is_dir,
                                "is_symlink": stat.S_ISLNK(st.st_mode),
                                "modified": st.st_mtime,
                            }
                        )
                        if is_dir:
                            with contextlib.suppress(OSError):
                                flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                                sub = os.open(entry.name, flags, dir_fd=dir_fd)
                                opened = os.fstat(sub)
                                if (opened.st_dev, opened.st_ino) == (st.st_dev, st.st_ino):
                                    stack.append((sub, rel))
                                else:  # swapped for a symlink since the listing (gVisor follows it)
                                    os.close(sub)
                finally:
                    os.close(dir_fd)
        finally:
            for leftover_fd, _ in stack:
                os.close(leftover_fd)
    return {"entries": entries, "truncated": truncated}


def open_regular(parts: list[str], path: str) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file at ``parts`` (walked without following links), and its
    stat. Call it as the sandbox user; the caller closes the descriptor."""
    dir_fd = open_dir(parts[:-1])
    try:
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise file_error(exc, path) from exc
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileError(f"{path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_file(path: str, max_bytes: int) -> tuple[dict[str, Any], bytes]:
    parts = split_path(path)
    with as_sandbox_user():
        fd, st = open_regular(parts, path)
        try:
            if st.st_size > max_bytes:
                raise FileError(f"{path}: {st.st_size} bytes is over the read cap of {max_bytes} bytes")
            chunks: list[bytes] = []
            remaining = max_bytes + 1
            while remaining > 0:
                chunk = os.read(fd, min(remaining, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                remaining -= len(chunk)
            data = b"".join(chunks)
            if len(data) > max_bytes:
                raise FileError(f"{path}: grew over the read cap of {max_bytes} bytes")
            return {"path": "/".join(parts), "size": len(data), "modified": st.st_mtime}, data
        finally:
            os.close(fd)


def collect(options: dict[str, Any]) -> tuple[list[dict[str, Any]], bytes]:
    """Files a stateless run left in /mnt/data, with their bytes (within the caps), for the host."""
    budget = int(options.get("collect_bytes", 0))
    per_file = int(options.get("collect_file_bytes", 0))
    listing = tree.snapshot(limit=int(options.get("collect_files", 100)))
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    offset = 0
    for path, (size, mtime_ns) in sorted(item for item in listing.items() if tree.reportable(item[0])):
        entry: dict[str, Any] = {"path": path, "size": size, "modified": mtime_ns / 1e9, "new": True}
        if size <= per_file and size <= budget:
            try:
                # At most what is left of the budget: a process of the run may still be writing
                # the file (they are killed after), and the host refuses bytes over the caps.
                _, data = read_file(path, min(per_file, budget))
            except FileError as exc:
                entry["note"] = str(exc)
            else:
                entry["offset"], entry["length"] = offset, len(data)
                chunks.append(data)
                offset += len(data)
                budget -= len(data)
        else:
            entry["note"] = "not kept: over the size cap for stateless files"
        entries.append(entry)
    return entries, b"".join(chunks)
