"""File tools on a session's /mnt/data (through its agent) and on the files a stateless run left.

Paths are checked here first (``protocol.paths``: a clear error, nothing sent), then again by the
agent, component by component, as the sandbox user. A session that is running code is busy:
file calls get a clear answer naming the run instead of waiting behind it. Bytes move in chunks
(``transfer``), so files of any size stream through without being held whole; a transfer holds
its session from the first chunk to the last (a run started meanwhile waits for it to end), and
the capped ``read_file``/``write_file`` are such transfers too.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

from ..config.sections import Limits
from ..errors import FileOperationError, ProtocolViolation, SandboxError, TooLarge
from ..models import DirEntry, FileContent, FileInfo
from ..protocol import messages as wire
from ..protocol import paths
from ..sandbox.transfer import CHUNK_BYTES, WINDOW, Download, Pipeline, check_chunk, open_download, upload
from .keeper import SessionKeeper
from .outcomes import file_info
from .run_files import RunFileStore
from .sessions import Session, SessionRegistry
from .uris import guess_mime, run_file_uri, session_file_uri

E = TypeVar("E", bound=wire.Wire)


class FileOps:
    def __init__(
        self, limits: Limits, *, sessions: SessionRegistry, run_files: RunFileStore, keeper: SessionKeeper
    ) -> None:
        self.limits = limits
        self.sessions = sessions
        self.run_files = run_files
        self.keeper = keeper

    @asynccontextmanager
    async def _session_in_use(
        self, owner: str, session_id: str, *, busy_wait_s: float | None = None
    ) -> AsyncIterator[Session]:
        """The caller's session, held (one call at a time) and counted busy so it cannot idle out.

        ``busy_wait_s``: wait at most this long for a session another call holds, then raise
        ``SessionBusy``. File URLs use it: a client that never reads a download holds its session
        for the stall timeout, and every transfer queued behind it would hold a connection as long.
        """
        session = self.sessions.get(session_id, owner)
        async with session.in_use(busy_wait_s):
            yield session

    async def ask(
        self, owner: str, session_id: str, request: wire.Request, answer: type[E], *, busy_wait_s: float | None = None
    ) -> E:
        """One request to the session's agent, in one hold of the session; its answer must be an
        ``answer``. ``busy_wait_s``: see ``_session_in_use``."""
        async with self._session_in_use(owner, session_id, busy_wait_s=busy_wait_s) as session:
            sandbox = await self.keeper.ensure(session)
            event, _ = await sandbox.request(request)
        if not isinstance(event, answer):
            sandbox.mark_broken("broken")
            raise ProtocolViolation(f"the sandbox answered {request.op} with {event.ev!r}; it will be replaced")
        return event

    async def list_files(
        self, owner: str, session_id: str, path: str = ".", limit: int = 1000
    ) -> tuple[list[DirEntry], bool]:
        relative = paths.normalize(path, allow_root=True)
        listing = await self.ask(owner, session_id, wire.ListFiles(path=relative or ".", limit=limit), wire.Listing)
        entries = [
            DirEntry(
                path=e.path,
                size=e.size,
                modified=e.modified,
                is_dir=e.is_dir,
                uri=None if e.is_dir else session_file_uri(session_id, e.path),
                mime_type=None if e.is_dir else guess_mime(e.path),
                note="symlink (not followed)" if e.is_symlink else None,
            )
            for e in listing.entries[:limit]
        ]
        return entries, listing.truncated

    @asynccontextmanager
    async def read_stream(
        self,
        owner: str,
        session_id: str,
        path: str,
        *,
        max_bytes: int | None = None,
        first_length: int | None = None,
        busy_wait_s: float | None = None,
    ) -> AsyncIterator[Download]:
        """A file of any size: its size and mtime at once, then ``chunks()``. The session is held
        until the block ends. ``max_bytes``: refuse a bigger file before reading more of it.
        ``busy_wait_s``: see ``_session_in_use``."""
        relative = paths.normalize(path)
        async with self._session_in_use(owner, session_id, busy_wait_s=busy_wait_s) as session:
            sandbox = await self.keeper.ensure(session)
            length = CHUNK_BYTES if first_length is None else first_length
            download = await open_download(sandbox, relative, max_bytes=max_bytes, first_length=length)
            try:
                yield download
            finally:
                download.close()

    async def read_ranges(
        self, owner: str, session_id: str, path: str, ranges: list[tuple[int, int]]
    ) -> tuple[int, list[bytes]]:
        """Pieces of a file the server itself names (the notebook view's, under the reserved
        ``.mcpx``: never a caller's path), read in one hold of the session: the file's size, and each
        ``(offset, length)`` piece (``length`` at most ``CHUNK_BYTES``), cut at the file's end."""
        async with self._session_in_use(owner, session_id) as session:
            sandbox = await self.keeper.ensure(session)
            first = await open_download(sandbox, path, first_length=0)
            pipeline = Pipeline[bytes](sandbox)
            pieces: list[bytes] = []
            try:
                for at, (offset, length) in enumerate(ranges):
                    check = functools.partial(_piece, path=path, offset=offset, length=length, first=first.first)
                    await pipeline.send(wire.ReadChunk(path=path, offset=offset, length=length), b"", check)
                    if len(pipeline) >= WINDOW or at == len(ranges) - 1:
                        while len(pipeline):
                            pieces.append(await pipeline.next())
            finally:
                pipeline.close()
        return first.size, pieces

    async def stat_file(self, owner: str, session_id: str, path: str) -> FileInfo:
        """A readable regular file's path, size and mtime (nothing of it is read)."""
        async with self.read_stream(owner, session_id, path, first_length=0) as found:
            return FileInfo(path=found.path, size=found.size, modified=found.modified)

    async def read_file(self, owner: str, session_id: str, path: str) -> FileContent:
        cap = self.limits.read_max_bytes
        async with self.read_stream(owner, session_id, path, max_bytes=cap) as found:
            data = b"".join([chunk async for chunk in found.chunks()])
        return FileContent(path=found.path, size=found.size, modified=found.modified, data=data)

    async def write_stream(
        self,
        owner: str,
        session_id: str,
        path: str,
        source: AsyncIterable[bytes],
        *,
        max_bytes: int,
        expected_size: int | None = None,
        busy_wait_s: float | None = None,
    ) -> FileInfo:
        """Write what ``source`` yields to ``path``: in place atomically once it ends, or not at all
        (a quota, ``max_bytes``, an error of the source's own). ``expected_size``, when known, is
        checked against the quota before the first byte is staged. ``busy_wait_s``: see
        ``_session_in_use``."""
        relative = paths.normalize(path)
        limits = self.limits
        if expected_size is not None and expected_size > max_bytes:
            raise TooLarge(f"{expected_size} bytes is over the cap of {max_bytes} bytes; nothing was written")
        async with self._session_in_use(owner, session_id, busy_wait_s=busy_wait_s) as session:
            sandbox = await self.keeper.ensure(session)
            written = await upload(
                sandbox,
                relative,
                source,
                max_bytes=max_bytes,
                total=expected_size,
                quota_bytes=limits.session_data_bytes,
                quota_files=limits.session_max_files,
            )
            info = file_info(session_file_uri(session_id, written.path), written)
            session.remember([info])
        return info

    async def write_file(self, owner: str, session_id: str, path: str, data: bytes) -> FileInfo:
        cap = self.limits.write_max_bytes
        if len(data) > cap:
            paths.normalize(path)  # a bad path is the first thing to hear about
            raise TooLarge(f"content is {len(data)} bytes, over the write cap of {cap} bytes; nothing was written")

        async def whole() -> AsyncIterator[bytes]:
            yield data

        return await self.write_stream(owner, session_id, path, whole(), max_bytes=cap, expected_size=len(data))

    async def session_files(self, owner: str, limit: int = 500) -> list[FileInfo]:
        """The files of every session the owner has, for resources/list.

        A session that is busy (running code, or another file call) is not waited for: its files as
        last seen are listed. Deletions that run made show up in the next listing.
        """
        found: list[FileInfo] = []
        for session in self.sessions.owned_by(owner):
            # No checkpoint between this test and the lock's acquisition in _session_in_use.
            if not session.lock.locked() and session.active_run is None:
                try:
                    entries, _ = await self.list_files(owner, session.id, ".", limit=limit)
                except SandboxError:
                    pass  # a session that just closed, or a sandbox that died: what was last seen
                else:
                    session.relist(e for e in entries if not e.is_dir)
            found += session.known_files.values()
        return found

    # -- files of stateless runs ---------------------------------------------------------------------
    def read_run_file(self, owner: str, run_id: str, path: str) -> FileContent:
        relative = paths.normalize(path)
        found = self.run_files.get(run_id, owner, relative)
        if found is None:
            raise FileOperationError(f"no such file in run {run_id}: {path} (list them with list_files(run_id=...))")
        data, modified = found
        return FileContent(path=relative, size=len(data), modified=modified, data=data)

    def list_run_files(self, owner: str, run_id: str) -> list[DirEntry]:
        return [
            DirEntry(
                path=path, size=size, modified=modified, uri=run_file_uri(run_id, path), mime_type=guess_mime(path)
            )
            for path, size, modified in self.run_files.files(run_id, owner)
        ]


def _piece(event: wire.Event, payload: bytes, *, path: str, offset: int, length: int, first: wire.Chunk) -> bytes:
    check_chunk(event, payload, path=path, offset=offset, length=length, first=first)
    return payload
