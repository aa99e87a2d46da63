"""Output capture with caps, and throttled live streaming of output to the host."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from . import events

STREAM_INTERVAL_S = 0.1
STREAM_CHUNK_MAX = 8192
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def clip_text(text: str, cap: int, what: str = "text") -> tuple[str, bool]:
    """``text`` within ``cap`` UTF-8 bytes, keeping its head and tail around a marker; and whether it was cut."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= cap:
        return text, False
    capture = Capture(cap, what)
    capture.add(raw)
    return capture.text(), True


class Capture:
    """Keeps the head and the tail of a stream within ``cap`` bytes; counts what was cut."""

    def __init__(self, cap: int, what: str = "output") -> None:
        self.what = what
        self.cap = max(256, cap)
        self.head_cap = self.cap * 3 // 4
        self.tail_cap = self.cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk[-self.tail_cap :]
            if len(self.tail) > self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def text(self) -> str:
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace")
        cut = self.total - len(self.head) - len(self.tail)
        marker = f"\n[... {cut} bytes of {self.what} cut here ({self.what} cap {self.cap} bytes) ...]\n"
        return bytes(self.head).decode("utf-8", "replace") + marker + bytes(self.tail).decode("utf-8", "replace")


class Streamer:
    """Sends new output to the host at most every ``STREAM_INTERVAL_S``, in bounded chunks."""

    def __init__(self, send: Callable[..., None], request_id: Any) -> None:
        self.send = send
        self.request_id = request_id
        self.buffers: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self.dropped: dict[str, int] = {"stdout": 0, "stderr": 0}
        self.last = time.monotonic()  # first flush after one interval, so short runs send nothing

    def add(self, stream: str, chunk: bytes) -> None:
        buffer = self.buffers[stream]
        room = STREAM_CHUNK_MAX - len(buffer)
        buffer += chunk[: max(0, room)]
        self.dropped[stream] += max(0, len(chunk) - max(0, room))

    def next_flush(self, now: float) -> float:
        if not any(self.buffers.values()):
            return STREAM_INTERVAL_S
        return max(0.0, self.last + STREAM_INTERVAL_S - now)

    def maybe_flush(self, now: float) -> None:
        if now - self.last >= STREAM_INTERVAL_S:
            self.flush(now)

    def flush(self, now: float = 0.0) -> None:
        for stream, buffer in self.buffers.items():
            if not buffer and not self.dropped[stream]:
                continue
            text = bytes(buffer).decode("utf-8", "replace")
            if self.dropped[stream]:
                text += f"\n[... {self.dropped[stream]} bytes not streamed ...]\n"
            self.send(events.output(self.request_id, stream, text))
            buffer.clear()
            self.dropped[stream] = 0
        if now:
            self.last = now
