"""Files of any size in and out of a session's sandbox, one chunk per request, every answer checked.

A download asks for ``CHUNK_BYTES`` at a time, by offset. An upload sends ``CHUNK_BYTES`` at a time
to a staging file that the agent renames into place with the last chunk (see the agent's
``transfer`` module); a failed or abandoned upload is aborted, and the agent removes the staging
file. No frame either way is larger than a chunk and its header, so memory stays flat whatever the
file's size.

The agent's answers are hostile: a chunk of another path or offset, more or fewer bytes than the
file's size allows, a stated size that does not add up, are a ``ProtocolViolation`` (the sandbox is
replaced). A file that changes between chunks is user code's doing, not the agent's: that is a
plain ``FileOperationError``.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Generic, TypeVar

import anyio

from ..errors import FileOperationError, ProtocolViolation, SandboxError, TooLarge
from ..protocol import messages as wire
from ..protocol.frames import MAX_CHUNK
from .channel import Route
from .container import Sandbox

CHUNK_BYTES = 1 << 20
WINDOW = 4  # chunks in flight at once, either way
T = TypeVar("T")
assert CHUNK_BYTES <= MAX_CHUNK


def check_chunk(
    event: wire.Event, payload: bytes, *, path: str, offset: int, length: int, first: wire.Chunk | None
) -> wire.Chunk:
    """The agent's answer to ``ReadChunk(path, offset, length)``, held to what was asked and to the
    first chunk's size and mtime (``first``: None for the first chunk itself)."""
    if not isinstance(event, wire.Chunk):
        raise ProtocolViolation(f"the sandbox answered a chunk read with {event.ev!r}")
    if event.path != path or event.offset != offset:
        raise ProtocolViolation("the sandbox sent a chunk of another file or offset")
    if len(payload) != max(0, min(length, event.size - offset)):
        raise ProtocolViolation("the sandbox sent a chunk that does not fit the size it stated")
    if first is not None and (event.size, event.mtime_ns) != (first.size, first.mtime_ns):
        raise FileOperationError(f"{path}: changed while being read; read it again")
    return event


def check_staged(event: wire.Event, *, upload: str, size: int) -> wire.Staged:
    if not isinstance(event, wire.Staged) or event.upload != upload or event.size != size:
        raise ProtocolViolation("the sandbox acknowledged a chunk it was not sent")
    return event


def check_written(event: wire.Event, *, path: str, size: int) -> wire.Written:
    if not isinstance(event, wire.Written) or event.path != path or event.size != size:
        raise ProtocolViolation("the sandbox reported another file than the one it was sent")
    return event


class Pipeline(Generic[T]):
    """Requests in flight (up to ``WINDOW``), answered in order: the agent works on one chunk while
    the next ones travel. ``close`` forgets those still in flight (their answers are dropped)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self._waiting: deque[tuple[Route, Callable[[wire.Event, bytes], T]]] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    async def send(self, request: wire.Request, payload: bytes, check: Callable[[wire.Event, bytes], T]) -> None:
        # Shielded (and bounded by the sandbox's own deadline): a frame cut off halfway by a
        # cancellation (a client that went away) would garble every frame after it.
        with anyio.CancelScope(shield=True):
            route = await self.sandbox.send_request(request, payload)
        self._waiting.append((route, check))

    async def next(self) -> T:
        route, check = self._waiting.popleft()
        try:
            event, data = await self.sandbox.answer(route)
        finally:
            route.close()
        try:
            return check(event, data)
        except ProtocolViolation:
            self.sandbox.mark_broken("broken")
            raise

    def close(self) -> None:
        while self._waiting:
            self._waiting.popleft()[0].close()


async def _exchange(
    sandbox: Sandbox, request: wire.Request, payload: bytes, check: Callable[[wire.Event, bytes], T]
) -> T:
    """One request, one checked answer."""
    pipeline = Pipeline[T](sandbox)
    try:
        await pipeline.send(request, payload, check)
        return await pipeline.next()
    finally:
        pipeline.close()


class Download:
    """A file being read; ``size`` is known before the first byte is handed out."""

    def __init__(self, sandbox: Sandbox, first: wire.Chunk, data: bytes) -> None:
        self.sandbox = sandbox
        self.first = first
        self._data = data
        self._pipeline = Pipeline[bytes](sandbox)

    @property
    def path(self) -> str:
        return self.first.path

    @property
    def size(self) -> int:
        return self.first.size

    @property
    def modified(self) -> float:
        return self.first.modified

    async def chunks(self) -> AsyncIterator[bytes]:
        """The file's bytes, a chunk at a time (``FileOperationError`` if it changes meanwhile)."""
        data, self._data = self._data, b""
        offset = asked = len(data)
        if data:
            yield data
        try:
            while offset < self.size:
                while len(self._pipeline) < WINDOW and asked < self.size:
                    request = wire.ReadChunk(path=self.path, offset=asked, length=CHUNK_BYTES)
                    await self._pipeline.send(request, b"", functools.partial(self._check, at=asked))
                    asked += CHUNK_BYTES
                data = await self._pipeline.next()
                offset += len(data)
                yield data
        finally:
            self.close()

    def _check(self, event: wire.Event, payload: bytes, *, at: int) -> bytes:
        check_chunk(event, payload, path=self.path, offset=at, length=CHUNK_BYTES, first=self.first)
        return payload

    def close(self) -> None:
        """Forget the reads still in flight (a consumer that stopped early)."""
        self._pipeline.close()


