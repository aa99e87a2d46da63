"""A session's history on its volume: the format the supervisor writes and the export reads.

``/mnt/data/.mcpx/history/runs.jsonl`` holds one JSON object a line: a ``run`` (its number, time,
code, status, duration, stdout, stderr, value, displays, the names of its image files, the tables
it showed, its error)
or, first, a ``header`` (how many of the oldest runs were dropped whole). A run whose outputs were
dropped to keep the history within its cap says so (``outputs_dropped``). Images are files beside
it (``img-<run>-<k>.png``).

The session's own code can write these files, so every line is read as hostile: bounded in size
and nesting, each field checked and anything else ignored; a line that is not a run is skipped.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .protocol import ProtocolError, decode_header

DIR = "/mnt/data/.mcpx/history"
FILE = "runs.jsonl"
MAX_LINE = 16 << 20
IMAGE_NAME = re.compile(r"img-[0-9]{1,9}-[0-9]{1,4}\.(png|jpeg)")
SPARSE_SLACK = 64 << 10  # a small file's blocks say little (inline data, compression): not judged by them
STATUSES = ("ok", "error", "timeout", "memory_limit", "crashed", "cancelled")


def servable(st: os.stat_result) -> bool:
    """Whether a file of the history (an image, above all) may be served: only a file of its own. A
    file hard-linked under many names would be as many figures for the bytes of one, and a sparse
    one as many bytes as it claims for the blocks it holds (the quota counts blocks): either would
    let the session's few bytes on disk become many times that in what the view reads."""
    return st.st_nlink == 1 and (st.st_size <= SPARSE_SLACK or st.st_blocks * 512 >= st.st_size // 2)


def _text(value: Any, cap: int = MAX_LINE) -> str:
    return value[:cap] if isinstance(value, str) else ""


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def parse_line(raw: bytes) -> dict[str, Any] | None:
    """A run or header line as checked values; None for anything else."""
    if len(raw) > MAX_LINE:
        return None
    try:
        found = decode_header(raw)
    except ProtocolError:
        return None
    if found.get("kind") == "header":
        return {"kind": "header", "runs_dropped": int(_number(found.get("runs_dropped")))}
    if found.get("kind") != "run":
        return None
    error = found.get("error")
    images = found.get("images")
    displays = found.get("displays")
    tables = found.get("tables")
    status = found.get("status")
    return {
        "kind": "run",
        "n": int(_number(found.get("n"))),
        "at": _number(found.get("at")),
        "code": _text(found.get("code")),
        "status": status if status in STATUSES else "error",
        "duration_ms": _number(found.get("duration_ms")),
        "stdout": _text(found.get("stdout")),
        "stderr": _text(found.get("stderr")),
        "result": found.get("result") if isinstance(found.get("result"), str) else None,
        "displays": [d for d in displays if isinstance(d, str)][:1000] if isinstance(displays, list) else [],
        "images": [
            {"file": image["file"], "mime": "image/png" if image["file"].endswith(".png") else "image/jpeg"}
            for image in (images if isinstance(images, list) else [])[:1000]
            if isinstance(image, dict) and isinstance(image.get("file"), str) and IMAGE_NAME.fullmatch(image["file"])
        ],
        "error": {
            "type": _text(error.get("type"), 1000) or "Error",
            "message": _text(error.get("message")),
            "traceback": _text(error.get("traceback")),
        }
        if isinstance(error, dict)
        else None,
        "tables": [table for table in tables if isinstance(table, dict)][:100] if isinstance(tables, list) else [],
        "outputs_dropped": found.get("outputs_dropped") is True,
    }


def parse(data: bytes) -> list[dict[str, Any]]:
    """Every well-formed line of a history file."""
    return [entry for line in data.split(b"\n") if line.strip() and (entry := parse_line(line)) is not None]
