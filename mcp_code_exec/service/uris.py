"""The resource URI scheme, built and parsed here and nowhere else; and what a file's name and bytes
say it holds (its MIME type, its text).

sandbox://sessions/{session_id}/files/{+path}   a file under a live session's /mnt/data
sandbox://runs/{run_id}/files/{+path}           a file a stateless run left (kept a while)
sandbox://runs/{run_id}/output                  what a run printed so far (while it runs, and after)
"""

from __future__ import annotations

import mimetypes
import re
from dataclasses import dataclass
from typing import Literal

SESSION_FILE_TEMPLATE = "sandbox://sessions/{session_id}/files/{+path}"
RUN_FILE_TEMPLATE = "sandbox://runs/{run_id}/files/{+path}"
RUN_OUTPUT_TEMPLATE = "sandbox://runs/{run_id}/output"

_ID = r"[A-Za-z0-9_-]{1,64}"
_PATTERNS = (
    ("session_file", re.compile(rf"^sandbox://sessions/(?P<id>{_ID})/files/(?P<path>.+)$")),
    ("run_file", re.compile(rf"^sandbox://runs/(?P<id>{_ID})/files/(?P<path>.+)$")),
    ("run_output", re.compile(rf"^sandbox://runs/(?P<id>{_ID})/output$")),
)
Kind = Literal["session_file", "run_file", "run_output"]


@dataclass(frozen=True)
class SandboxUri:
    kind: Kind
    id: str  # the session's or the run's
    path: str | None = None


def session_file_uri(session_id: str, path: str) -> str:
    return f"sandbox://sessions/{session_id}/files/{path}"


def run_file_uri(run_id: str, path: str) -> str:
    return f"sandbox://runs/{run_id}/files/{path}"


def run_output_uri(run_id: str) -> str:
    return f"sandbox://runs/{run_id}/output"


def parse(uri: str) -> SandboxUri | None:
    """The URI's parts, or None when it is not one of ours."""
    for kind, pattern in _PATTERNS:
        match = pattern.match(uri)
        if match is not None:
            groups = match.groupdict()
            return SandboxUri(kind=kind, id=groups["id"], path=groups.get("path"))  # type: ignore[arg-type]
    return None


def guess_mime(path: str) -> str:
    return mimetypes.guess_type(path)[0] or "application/octet-stream"


TEXT_MIMES = ("text/", "application/json", "application/xml", "application/javascript")


def as_text(data: bytes, mime: str) -> str | None:
    """The bytes as text when they are meant and able to be (UTF-8, no NUL), else None."""
    if not (mime.startswith(TEXT_MIMES) or mime == "application/octet-stream"):
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if "\x00" not in text else None
