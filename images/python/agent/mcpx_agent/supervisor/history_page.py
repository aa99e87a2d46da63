"""The notebook view's page of a session's history: built here, from the end of the history file,
and only validated by the host (``mcp_code_exec.protocol.messages.HistoryPage``).

The history is the session's to rewrite (a million one-line runs, lines of junk, one huge line), and
this runs in the sandbox on the sandbox's time, so the host never reads or parses the file. What is
read is bounded three ways even so: bytes (``read_max``, from the end, where the newest runs are),
lines looked at (``MAX_LINES``: a history the supervisor wrote holds one run a line), and the page
itself (``max_cells`` cells, ``max_bytes`` of JSON as it is sent). Each cell's fields are checked and
capped as ``history_format.parse_line`` and the caps below say; the host's model holds the same caps. The
header (runs the history's cap dropped) is read from the file's first line alone. Everything
happens as the sandbox user, through the same no-symlink walk as the file tools.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any

from .. import events, history_format
from ..identity import as_sandbox_user
from . import files
from .tree import RESERVED

PARTS = [RESERVED, "history"]
BLOCK = 1 << 20
HEADER_BYTES = 4096  # a header line is short; the first line is read only this far
MAX_LINES = 2000  # looked at per page: ten times a full page, whatever they hold
# What one cell carries (the host's ``notebook`` module states the same caps; a unit test holds them equal).
CODE_CHARS = 20_000
STREAM_CHARS = 4_000  # head and tail each
TEXT_CHARS = 8_000
NAME_CHARS = 200
MAX_DISPLAYS = 20
MAX_FIGURES = 50
MAX_TABLES = 8
MAX_COLUMNS = 200
MAX_N = 10**9  # a run's number (the figure tool's bound)
MAX_NUMBER = 1e15
TABLE_ID = re.compile(r"[0-9a-f]{16}")


def text(value: Any, cap: int = TEXT_CHARS) -> str:
    if not isinstance(value, str):
        return ""
    return value if len(value) <= cap else value[: cap - 1] + "…"


def stream(value: Any) -> str:
    found = value if isinstance(value, str) else ""
    if len(found) <= 2 * STREAM_CHARS:
        return found
    cut = len(found) - 2 * STREAM_CHARS
    return f"{found[:STREAM_CHARS]}\n[… {cut} characters not shown …]\n{found[-STREAM_CHARS:]}"


def number(value: Any) -> float:
    """A count, a time or a duration: finite, from 0 up to ``MAX_NUMBER`` (anything else is 0)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok and 0 <= value < MAX_NUMBER else 0.0


def table(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("table"), str) or not TABLE_ID.fullmatch(value["table"]):
        return None
    columns, dtypes = value.get("columns"), value.get("dtypes")
    if not isinstance(columns, list) or not isinstance(dtypes, list) or len(columns) != len(dtypes):
        return None
    names = [text(c, NAME_CHARS) for c in columns[:MAX_COLUMNS]]
    return {
        "table": value["table"],
        "columns": names,
        "dtypes": [text(d, NAME_CHARS) for d in dtypes[: len(names)]],
        "rows": int(number(value.get("rows"))),
        "total_rows": int(number(value.get("total_rows"))),
        "sorted_columns": min(len(names), int(number(value.get("sorted_columns")))),
    }


