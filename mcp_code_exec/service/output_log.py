"""What a running run printed, kept for callers that poll it or follow it (``Run.output``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import anyio

OUTPUT_KEPT = 256 * 1024  # per stream, for polls of a running run (the final result has its own caps)


@dataclass(eq=False)
class OutputLog:
    """What a running run printed, for callers that poll it (each reader gets what is new to it) or
    follow it (``follow``); closed when the run ends."""

    kept: int = OUTPUT_KEPT
    chunks: dict[str, str] = field(default_factory=lambda: {"stdout": "", "stderr": ""})
    offsets: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})  # of chunks[...][0]
    dropped: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    changed: anyio.Event = field(default_factory=anyio.Event)
    closed: bool = False

    def add(self, stream: str, text: str) -> None:
        if stream not in self.chunks:
            return
        combined = self.chunks[stream] + text
        if len(combined) > self.kept:
            cut = len(combined) - self.kept
            self.dropped[stream] += cut
            self.offsets[stream] += cut
            combined = combined[cut:]
        self.chunks[stream] = combined
        self.changed.set()

    def end(self, stream: str) -> int:
        return self.offsets[stream] + len(self.chunks[stream])

    def since(self, stream: str, position: int) -> str:
        """The text after ``position`` (a marker says when some was dropped meanwhile)."""
        start = position - self.offsets[stream]
        if start >= 0:
            return self.chunks[stream][start:]
        return f"[... {-start} characters not kept ...]\n" + self.chunks[stream]

    def renew(self) -> anyio.Event:
        """An event set at the next ``add`` or at ``close`` (a fresh one once the last was set)."""
        if self.changed.is_set():
            self.changed = anyio.Event()
        return self.changed

    def close(self) -> None:
        """The run ended: nothing more comes, and followers stop after what they have not read yet."""
        self.closed = True
        self.changed.set()

    async def follow(self, *, from_now: bool = False) -> AsyncGenerator[list[tuple[str, str]]]:
        """The output as it comes, from the start (or from now), until the log is closed: batches of
        ``(stream, text)``, stdout first, each holding what is new since the last (a marker says when
        some was dropped meanwhile). The batch read after the close, if any, is the last."""
        positions = {stream: self.end(stream) if from_now else 0 for stream in self.chunks}
        while True:
            changed = self.renew()
            if not self.closed and all(self.end(stream) == at for stream, at in positions.items()):
                await changed.wait()
            closed = self.closed
            batch = []
            for stream, at in positions.items():
                text = self.since(stream, at)
                positions[stream] = self.end(stream)
                if text:
                    batch.append((stream, text))
            if batch:
                yield batch
            if closed:
                return
