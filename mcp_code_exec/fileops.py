"""File tools on a session's /mnt/data (through its agent) and on the files a stateless run left.

Paths are checked here first (``protocol.paths``: a clear error, nothing sent), then again by the
agent, component by component, as the sandbox user. A session that is running code is busy:
file calls get a clear answer naming the run instead of waiting behind it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from .config import Config
from .errors import FileOperationError, ProtocolViolation, SandboxError, SessionNotFound
from .execution import file_info
from .models import DirEntry, FileContent, FileInfo
from .protocol import messages as wire
from .protocol import paths
from .sandbox import Sandbox
from .sessions import Session, SessionRegistry
from .store import RunFileStore
from .uris import guess_mime, run_file_uri, session_file_uri

MIB = 1024 * 1024
EnsureSandbox = Callable[[Session], Awaitable[Sandbox]]


class FileOps:
    def __init__(
        self, config: Config, *, sessions: SessionRegistry, run_files: RunFileStore, ensure_sandbox: EnsureSandbox
    ) -> None:
        self.config = config
        self.sessions = sessions
        self.run_files = run_files
        self._ensure_sandbox = ensure_sandbox

    @asynccontextmanager
    async def _session_in_use(self, owner: str, session_id: str) -> AsyncIterator[Session]:
        """The caller's session, held (one call at a time) and counted busy so it cannot idle out."""
        session = self.sessions.get(session_id, owner)
        await session.check_free()
        session.busy += 1
        try:
            async with session.lock:
                if session.closed:
                    raise SessionNotFound(session_id)
                yield session
        finally:
            session.busy -= 1
            session.touch()

    async def _request(
        self, owner: str, session_id: str, request: wire.Request, payload: bytes = b""
    ) -> tuple[wire.Event, bytes]:
        async with self._session_in_use(owner, session_id) as session:
            sandbox = await self._ensure_sandbox(session)
            event, data = await sandbox.request(request, payload)
        expected = {"list_files": wire.Listing, "read_file": wire.FileData, "write_file": wire.Written}[request.op]
        if not isinstance(event, expected):
            sandbox.broken = True
            raise ProtocolViolation(f"the sandbox answered {request.op} with {event.ev!r}; it will be replaced")
        return event, data

    async def list_files(
        self, owner: str, session_id: str, path: str = ".", limit: int = 1000
    ) -> tuple[list[DirEntry], bool]:
        relative = paths.normalize(path, allow_root=True)
        listing, _ = await self._request(owner, session_id, wire.ListFiles(path=relative or ".", limit=limit))
        assert isinstance(listing, wire.Listing)
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

    async def read_file(self, owner: str, session_id: str, path: str) -> FileContent:
        relative = paths.normalize(path)
        cap = self.config.limits.read_max_bytes
        found, data = await self._request(owner, session_id, wire.ReadFile(path=relative, max_bytes=cap))
        assert isinstance(found, wire.FileData)
        if len(data) > cap or len(data) != found.size:
            raise ProtocolViolation("the sandbox sent a file over the read cap, or not the size it stated")
        return FileContent(path=found.path, size=found.size, modified=found.modified, data=data)

    async def write_file(self, owner: str, session_id: str, path: str, data: bytes) -> FileInfo:
        relative = paths.normalize(path)
        limits = self.config.limits
        if len(data) > limits.write_max_bytes:
            cap = limits.write_max_bytes
            raise FileOperationError(
                f"content is {len(data)} bytes, over the write cap of {cap} bytes; nothing was written"
            )
        session = self.sessions.get(session_id, owner)
        request = wire.WriteFile(
            path=relative, data_quota_bytes=limits.session_data_mb * MIB, data_quota_files=limits.session_max_files
        )
        written, _ = await self._request(owner, session_id, request, data)
        assert isinstance(written, wire.Written)
        info = file_info(session_file_uri(session_id, written.path), written)
        session.known_files[info.path] = info
        return info

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
                    session.known_files = {e.path: e for e in entries if not e.is_dir}
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
