"""The sandbox service: what the MCP layer calls. Knows nothing of MCP or any transport.

``async with SandboxService.start(config) as service:`` connects to the engine, checks the image,
removes what a dead server left, and keeps the warm pools filled until the block exits, when every
container and volume it made is removed.
"""

from __future__ import annotations

import logging
import mimetypes
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup

from .config import Config
from .errors import FileOperationError, ImageMissing, ProtocolViolation, SandboxError, SandboxLost, SessionNotFound
from .image import BUILD_COMMAND, context_hash
from .lifecycle import new_volume_name, owner_token, sweep, sweep_instance
from .models import DirEntry, FileContent, FileInfo, RunResult, SessionInfo
from .pool import WarmPool
from .protocol import messages as wire
from .protocol import paths
from .runtime.base import LABEL_CONTEXT, LABEL_INSTANCE, LABEL_KIND, LABEL_OWNER, ContainerEngine, ContainerSpec
from .sandbox import OutputCallback, RawRun, Sandbox, start_sandbox
from .sessions import Session, SessionRegistry
from .spec import container_spec
from .store import RunFileStore

log = logging.getLogger(__name__)
MIB = 1024 * 1024


def session_uri(session_id: str, path: str) -> str:
    return f"sandbox://sessions/{session_id}/files/{path}"


def run_uri(run_id: str, path: str) -> str:
    return f"sandbox://runs/{run_id}/files/{path}"


def guess_mime(path: str) -> str:
    return mimetypes.guess_type(path)[0] or "application/octet-stream"


