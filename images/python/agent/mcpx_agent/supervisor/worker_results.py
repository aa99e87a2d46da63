"""What a run's worker says on its result pipe, checked, capped again and passed on to the host.

Everything read from the result pipe is hostile (user code holds that descriptor): only the frames
``protocol.worker_frame`` allows are accepted, the run's caps are applied again (images, displays,
tables, notes), and a frame that breaks the protocol marks the run to be stopped. Nothing from the
worker is passed on as it came: each event to the host is built here from checked values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .. import events, protocol
from ..output import clip_text

MAX_WORKER_NOTES = 4
MAX_TABLES = 8  # table references a run may send (the worker keeps as many)
TABLE_FIELDS = ("table", "columns", "dtypes", "rows", "total_rows", "sorted_columns")
DEFAULTS = {
    "max_output_bytes": 65536,
    "max_result_bytes": 65536,
    "max_display_bytes": 65536,
    "max_displays": 50,
    "max_images": 20,
    "max_image_bytes": 1_000_000,
    "max_image_pixels": 2_000_000,
}


def option(options: dict[str, Any], name: str) -> int:
    """A run's cap as the host set it, or the agent's own when it is missing or not a positive int."""
    value = options.get(name, DEFAULTS[name])
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else DEFAULTS[name]


class WorkerResults:
    """The result pipe of one run's worker: what it said (``done``, notes, what it displayed) and
    whether it broke the protocol (``violation``)."""

    def __init__(
        self, fd: int, request_id: int, options: dict[str, Any], send: Callable[[dict[str, Any], bytes], None]
    ) -> None:
        self.request_id = request_id
        self.options = options
        self.send = send
        self.reader = protocol.FrameReader(
            fd,
            max_header=protocol.MAX_WORKER_HEADER,
            max_payload=max(option(options, "max_image_bytes"), protocol.MAX_CALL_PAYLOAD),
        )
        self.done: dict[str, Any] | None = None
        self.violation: str | None = None  # why the pipe broke the protocol, once it did
        self.closed_at: float | None = None  # when the worker closed the pipe
        self.images = self.displays = self.display_bytes = 0
        self.truncated: set[str] = set()
        self.tables = 0
        self.notes: list[str] = []  # the worker's (its snapshot's): bounded, and labelled as the session's
        # What the run displayed, for the session's history: ("display", text, b"") or ("image", mime, bytes).
        self.kept: list[tuple[str, Any, bytes]] | None = [] if options.get("history_max_bytes") else None

    @property
    def eof(self) -> bool:
        return self.reader.eof

    def read(self) -> bool:
        """Read and forward what the worker sent; True when it broke the protocol just now."""
        if self.reader.eof or self.violation is not None:
            return False
        broke = False
        try:
            self.reader.fill()
            for header, payload in self.reader.frames():
                self.forward(header, payload)
        except protocol.ProtocolError as exc:
            self.violation = str(exc)[:300]
            broke = True
        if self.reader.eof and self.closed_at is None:
            self.closed_at = time.monotonic()
        return broke

    def forward(self, header: dict[str, Any], payload: bytes) -> None:
        """Check one frame from the worker and pass on what it may say (``ProtocolError`` otherwise)."""
        frame = protocol.worker_frame(header, payload, option(self.options, "max_image_bytes"))
        kind = frame["kind"]
        if kind == "done":
            self.done = frame
            self.truncated.update(frame.get("truncated", []))
        elif kind == "call":
            raw = bool(frame.get("raw", False))
            self.send(events.tool_call(self.request_id, frame["call"], frame["server"], frame["tool"], raw), payload)
        elif kind == "note":
            if len(self.notes) < MAX_WORKER_NOTES:
                self.notes.append(clip_text(frame["text"], 1000)[0])
        elif kind == "table":
            if self.tables < MAX_TABLES:
                self.tables += 1
                self.send(events.table(self.request_id, **{key: frame[key] for key in TABLE_FIELDS}), b"")
                if self.kept is not None:
                    self.kept.append(("table", {key: frame[key] for key in TABLE_FIELDS}, b""))
        elif kind not in ("image", "display"):
            raise protocol.ProtocolError(f"{kind}: not during a run")
        elif kind == "image":
            self.image(frame, payload)
        else:
            self.display(frame)

    def image(self, frame: dict[str, Any], payload: bytes) -> None:
        size = protocol.image_size(frame["mime"], payload)
        pixels_ok = size is not None and size[0] * size[1] <= option(self.options, "max_image_pixels")
        if self.images >= option(self.options, "max_images") or not pixels_ok:
            self.truncated.add("images")
            return
        assert size is not None
        self.images += 1
        note = frame.get("note")
        note = clip_text(note, 1024)[0] if note else None
        self.send(events.image(self.request_id, frame["mime"], size[0], size[1], note), payload)
        if self.kept is not None:
            self.kept.append(("image", frame["mime"], payload))

    def display(self, frame: dict[str, Any]) -> None:
        budget = option(self.options, "max_display_bytes") - self.display_bytes
        if self.displays >= option(self.options, "max_displays") or budget <= 0:
            self.truncated.add("displays")
            return
        text, cut = clip_text(frame["text"], budget, "display output")
        if cut:
            self.truncated.add("displays")
        self.displays += 1
        self.display_bytes += len(text.encode("utf-8", "replace"))
        self.send(events.display(self.request_id, text), b"")
        if self.kept is not None:
            self.kept.append(("display", text, b""))