def cell(raw: bytes) -> dict[str, Any] | int | None:
    """A history line as a page's cell; a header as the runs it says were dropped; else None."""
    found = history_format.parse_line(raw)
    if found is None:
        return None
    if found["kind"] == "header":
        return max(0, int(number(found["runs_dropped"])))
    error = found["error"]
    if error:
        error = {"type": text(error["type"], NAME_CHARS) or "Error", "message": text(error["message"]),
                 "traceback": stream(error["traceback"])}  # fmt: skip
    tables = [t for t in map(table, found["tables"][:MAX_TABLES]) if t is not None]
    return {
        "n": min(MAX_N - 1, max(0, int(number(found["n"])))),
        "at": number(found["at"]) or None,
        "code": text(found["code"], CODE_CHARS),
        "status": found["status"],
        "duration_ms": number(found["duration_ms"]),
        "stdout": stream(found["stdout"]),
        "stderr": stream(found["stderr"]),
        "result": text(found["result"]) if found["result"] is not None else None,
        "displays": [text(d) for d in found["displays"][:MAX_DISPLAYS]],
        "error": error or None,
        "figures": [image["mime"] for image in found["images"][:MAX_FIGURES]],
        "tables": tables,
        "outputs_dropped": found["outputs_dropped"],
    }


def sent_size(value: Any) -> int:
    """Bytes ``value`` takes in a frame's header (``protocol.encode``)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace"))


class Page:
    """The newest runs that fit, newest first as they are read (``history_page`` sends them oldest first)."""

    def __init__(self, max_cells: int, max_bytes: int) -> None:
        self.max_cells, self.max_bytes = max_cells, max_bytes
        self.cells: list[dict[str, Any]] = []  # newest first while reading
        self.used = 0
        self.lines = 0
        self.full = False  # older runs are left out: the page, or a bound on reading, ended it

    def take(self, raw: bytes) -> None:
        if not raw.strip():
            return
        self.lines += 1
        if self.lines > MAX_LINES:
            self.full = True
            return
        found = cell(raw)
        if not isinstance(found, dict):
            return  # junk, or a header out of place: the first line's is read on its own
        size = sent_size(found) + 1
        if len(self.cells) >= self.max_cells or self.used + size > self.max_bytes:
            self.full = True
            return
        self.cells.append(found)
        self.used += size


def read_newest(fd: int, size: int, read_max: int, page: Page) -> None:
    """Lines from the end of the file, newest first, into ``page`` until it is full or ``read_max``
    bytes were read (a line cut there is not taken)."""
    stop = max(0, size - read_max)
    end, carry = size, b""
    while end > stop and not page.full:
        begin = max(stop, end - BLOCK)
        block = os.pread(fd, end - begin, begin)
        if len(block) != end - begin:
            break  # the file shrank meanwhile: what was read is the page
        lines = (block + carry).split(b"\n")
        end, carry = begin, lines[0]
        for raw in reversed(lines[1:]):
            page.take(raw)
            if page.full:
                return
    if end == 0 and not page.full:
        page.take(carry)  # the file's first line (a header is skipped here: see ``runs_dropped``)
    elif end > 0:
        page.full = True


def runs_dropped(fd: int) -> int:
    first = os.pread(fd, HEADER_BYTES, 0).split(b"\n", 1)
    found = cell(first[0]) if len(first) == 2 else None
    return found if isinstance(found, int) else 0


def history_page(rid: Any, request: dict[str, Any]) -> dict[str, Any]:
    """The ``history_page`` event: the newest runs within the request's bounds."""
    max_cells = max(0, min(int(request["max_cells"]), 1000))
    max_bytes = max(0, min(int(request["max_bytes"]), 4 << 20))
    read_max = max(0, int(request["read_max"]))
    page = Page(max_cells, max_bytes)
    with as_sandbox_user():
        try:
            dir_fd = files.open_dir(PARTS)
        except files.FileError:
            return events.history_page(rid, [], 0, more=False, missing=True)
        try:
            fd = os.open(history_format.FILE, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return events.history_page(rid, [], 0, more=False, missing=True)
        except OSError as exc:
            raise files.file_error(exc, history_format.FILE) from exc
        finally:
            os.close(dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise files.FileError("the session's history is not a regular file")
            read_newest(fd, st.st_size, read_max, page)
            dropped = runs_dropped(fd)
        except OSError as exc:
            raise files.file_error(exc, history_format.FILE) from exc
        finally:
            os.close(fd)
    page.cells.reverse()
    return events.history_page(rid, page.cells, dropped, more=page.full, missing=False)