class SandboxService:
    def __init__(self, config: Config, engine: ContainerEngine, task_group: TaskGroup) -> None:
        self.config = config
        self.engine = engine
        self.sessions = SessionRegistry(config.sessions)
        self.run_files = RunFileStore(
            keep_s=config.stateless_files.keep_s, max_total_bytes=config.stateless_files.max_total_mb * MIB
        )
        self._tg = task_group
        self.instance = secrets.token_hex(8)
        # Session volumes this service created and may not have removed (a superset). An
        # engine stopping or killed mid-create keeps the directory but may lose the labels, so
        # the end-of-service sweep looks these up by name as well as by label.
        self.volume_names: set[str] = set()
        self.stateless = WarmPool(
            "stateless",
            lambda: self._start("stateless"),
            size=config.pool.size,
            acquire_timeout_s=config.pool.acquire_timeout_s,
            max_runs=1 if config.pool.mode == "single-use" else config.pool.max_runs_per_container,
        )
        self.spares = WarmPool(
            "sessions",
            lambda: self._start("session"),
            size=config.pool.session_spares,
            acquire_timeout_s=config.pool.start_timeout_s,
        )
        self._stateless_options = self._options(stateless=True)  # fixed for the service's life
        self._session_options = self._options(stateless=False)

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def start(cls, config: Config, engine: ContainerEngine | None = None) -> AsyncIterator[SandboxService]:
        if engine is None:
            from .runtime.docker import DockerEngine

            engine = await DockerEngine.connect_waiting(config.docker_host, config.engine_wait_s)
        try:
            await check_image(engine, config.image)
            await sweep(engine)
            async with anyio.create_task_group() as tg:
                service = cls(config, engine, tg)
                try:
                    async with service.stateless, service.spares:
                        tg.start_soon(service._reaper)
                        yield service
                finally:
                    with anyio.CancelScope(shield=True):
                        await service._close_all_sessions()
                    tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await sweep_instance(engine, service.instance, service.volume_names)
        finally:
            with anyio.CancelScope(shield=True):
                await engine.aclose()

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until the stateless pool holds a warm container (for tests and benchmarks)."""
        with anyio.fail_after(timeout_s):
            sandbox = await self.stateless.acquire(timeout_s)
        self.stateless.release(sandbox)

    def _labels(self, kind: str) -> dict[str, str]:
        return {LABEL_OWNER: owner_token(), LABEL_INSTANCE: self.instance, LABEL_KIND: kind}

    def spec(self, kind: Literal["stateless", "session"], volume: str | None = None) -> ContainerSpec:
        """The hardened spec of this service's containers (labelled as its own, so its end-of-service
        sweep covers any started from it: the benchmark's docker run baseline does)."""
        return container_spec(self.config, self._labels(kind), volume)

    async def _start(self, kind: Literal["stateless", "session"], volume: str | None = None) -> Sandbox:
        created_volume = None
        try:
            if kind == "session" and volume is None:
                volume = created_volume = new_volume_name()
                self.volume_names.add(volume)
                await self.engine.create_volume(volume, self._labels("session"))
            return await start_sandbox(
                self.engine, self.spec(kind, volume), self._tg, kind=kind, timeout_s=self.config.pool.start_timeout_s
            )
        except BaseException:
            if created_volume is not None:
                with anyio.CancelScope(shield=True):
                    await self._remove_volume(created_volume)
            raise

    async def _remove_volume(self, name: str) -> None:
        """Remove a session volume; one the engine would not remove now is left to the end-of-service sweep."""
        try:
            await self.engine.remove_volume(name)
        except SandboxError as exc:
            log.warning("could not remove volume %s: %s", name, exc)
        else:
            self.volume_names.discard(name)

    async def _reaper(self) -> None:
        while True:
            for session in self.sessions.expired():
                log.info("session %s expired", session.id)
                await self._close(session)
            upcoming = self.sessions.next_expiry()
            delay = 5.0 if upcoming is None else max(0.05, min(5.0, upcoming - time.monotonic()))
            await anyio.sleep(delay)  # a timer, not synchronisation

    async def _close_all_sessions(self) -> None:
        async with anyio.create_task_group() as tg:
            for session in self.sessions.all():
                tg.start_soon(self._close, session)

    # -- running code ------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float:
        limits = self.config.limits
        if timeout is None:
            return limits.default_timeout_s
        if timeout <= 0:
            raise SandboxError("timeout must be a positive number of seconds")
        return min(float(timeout), limits.max_timeout_s)

    def _quota(self) -> dict[str, int]:
        limits = self.config.limits
        return {"data_quota_bytes": limits.session_data_mb * MIB, "data_quota_files": limits.session_max_files}

    def _write_request(self, path: str) -> wire.WriteFile:
        limits = self.config.limits
        return wire.WriteFile(
            path=path, data_quota_bytes=limits.session_data_mb * MIB, data_quota_files=limits.session_max_files
        )

    def _options(self, stateless: bool) -> wire.RunOptions:
        limits = self.config.limits
        caps: dict[str, Any] = {
            "max_output_bytes": limits.max_output_bytes,
            "max_result_bytes": limits.max_output_bytes,
            "max_display_bytes": limits.max_output_bytes,
            "max_displays": limits.max_displays,
            "max_images": limits.max_images,
            "max_image_bytes": limits.max_image_bytes,
            "max_image_pixels": limits.max_image_pixels,
        }
        if not stateless:
            return wire.RunOptions(**caps, keep_originals=True, **self._quota())
        kept = self.config.stateless_files.max_file_mb * MIB
        return wire.RunOptions(**caps, collect_bytes=kept * 4, collect_file_bytes=kept)

    def _check_code(self, code: str) -> None:
        size = len(code.encode("utf-8", "surrogatepass"))
        cap = self.config.limits.max_code_bytes
        if size > cap:
            raise SandboxError(
                f"the code is {size} bytes, over the cap of {cap} bytes; nothing was run. Put large data in a "
                "file (write_file) and read it from the code instead"
            )

    async def run(
        self,
        owner: str,
        code: str,
        *,
        session_id: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the run's deadline inside the sandbox, not ours
        on_output: OutputCallback | None = None,
    ) -> RunResult:
        timeout_s = self._timeout(timeout)
        self._check_code(code)
        if session_id is not None:
            return await self._run_in_session(owner, session_id, code, timeout_s, on_output)
        sandbox = await self.stateless.acquire()
        try:
            raw = await sandbox.execute(code, timeout_s=timeout_s, options=self._stateless_options, on_output=on_output)
        except SandboxLost as exc:
            return RunResult(status="crashed", error=_lost(exc))
        finally:
            self.stateless.release(sandbox)
        run_id = "r_" + secrets.token_urlsafe(9)
        return self._result(raw, files=self._keep_run_files(run_id, owner, raw))

    @asynccontextmanager
    async def _session_in_use(self, owner: str, session_id: str) -> AsyncIterator[Session]:
        """The caller's session, held (one call at a time) and counted busy so it cannot idle out."""
        session = self.sessions.get(session_id, owner)
        session.busy += 1
        try:
            async with session.lock:
                if session.closed:
                    raise SessionNotFound(session_id)
                yield session
        finally:
            session.busy -= 1
            session.touch()

    async def _run_in_session(
        self, owner: str, session_id: str, code: str, timeout_s: float, on_output: OutputCallback | None
    ) -> RunResult:
        async with self._session_in_use(owner, session_id) as session:
            await self._ensure_sandbox(session)
            restarted, session.lost_state = session.lost_state, False  # reported by this run
            assert session.sandbox is not None
            try:
                raw = await session.sandbox.execute(
                    code, timeout_s=timeout_s, options=self._session_options, on_output=on_output
                )
            except SandboxLost as exc:
                if session.closed:
                    return RunResult(status="cancelled", session_id=session_id, error=_closed())
                session.lost_state = True
                return RunResult(status="crashed", session_id=session_id, session_restarted=True, error=_lost(exc))
            files = [self._file_info(session_uri(session_id, f.path), f) for f in raw.files]
            session.known_files.update((info.path, info) for info in files)
            result = self._result(raw, files=files, session_id=session_id)
            result.session_restarted = result.session_restarted or restarted
            return result

    async def _ensure_sandbox(self, session: Session) -> None:
        """A live container for the session; a new one on the same volume if the old one died.

        A replacement means the variables are gone: ``lost_state`` stays set until a run reports it.
        """
        if session.sandbox is None or not session.sandbox.alive:
            if session.sandbox is not None:
                await session.sandbox.destroy()
                session.lost_state = True
            session.sandbox = await self._start("session", session.volume)

    def _result(self, raw: RawRun, *, files: list[FileInfo], session_id: str | None = None) -> RunResult:
        return RunResult(
            status=raw.status,
            stdout=raw.stdout,
            stderr=raw.stderr,
            result=raw.result,
            displays=raw.displays,
            error=raw.error,
            files=files,
            images=raw.images,
            image_count=len(raw.images),
            duration_ms=raw.duration_ms,
            truncated=raw.truncated,
            notes=raw.notes,
            session_id=session_id,
            session_restarted=raw.session_restarted,
        )

    def _keep_run_files(self, run_id: str, owner: str, raw: RawRun) -> list[FileInfo]:
        kept: dict[str, tuple[bytes, float]] = {}
        infos = []
        for entry in raw.files:
            if entry.offset is not None and entry.length is not None:
                kept[entry.path] = (raw.file_bytes[entry.offset : entry.offset + entry.length], entry.modified)
                infos.append(self._file_info(run_uri(run_id, entry.path), entry))
            else:
                infos.append(FileInfo(path=entry.path, size=entry.size, modified=entry.modified, note=entry.note))
        if kept:
            self.run_files.put(run_id, owner, kept)
        return infos

    @staticmethod
    def _file_info(uri: str, entry: wire.FileEntry | wire.Written) -> FileInfo:
        return FileInfo(
            path=entry.path, size=entry.size, modified=entry.modified, uri=uri, mime_type=guess_mime(entry.path)
        )

    # -- sessions ----------------------------------------------------------------------------
    async def new_session(self, owner: str) -> SessionInfo:
        self.sessions.reserve()
        try:
            if self.config.pool.session_spares > 0:
                sandbox = await self.spares.take()
            else:
                sandbox = await self._start("session")
            session = Session(id=self.sessions.new_id(), owner=owner, volume=sandbox.volume, sandbox=sandbox)
            self.sessions.add(session)
        finally:
            self.sessions.unreserve()
        limits = self.config.limits
        return SessionInfo(
            session_id=session.id,
            idle_timeout_s=self.config.sessions.idle_timeout_s,
            max_lifetime_s=self.config.sessions.max_lifetime_s,
            memory_mb=limits.memory_mb,
            cpus=limits.cpus,
            default_timeout_s=limits.default_timeout_s,
            max_timeout_s=limits.max_timeout_s,
            network=self.config.network,
        )

    async def close_session(self, owner: str, session_id: str) -> None:
        await self._close(self.sessions.get(session_id, owner))

    async def _close(self, session: Session) -> None:
        if session.closed:
            return
        session.closed = True
        self.sessions.pop(session.id)
        with anyio.CancelScope(shield=True):
            if session.sandbox is not None:
                await session.sandbox.destroy()  # a run still going ends now, as "cancelled"
            async with session.lock:  # let that run finish reporting before the volume goes
                pass
            if session.volume is not None:
                await self._remove_volume(session.volume)

    # -- files -------------------------------------------------------------------------------
    async def _file_request(
        self, owner: str, session_id: str, request: wire.Request, payload: bytes = b""
    ) -> tuple[wire.Event, bytes]:
        async with self._session_in_use(owner, session_id) as session:
            await self._ensure_sandbox(session)
            assert session.sandbox is not None
            event, data = await session.sandbox.request(request, payload)
        expected = {"list_files": wire.Listing, "read_file": wire.FileData, "write_file": wire.Written}[request.op]
        if not isinstance(event, expected):
            session.sandbox.broken = True
            raise ProtocolViolation(f"the sandbox answered {request.op} with {event.ev!r}; it will be replaced")
        return event, data

    async def list_files(
        self, owner: str, session_id: str, path: str = ".", limit: int = 1000
    ) -> tuple[list[DirEntry], bool]:
        relative = paths.normalize(path, allow_root=True)
        listing, _ = await self._file_request(owner, session_id, wire.ListFiles(path=relative or ".", limit=limit))
        assert isinstance(listing, wire.Listing)
        entries = [
            DirEntry(
                path=e.path,
                size=e.size,
                modified=e.modified,
                is_dir=e.is_dir,
                uri=None if e.is_dir else session_uri(session_id, e.path),
                mime_type=None if e.is_dir else guess_mime(e.path),
                note="symlink (not followed)" if e.is_symlink else None,
            )
            for e in listing.entries[:limit]
        ]
        return entries, listing.truncated

    async def read_file(self, owner: str, session_id: str, path: str) -> FileContent:
        relative = paths.normalize(path)
        cap = self.config.limits.read_max_bytes
        found, data = await self._file_request(owner, session_id, wire.ReadFile(path=relative, max_bytes=cap))
        assert isinstance(found, wire.FileData)
        if len(data) > cap or len(data) != found.size:
            raise ProtocolViolation("the sandbox sent a file over the read cap, or not the size it stated")
        return FileContent(path=found.path, size=found.size, modified=found.modified, data=data)

    async def write_file(self, owner: str, session_id: str, path: str, data: bytes) -> FileInfo:
        relative = paths.normalize(path)
        cap = self.config.limits.write_max_bytes
        if len(data) > cap:
            raise FileOperationError(
                f"content is {len(data)} bytes, over the write cap of {cap} bytes; nothing was written"
            )
        session = self.sessions.get(session_id, owner)
        written, _ = await self._file_request(owner, session_id, self._write_request(relative), data)
        assert isinstance(written, wire.Written)
        info = self._file_info(session_uri(session_id, written.path), written)
        session.known_files[info.path] = info
        return info

    async def session_files(self, owner: str, limit: int = 500) -> list[FileInfo]:
        """The files of every session the owner has, for resources/list.

        A session that is running code is not waited for (a run may take minutes): its files as
        last seen are listed. Deletions that run made show up in the next listing.
        """
        found: list[FileInfo] = []
        for session in self.sessions.owned_by(owner):
            # No checkpoint between this test and the lock's acquisition in _session_in_use.
            if not session.lock.locked():
                try:
                    entries, _ = await self.list_files(owner, session.id, ".", limit=limit)
                except SandboxError:
                    pass  # a session that just closed, or a sandbox that died: what was last seen
                else:
                    session.known_files = {e.path: e for e in entries if not e.is_dir}
            found += session.known_files.values()
        return found

    def read_run_file(self, owner: str, run_id: str, path: str) -> tuple[bytes, float]:
        found = self.run_files.get(run_id, owner, paths.normalize(path))
        if found is None:
            raise FileOperationError(f"no such file in run {run_id}: {path}")
        return found


def _lost(exc: SandboxLost) -> Any:
    from .models import ErrorInfo

    return ErrorInfo(type="SandboxLost", message=f"{exc}; the run's state was lost")


def _closed() -> Any:
    from .models import ErrorInfo

    return ErrorInfo(type="SessionClosed", message="the session was closed while this run was going")


async def check_image(engine: ContainerEngine, image: str) -> None:
    labels = await engine.image_labels(image)
    if labels is None:
        raise ImageMissing(f"the sandbox image {image!r} is not present; build it with `{BUILD_COMMAND}`")
    built_from = labels.get(LABEL_CONTEXT)
    if built_from is not None and built_from != context_hash():
        raise ImageMissing(
            f"the sandbox image {image!r} was built from another version of the agent; "
            f"rebuild it with `{BUILD_COMMAND}`"
        )