async def open_download(
    sandbox: Sandbox, path: str, *, max_bytes: int | None = None, first_length: int = CHUNK_BYTES
) -> Download:
    """Read the first chunk of ``path`` (``first_length`` 0: only its size), refusing a file over
    ``max_bytes`` before anything more is read."""
    request = wire.ReadChunk(path=path, offset=0, length=first_length)
    found: list[bytes] = []

    def check(event: wire.Event, payload: bytes) -> wire.Chunk:
        found.append(payload)
        return check_chunk(event, payload, path=path, offset=0, length=first_length, first=None)

    first = await _exchange(sandbox, request, b"", check)
    if max_bytes is not None and first.size > max_bytes:
        raise TooLarge(f"{path}: {first.size} bytes is over the read cap of {max_bytes} bytes")
    return Download(sandbox, first, found[0])


class Upload:
    """A file being written: ``write`` as the bytes come, then ``finish``; ``abort`` otherwise."""

    def __init__(
        self,
        sandbox: Sandbox,
        path: str,
        *,
        max_bytes: int,
        total: int | None = None,
        quota_bytes: int | None = None,
        quota_files: int | None = None,
    ) -> None:
        self.sandbox = sandbox
        self.path = path
        self.id = secrets.token_hex(16)
        self.max_bytes = max_bytes
        self.total = total
        self.quota_bytes, self.quota_files = quota_bytes, quota_files
        self.sent = 0  # bytes sent to the agent (it acknowledges them in order)
        self.begun = False
        self.finished = False
        self._buffer = bytearray()
        self._pipeline = Pipeline[wire.Staged | wire.Written](sandbox)

    @property
    def received(self) -> int:
        return self.sent + len(self._buffer)

    async def begin(self) -> None:
        """Start the upload before any byte is at hand: the agent checks the announced size against
        the quota now (a refusal then costs the client nothing of its body)."""
        if not self.begun:
            await self._send(b"", final=False)

    async def write(self, data: bytes) -> None:
        if self.received + len(data) > self.max_bytes:
            raise TooLarge(f"more than {self.max_bytes} bytes for {self.path}; nothing was written")
        self._buffer += data
        while len(self._buffer) >= CHUNK_BYTES:
            chunk = bytes(self._buffer[:CHUNK_BYTES])
            del self._buffer[:CHUNK_BYTES]
            await self._send(chunk, final=False)

    async def finish(self) -> wire.Written:
        """Send what is left as the last chunk: the file is then in place."""
        chunk = bytes(self._buffer)
        self._buffer.clear()
        written = await self._send(chunk, final=True)
        assert isinstance(written, wire.Written)
        self.finished = True
        return written

    async def _send(self, chunk: bytes, *, final: bool) -> wire.Staged | wire.Written | None:
        """Send a chunk; wait for answers while ``WINDOW`` are in flight, or for all of them (the
        last one's is returned) after the final chunk or an empty one (``begin``)."""
        request = wire.WriteChunk(
            upload=self.id,
            path=self.path,
            offset=self.sent,
            final=final,
            total=None if self.begun else self.total,
            data_quota_bytes=self.quota_bytes,
            data_quota_files=self.quota_files,
        )
        size = self.sent + len(chunk)

        def check(event: wire.Event, _: bytes) -> wire.Staged | wire.Written:
            if final:
                return check_written(event, path=self.path, size=size)
            return check_staged(event, upload=self.id, size=size)

        self.begun = True  # from here on, the agent may hold a staging file
        await self._pipeline.send(request, chunk, check)
        self.sent = size
        answer = None
        while len(self._pipeline) >= (1 if final or not chunk else WINDOW):
            answer = await self._pipeline.next()
        return answer

    def _check_dropped(self, event: wire.Event, _: bytes) -> None:
        if not isinstance(event, wire.Dropped) or event.upload != self.id:
            raise ProtocolViolation("the sandbox answered an abort with something else")

    async def abort(self) -> None:
        """Tell the agent to drop the staging file (it already has when a chunk failed there)."""
        self._buffer.clear()
        self._pipeline.close()
        if self.finished or not self.begun or not self.sandbox.alive:
            return
        # A sandbox that cannot answer is replaced; its successor purges staging files.
        with contextlib.suppress(SandboxError):
            await _exchange(self.sandbox, wire.AbortUpload(upload=self.id), b"", self._check_dropped)


async def upload(
    sandbox: Sandbox,
    path: str,
    source: AsyncIterable[bytes],
    *,
    max_bytes: int,
    total: int | None = None,
    quota_bytes: int | None = None,
    quota_files: int | None = None,
) -> wire.Written:
    """Write what ``source`` yields to ``path`` in the sandbox: in place atomically once it ends, or
    not at all (the staging file is dropped, even when the caller is cancelled). A ``total`` of
    more than a chunk is checked against the quota before the first byte is read from ``source``."""
    transfer = Upload(sandbox, path, max_bytes=max_bytes, total=total, quota_bytes=quota_bytes, quota_files=quota_files)
    try:
        if total is not None and total > CHUNK_BYTES:
            await transfer.begin()
        async for data in source:
            await transfer.write(data)
        return await transfer.finish()
    finally:
        if not transfer.finished:
            with anyio.CancelScope(shield=True):
                await transfer.abort()


async def file_chunks(path: str) -> AsyncIterator[bytes]:
    """A host file, a chunk at a time."""
    async with await anyio.open_file(path, "rb") as source:
        while chunk := await source.read(CHUNK_BYTES):
            yield chunk
