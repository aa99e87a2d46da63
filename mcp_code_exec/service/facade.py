"""The sandbox service: what the MCP layer calls. Knows nothing of MCP or any transport.

``async with SandboxService.start(config) as service:`` connects to the engine, checks the image,
removes what a dead server left, and keeps the warm pools filled until the block exits, when every
run is stopped and every container and volume it made is removed. Runs are ``execution``'s, file
calls ``fileops``'; this facade owns the containers, the sessions and the service's lifetime.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup

from ..broker.approvals import RunApprovals
from ..broker.broker import Broker
from ..config.settings import Config
from ..errors import SandboxError, SessionNotFound
from ..models import DirEntry, FileContent, FileInfo, RunResult, SessionInfo, VariableListing, WrittenFile
from ..observability import metrics
from ..protocol.messages import ToolSpec
from ..runtime.base import LABEL_INSTANCE, LABEL_KIND, LABEL_OWNER, ContainerEngine, ContainerSpec
from ..runtime.cluster import ClusterEngine
from ..sandbox.container import OutputCallback, Sandbox, start_sandbox
from ..sandbox.image import require_current_image
from ..sandbox.ownership import owner_token, sweep, sweep_instance
from ..sandbox.pool import WarmPool
from ..sandbox.records import DEFAULT_SCOPE, RUNNING_HERE, SessionRecords, identity_hash
from ..sandbox.spec import container_spec
from ..sandbox.transfer import Download
from ..sandbox.volumes import SessionVolumes
from . import uris
from .code_mode import CodeMode
from .durable import DurableSessions
from .egress_runs import EgressRuns
from .engines import engine_figures, open_engine
from .execution import Executor
from .files import FileOps
from .notebook import Notebook
from .observed import watch_service
from .packages.installs import Packages
from .run_files import RunFileStore
from .runs import Run
from .sessions import Session, SessionRegistry

log = logging.getLogger(__name__)
MIB = 1024 * 1024
STOP_RUNS_S = 15.0


class SandboxService:
    def __init__(
        self,
        config: Config,
        engine: ContainerEngine,
        task_group: TaskGroup,
        volumes: SessionVolumes,
        records: SessionRecords | None = None,
        identities: Collection[str] | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.sessions = SessionRegistry(config.sessions)
        self.run_files = RunFileStore(
            keep_s=config.stateless_files.keep_s, max_total_bytes=config.stateless_files.max_total_mb * MIB
        )
        self._tg = task_group
        self.records = records or SessionRecords(engine, secrets.token_hex(8))
        self.instance = self.records.instance
        self.volumes = volumes
        self.durable = DurableSessions(config, self.sessions, self.records, volumes)
        self.durable.connect(lambda volume: self._start("session", volume), self._ensure_sandbox, self._labels)
        self.egress = EgressRuns.made(config, engine, self._labels("egress"), self.durable, identities)
        # Over several engines: pools move containers to an engine that came back, and a stateless
        # run lost with its engine runs again elsewhere. With one engine, neither exists.
        self.cluster = engine if isinstance(engine, ClusterEngine) else None
        misplaced = None if self.cluster is None else self._misplaced
        self.stateless, self.spares = self._pools(misplaced)
        self.executor = Executor(
            config,
            pool=self.stateless,
            sessions=self.sessions,
            run_files=self.run_files,
            task_group=task_group,
            ensure_sandbox=self._ensure_sandbox,
            restore=self.durable.restore,
            packages=Packages(config.packages, engine.architecture),
            engine_lost=None if self.cluster is None else self._engine_lost,
            disk_enforced=volumes.enforced,
            code_mode=CodeMode(Broker(config.code_mode, task_group)),
            egress=self.egress,
        )
        self.code_mode = self.executor.code_mode
        self.packages = self.executor.packages
        self.files = FileOps(
            config, sessions=self.sessions, run_files=self.run_files, ensure_sandbox=self._ensure_sandbox
        )
        self.runs = self.executor.runs
        self.notebook = Notebook(self.files, config.sessions.history_max_mb << 20)  # the notebook view's reads
        self.watched = watch_service(self)  # pools, sessions and engines in the metrics, read when scraped

    def _pools(self, misplaced: Callable[[Sandbox], bool] | None) -> tuple[WarmPool, WarmPool]:
        """The warm stateless containers, and the spares new sessions take."""
        pool = self.config.pool
        stateless = WarmPool(
            "stateless",
            lambda: self._start("stateless"),
            size=pool.size,
            max_size=pool.max_size,
            grow_after_s=pool.grow_after_s,
            acquire_timeout_s=pool.acquire_timeout_s,
            max_runs=1 if pool.mode == "single-use" else pool.max_runs_per_container,
            misplaced=misplaced,
        )
        spares = WarmPool(
            "sessions",
            lambda: self._start("session"),
            size=pool.session_spares,
            acquire_timeout_s=pool.start_timeout_s,
            start_after=stateless.ready,  # the first call is most likely a stateless run
            misplaced=misplaced,
        )
        return stateless, spares

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        config: Config,
        engine: ContainerEngine | None = None,
        *,
        identities: Collection[str] | None = None,
        scope: str | None = None,
    ) -> AsyncIterator[SandboxService]:
        """``identities``: the identities that may come back for their sessions (over HTTP, the
        tokens'); a session a stopped server of this scope left for any other is removed. None: any
        may. ``scope``: the servers whose stopped sessions this one serves again (default
        ``sessions.scope``, else "default"; see ``records``)."""
        if engine is None:
            engine = await open_engine(config)
        records = SessionRecords(engine, secrets.token_hex(8), scope or config.sessions.scope or DEFAULT_SCOPE)
        RUNNING_HERE.add(records.instance)
        try:
            await require_current_image(engine, config.image)
            known = None if identities is None else {identity_hash(identity) for identity in identities}
            adoption = await records.adopt(None if known is None else known.__contains__, take=config.sessions.durable)
            await sweep(engine, keep=await records.data_volumes())
            volumes = SessionVolumes(engine, config.limits)
            await volumes.resolve()  # before any volume is made (its check runs with the sweep's)
            async with anyio.create_task_group() as tg:
                service = cls(config, engine, tg, volumes, records, identities)
                service.durable.take_over(adoption.adopted)
                await service.egress.start(tg)  # before any sandbox: they mount its socket's volume
                try:
                    async with service.stateless, service.spares:
                        tg.start_soon(service._reaper)
                        if service.cluster is not None:
                            service.cluster.health.on_change.append(service._rebalance)
                            tg.start_soon(service.cluster.health.watch)
                        try:
                            yield service
                        finally:
                            with anyio.CancelScope(shield=True):
                                await service._stop_runs()
                finally:
                    with anyio.CancelScope(shield=True):
                        kept = await service.durable.stop() if config.sessions.durable else set()
                        await service._close_all_sessions()
                        await service.egress.stop()
                    tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await sweep_instance(engine, service.instance, service.volumes.names, keep=kept)
        finally:
            RUNNING_HERE.discard(records.instance)
            with anyio.CancelScope(shield=True):
                await engine.aclose()

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until the stateless pool holds a warm container (for tests and benchmarks)."""
        with anyio.fail_after(timeout_s):
            sandbox = await self.stateless.acquire(timeout_s)
        self.stateless.release(sandbox)

    # -- several engines ---------------------------------------------------------------------
    def _misplaced(self, sandbox: Sandbox) -> bool:
        return self.cluster is not None and self.cluster.should_move(sandbox.container_id)

    def _rebalance(self) -> None:
        """An engine came (back) in, or went out: warm containers over another engine's share move
        to one under its share (when one went out, nothing is: its containers are lost anyway)."""
        self.stateless.retire_misplaced()
        self.spares.retire_misplaced()

    async def _engine_lost(self, sandbox: Sandbox) -> str | None:
        assert self.cluster is not None
        return await self.cluster.lost_with_engine(sandbox.container_id)

    def engine_figures(self) -> list[dict[str, Any]] | None:
        """Per engine, with several (see ``engines.engine_figures``); None with one."""
        return engine_figures(self.engine, self.sessions.all())

    def _labels(self, kind: str) -> dict[str, str]:
        return {LABEL_OWNER: owner_token(), LABEL_INSTANCE: self.instance, LABEL_KIND: kind}

    def spec(self, kind: Literal["stateless", "session"], volume: str | None = None) -> ContainerSpec:
        """The hardened spec of this service's containers (labelled as its own, so its end-of-service
        sweep covers any started from it: the benchmark's docker run baseline does). A session's
        container runs as the uid that owns its volume's files; any other gets a uid of its own."""
        uid, nocopy = self.volumes.uid_for(volume), self.volumes.nocopy(volume)
        labels, egress = self._labels(kind), self.egress.volume
        return container_spec(self.config, labels, volume, uid=uid, volume_nocopy=nocopy, egress_volume=egress)

    async def _start(self, kind: Literal["stateless", "session"], volume: str | None = None) -> Sandbox:
        created_volume = None
        try:
            if kind == "session" and volume is None:
                volume = created_volume = self.volumes.new_name()
                await self.volumes.create(volume, self._labels("session"))
            return await start_sandbox(
                self.engine, self.spec(kind, volume), self._tg, kind=kind, timeout_s=self.config.pool.start_timeout_s
            )
        except BaseException:
            if created_volume is not None:
                with anyio.CancelScope(shield=True):
                    await self.volumes.remove(created_volume)
            raise

    async def _reaper(self) -> None:
        while True:
            for session in self.sessions.expired():
                log.info("session %s expired", session.id)
                metrics.session_expired()
                await self._close(session)
            for session in self.sessions.to_pause():
                await self.durable.pause(session)
            upcoming = self.sessions.next_expiry()
            delay = 5.0 if upcoming is None else max(0.05, min(5.0, upcoming - time.monotonic()))
            await anyio.sleep(delay)  # a timer, not synchronisation

    async def _stop_runs(self) -> None:
        """Cancel every run still going, and wait (bounded) until each has said how it ended."""
        running = self.runs.running()
        for run in running:
            run.cancel()
        with anyio.move_on_after(STOP_RUNS_S):
            for run in running:
                await run.finished.wait()

    async def _close_all_sessions(self) -> None:
        """Every session not kept for the next server (all of them, when sessions are not durable)."""
        async with anyio.create_task_group() as tg:
            for session in self.sessions.all():
                if session.record is None or not self.config.sessions.durable:
                    tg.start_soon(self._close, session)

    # -- running code ------------------------------------------------------------------------
    async def start_run(
        self,
        owner: str,
        code: str,
        *,
        session_id: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the run's deadline inside the sandbox, not ours
        packages: Sequence[str] = (),
    ) -> Run:
        """Start a run that goes on whatever happens to the caller (see ``execution``); ``packages``
        are installed before its code runs, as its own ``pip install`` lines are (see ``packages``)."""
        return await self.executor.start(owner, code, session_id=session_id, timeout=timeout, packages=packages)

    async def run(
        self,
        owner: str,
        code: str,
        *,
        session_id: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the run's deadline inside the sandbox, not ours
        on_output: OutputCallback | None = None,
        packages: Sequence[str] = (),
    ) -> RunResult:
        """Run code and wait for its result (output to ``on_output`` as it comes); cancelling the
        caller cancels the run."""
        return await self.executor.run_to_end(
            owner, code, session_id=session_id, timeout=timeout, on_output=on_output, packages=packages
        )

    def get_run(self, owner: str, run_id: str) -> Run:
        return self.runs.get(run_id, owner)

    def deliver(self, run: Run) -> RunResult:
        """A finished run's whole result (its images go out once: a later delivery says so)."""
        return self.runs.deliver(run)

    async def settle(self, run: Run) -> None:
        """Cancel a run and wait (bounded) until it reports how it ended."""
        await self.executor.settle(run)

    def running_runs(self, owner: str) -> list[Run]:
        return self.runs.running(owner)

    def on_run_finished(self, hook: Callable[[Run], Awaitable[None]]) -> None:
        """Call ``hook`` when any run ends, whoever waits for it (bounded; its failures are logged)."""
        self.executor.finished_hooks.append(hook)

    def may_see(self, owner: str, uri: str) -> bool:
        """Whether ``owner`` may see the resource ``uri`` (anyone else: "no such resource")."""
        parsed = uris.parse(uri)
        if parsed is None:
            return False
        try:
            if parsed.kind == "session_file":
                self.sessions.get(parsed.id, owner)
            elif parsed.kind == "run_output":
                self.runs.get(parsed.id, owner)
            else:
                self.run_files.files(parsed.id, owner)
        except SandboxError:
            return False
        return True

    # -- code mode (see code_mode) ------------------------------------------------------------
    def tool_approvals(self, run: Run) -> RunApprovals | None:
        """The run's tool calls waiting for a human's approval; None where code mode is off."""
        return self.code_mode.approvals(run)

    async def tool_catalog(self, owner: str) -> list[ToolSpec]:
        """The upstream tools ``owner``'s sandbox code may call (none: empty), for the tools' descriptions."""
        return await self.code_mode.catalog(owner)

    def figures(self) -> dict[str, Any]:
        """Warm containers, whether the pool has warmed at all yet, and open sessions, for /healthz."""
        return {"idle": self.stateless.idle, "warm": self.stateless.ready.is_set(), "sessions": len(self.sessions)}

    def holds_work(self) -> bool:
        """Whether anything here would be lost if this process went: a live session (one with a
        container) or a run in flight. Paused sessions are on disk, and the next start adopts them
        (durable sessions); without durable sessions every open session counts."""
        sessions = self.sessions.live() if self.config.sessions.durable else self.sessions.all()
        return bool(sessions) or bool(self.runs.running())

    async def _ensure_sandbox(self, session: Session) -> Sandbox:
        """A live container for the session; a new one on the same volume if the old one died.

        A replacement means the variables are gone: ``lost_state`` stays set until a run reports it.
        """
        if session.sandbox is None or not session.sandbox.alive:
            if session.sandbox is not None:
                await session.sandbox.destroy()
                session.mark_lost()
                metrics.session_restarted()
                sandbox = await self._start("session", session.volume)
            else:  # paused: resumed within the caps on live sessions
                sandbox = await self.durable.resume(session)
            if session.closed:  # closed while its new container started: that must not outlive it
                await sandbox.destroy()
                raise SessionNotFound(session.id)
            session.replace_sandbox(sandbox)
            return sandbox
        return session.sandbox

    # -- sessions ----------------------------------------------------------------------------
    async def new_session(self, owner: str, egress: Sequence[str] | None = None) -> SessionInfo:
        """``egress``: the hosts the session may reach, of those its owner may (None: all of them)."""
        self.sessions.reserve(owner)
        try:
            if self.config.pool.session_spares > 0:
                sandbox = await self.spares.take()
            else:
                sandbox = await self._start("session")
            session = Session(id=self.sessions.new_id(), owner=owner, volume=sandbox.volume, sandbox=sandbox)
            try:
                self.egress.at_start(session, egress)
                await self.durable.record(session)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await sandbox.destroy(with_volume=True)
                raise
            self.sessions.add(session)
            metrics.session_created()
        finally:
            self.sessions.unreserve(owner)
        limits = self.config.limits
        return SessionInfo(
            session_id=session.id,
            idle_timeout_s=self.config.sessions.idle_timeout_s,
            max_lifetime_s=self.config.sessions.max_lifetime_s,
            memory_mb=limits.memory_mb,
            cpus=limits.cpus,
            default_timeout_s=limits.default_timeout_s,
            max_run_s=limits.max_run_s,
            network=self.config.network,
            egress=self.egress.shown(session),
        )

    async def close_session(self, owner: str, session_id: str) -> None:
        await self._close(self.sessions.get(session_id, owner))

    async def _close(self, session: Session) -> None:
        if not session.close():
            return
        metrics.session_closed()
        self.sessions.pop(session.id)
        self.egress.closed(session)
        with anyio.CancelScope(shield=True):
            await self.durable.forget(session)
            if session.sandbox is not None:
                await session.sandbox.destroy()  # a run still going ends now, as "cancelled"
            # (one that starts a new container meanwhile removes it itself: see ``_ensure_sandbox``)
            with anyio.move_on_after(STOP_RUNS_S):
                async with session.lock:  # let that run finish reporting before the volume goes
                    pass
            if session.volume is not None:
                await self.volumes.remove(session.volume)

    async def fork_session(self, owner: str, session_id: str, count: int = 1) -> list[str]:
        """New sessions of ``owner``, each starting from the session as it is (files, snapshot)."""
        source = self.sessions.get(session_id, owner)
        return await self.durable.fork(source, owner, count, self.config.files.busy_wait_s)

    async def restrict_egress(self, owner: str, session_id: str, allow: Sequence[str]) -> list[str]:
        """Narrow a session's egress to ``allow`` (its entries; [] cuts it off); returns what it reaches."""
        return await self.egress.restrict(self.sessions.get(session_id, owner), allow)

    async def list_variables(self, owner: str, session_id: str) -> VariableListing:
        """The session namespace's variables (its last snapshot restored first, in a new container)."""
        return await self.durable.list_variables(self.sessions.get(session_id, owner), self.config.files.busy_wait_s)

    async def export_notebook(self, owner: str, session_id: str, path: str = "session.ipynb") -> WrittenFile:
        """The session's history as a notebook in its /mnt/data (written in the sandbox)."""
        session = self.sessions.get(session_id, owner)
        return await self.durable.export_notebook(session, path, self.config.files.busy_wait_s)

    # -- files (see fileops) -------------------------------------------------------------------------
    async def list_files(
        self, owner: str, session_id: str, path: str = ".", limit: int = 1000
    ) -> tuple[list[DirEntry], bool]:
        return await self.files.list_files(owner, session_id, path, limit)

    async def read_file(self, owner: str, session_id: str, path: str) -> FileContent:
        return await self.files.read_file(owner, session_id, path)

    async def write_file(self, owner: str, session_id: str, path: str, data: bytes) -> FileInfo:
        return await self.files.write_file(owner, session_id, path, data)

    async def stat_file(self, owner: str, session_id: str, path: str) -> FileInfo:
        """A readable regular file's path, size and mtime (nothing of it is read)."""
        return await self.files.stat_file(owner, session_id, path)

    def check_session(self, owner: str, session_id: str) -> None:
        """``SessionNotFound`` unless ``session_id`` is the owner's open session."""
        self.sessions.get(session_id, owner)

    async def session_files(self, owner: str) -> list[FileInfo]:
        """The files of every session the owner has (busy ones as last seen), for resources/list."""
        return await self.files.session_files(owner)

    def list_run_files(self, owner: str, run_id: str) -> list[DirEntry]:
        return self.files.list_run_files(owner, run_id)

    def read_run_file(self, owner: str, run_id: str, path: str) -> FileContent:
        return self.files.read_run_file(owner, run_id, path)

    def run_file_listing(self, owner: str) -> list[tuple[str, str, int]]:
        """(run id, path, size) of every file kept from the owner's stateless runs."""
        return self.run_files.listing(owner)

    def read_stream(
        self, owner: str, session_id: str, path: str, *, max_bytes: int | None = None, busy_wait_s: float | None = None
    ) -> AbstractAsyncContextManager[Download]:
        """``async with service.read_stream(...) as found:`` ``found.size``, then ``found.chunks()``.
        ``busy_wait_s``: how long to wait for a session another call holds (None: as long as it takes)."""
        return self.files.read_stream(owner, session_id, path, max_bytes=max_bytes, busy_wait_s=busy_wait_s)

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
        """Write a file of any size from ``source`` (atomically; the session's quota applies)."""
        return await self.files.write_stream(
            owner, session_id, path, source, max_bytes=max_bytes, expected_size=expected_size, busy_wait_s=busy_wait_s
        )
