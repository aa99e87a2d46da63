"""Where a worker's rich output goes: frames on the result pipe, capped, sent as they happen.

The worker caps what it sends (so a huge value or a flood of displays never breaks its own
pipe and a session keeps its variables); the supervisor checks and caps again, since user code
can write to the pipe directly.
"""

from __future__ import annotations

import base64
from typing import Any

from .. import events, protocol
from ..output import ANSI, clip_text

DEFAULT_CAP = 65536


class Sink:
    def __init__(self) -> None:
        self.fd: int | None = None
        self.options: dict[str, Any] = {}
        self.result_text: str | None = None
        self.error: dict[str, Any] | None = None
        self.images = 0
        self.displays = 0
        self.display_bytes = 0
        self.truncated: set[str] = set()
        self.tables = 0

    def reset(self, fd: int, options: dict[str, Any]) -> None:
        self.fd = fd
        self.options = options
        self.result_text = None
        self.error = None
        self.images = self.displays = self.display_bytes = self.tables = 0
        self.truncated = set()

    def raised(self, error: dict[str, Any]) -> None:
        """The cell's exception (``tracebacks.error_info``), as its traceback was shown: the last one counts."""
        self.error = error

    def raised_unshown(self, error: dict[str, Any]) -> None:
        """An exception that ended the cell with no traceback shown for it (IPython showed none, or the
        lean path raised it): the cell's, unless one was shown already."""
        if self.error is None:
            self.error = error

    def cap(self, name: str) -> int:
        return int(self.options.get(name, DEFAULT_CAP))

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        if self.fd is not None:
            protocol.send(self.fd, header, payload)

    def display(self, data: dict[str, Any], *, is_result: bool = False) -> None:
        for mime in protocol.IMAGE_MIMES:
            if mime in data:
                raw = data[mime]
                try:
                    blob = base64.b64decode(raw) if isinstance(raw, str) else bytes(raw)
                except (ValueError, TypeError):
                    blob = b""
                self.image(blob, mime)
                # One picture per object, the first format in preference order (Pillow offers
                # both PNG and JPEG); a result keeps its text too, a display does not.
                if not is_result:
                    return
                break
        text = data.get("text/plain")
        if text is None:
            return
        text = ANSI.sub("", str(text))
        if is_result:
            self.result_text, cut = clip_text(text, self.cap("max_result_bytes"), "the value")
            if cut:
                self.truncated.add("result")
            return
        self.send_display(text)

    def send_display(self, text: str) -> None:
        budget = self.cap("max_display_bytes") - self.display_bytes
        if self.displays >= self.cap("max_displays") or budget <= 0:
            self.truncated.add("displays")
            return
        text, cut = clip_text(text, budget, "display output")
        if cut:
            self.truncated.add("displays")
        self.displays += 1
        self.display_bytes += len(text.encode("utf-8", "replace"))
        self.send(events.worker_display(text))

    def table(self, obj: Any) -> None:
        """Keep a DataFrame or Series the cell shows for the notebook view (sessions with a history only:
        a stateless run's /mnt/data goes with it). Best effort: a table that cannot be kept is skipped."""
        if self.fd is None or not self.options.get("history_max_bytes"):
            return  # before the import: it loads secrets and OpenSSL, which a stateless run never needs
        from . import tables

        if not tables.is_table(obj):
            return
        if self.tables >= tables.MAX_PER_RUN:
            return
        self.tables += 1
        try:
            reference = tables.write_table(obj)
        except Exception:  # noqa: BLE001 - the user's object (its types, its str) or the quota
            return
        if reference is not None:
            self.send(reference)

    def image(self, blob: bytes, mime: str) -> None:
        from .images import fit_image, keep_original

        if self.images >= self.cap("max_images"):
            self.truncated.add("images")
            return
        self.images += 1
        fitted, width, height, note = fit_image(blob, mime, self.options)
        if not fitted[0]:
            self.send_display(f"[image {self.images} dropped: {note or 'not a readable image'}]")
            return
        if note and self.options.get("keep_originals"):
            note += "; " + keep_original(blob, mime, self.images)
        self.send(events.worker_image(fitted[1], width, height, note), fitted[0])


SINK = Sink()
