"""Validating file paths on the host, before anything reaches a sandbox.

The agent checks again, component by component with O_NOFOLLOW (symlinks can only be judged
inside); this first check gives the model a clear error and keeps junk off the channel.
"""

from __future__ import annotations

import posixpath
import urllib.parse

from ..errors import InvalidPath

ROOT = "/mnt/data"
MAX_PATH = 1024
MAX_COMPONENT = 255


def normalize(path: str, *, allow_root: bool = False) -> str:
    """Return the path relative to /mnt/data ('' for the root), or raise ``InvalidPath``."""
    if not isinstance(path, str):
        raise InvalidPath("path must be a string")
    if "\x00" in path:
        raise InvalidPath("path contains a NUL byte")
    if "\\" in path:
        raise InvalidPath("path contains a backslash; use '/'")
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH:
        raise InvalidPath(f"path is longer than {MAX_PATH} bytes")
    if "%" in path and urllib.parse.unquote(path) != path and ".." in urllib.parse.unquote(path):
        raise InvalidPath("path contains URL-encoded '..'")
    text = path.strip()
    if text.startswith("/"):
        if text != ROOT and not text.startswith(ROOT + "/"):
            raise InvalidPath(f"absolute paths must be under {ROOT}/ (got {path!r})")
        text = text[len(ROOT) :]
    parts = [part for part in text.split("/") if part not in ("", ".")]
    for part in parts:
        if part == "..":
            raise InvalidPath(f"'..' is not allowed in paths (got {path!r})")
        if len(part.encode("utf-8", "surrogatepass")) > MAX_COMPONENT:
            raise InvalidPath(f"a path component is longer than {MAX_COMPONENT} bytes")
    relative = posixpath.join(*parts) if parts else ""
    if not relative and not allow_root:
        raise InvalidPath("path names /mnt/data itself, not a file")
    return relative
