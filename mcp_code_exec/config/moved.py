"""Keys that moved: a file written for an older release still loads, with one line on stderr per
moved key naming where it lives now (never on stdout, which is the protocol over stdio). Setting a
key under both its old and its new name is refused: the two would disagree sooner or later.

``RENAMED`` keys are not read at all: the error for them names the new key.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError

# old section -> {old key: new key under [runs]}
MOVED_TO_RUNS = {
    "stateless_files": {
        "keep_s": "files_keep_s",
        "max_total_mb": "files_max_total_mb",
        "max_file_mb": "files_max_file_mb",
    },
    "results": {"resource_links": "resource_links"},
}
RENAMED = {
    "limits.max_timeout_s": "limits.max_run_s",
    "sessions.max_disk_per_client_mb": "quotas.default.stored_mb",
}


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def move_old_sections(data: dict[str, Any], source: str, warn: Callable[[str], None] = _to_stderr) -> dict[str, Any]:
    """``data`` (the file's tables, with the environment's and the flags') with the old sections'
    keys moved under ``[runs]``. Raises ``ConfigError`` for a key set under both names, or one the
    old section never had."""
    if not any(old in data for old in MOVED_TO_RUNS):
        return data
    moved = dict(data)
    runs = moved.get("runs", {})
    if not isinstance(runs, dict):
        return data  # validation names the problem with [runs] itself
    runs = dict(runs)
    for old, keys in MOVED_TO_RUNS.items():
        section = moved.pop(old, None)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: {old}: must be a table (its keys now live under [runs])")
        for key, value in section.items():
            new = keys.get(key)
            if new is None:
                raise ConfigError(f"{source}: {old}.{key}: unknown key")
            if new in runs:
                raise ConfigError(f"{source}: {old}.{key} and runs.{new} are one setting: keep only runs.{new}")
            runs[new] = value
            warn(f"mcp-code-exec: {source}: [{old}] {key} is deprecated: write runs.{new} instead")
    moved["runs"] = runs
    return moved
