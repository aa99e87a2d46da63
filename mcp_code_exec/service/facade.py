"""The sandbox service: what the MCP layer calls. Knows nothing of MCP or any transport.

``async with SandboxService.start(config) as service:`` connects to the engine, checks the image,
removes what a dead server left, and keeps the warm pools filled until the block exits, when every
run is stopped and every container and volume it made is removed.

The facade composes the service's parts and is the door into them: the container factory
(``containers``), the session keeper (``keeper``: each session's container over its life), what a
session holds (``session_contents``: restore, fork, its variables and history), runs (``execution``)
and file calls (``files``). Each takes the parts below it and the sections of the configuration it
reads in its constructor (the ``Config`` is split here), and none calls back up. Egress
(``egress_runs``: the proxy, a run's grant, a session's reach) sits below them all.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ..broker.approvals import RunApprovals
from ..broker.broker import Broker
from ..config.settings import Config
from ..errors import SandboxError
from ..models import DirEntry, FileContent, FileInfo, RunResult, SessionInfo, UsageReport, VariableListing, WrittenFile
from ..protocol.messages import ToolSpec
from ..runtime.base import ContainerEngine, ContainerSpec
from ..sandbox.image import require_current_image
from ..sandbox.ownership import sweep, sweep_instance
from ..sandbox.pool import WarmPool
from ..sandbox.records import DEFAULT_SCOPE, RUNNING_HERE, SessionRecords, known_to
from ..sandbox.spec import Kind
from ..sandbox.transfer import Download
from ..sandbox.volumes import Enforcement, SessionVolumes
from . import uris
from .accounting import Accounting
from .code_mode import CodeMode
from .containers import ContainerFactory, service_labels
from .egress_runs import EgressRuns
from .engines import engine_figures, open_engine
from .execution import Executor, OutputCallback
from .files import FileOps
from .keeper import SessionKeeper
from .notebook import Notebook
from .observed import watch_service
from .packages.installs import Packages
from .run_files import RunFileStore
from .run_registry import Run, RunWatcher
from .session_contents import SessionContents
from .sessions import SessionRegistry


class SandboxService:
    def __init__(
        self,
        config: Config,
        engine: ContainerEngine,
        task_group: TaskGroup,
        volumes: SessionVolumes,
        records: SessionRecords | None = None,
        clock: Callable[[], float] = time.time,
        identities: Collection[str] | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        limits, settings, run_settings, sandbox = config.limits, config.sessions, config.runs, config.sandbox
        self.sessions = SessionRegistry(settings, limits.session_data_bytes, config.quotas)
        self.run_files = RunFileStore.kept_as(run_settings)
        self.records = records or SessionRecords(engine, secrets.token_hex(8))
        self.instance = self.records.instance
        self.accounting = Accounting.on_engine(config.quotas, config.audit, self.records, clock, limits.cpus)
        self.volumes = volumes
        labels, pool = service_labels(self.instance, "egress"), config.pool
        most = pool.max_size + pool.session_spares + settings.max_sessions  # sandboxes running at once
        self.egress = EgressRuns.made(
            config.egress, config.runtime, settings.max_lifetime_s, engine, labels, identities, most
        )
        self.accounting.meters += self.egress.meters()  # the runs' egress_bytes
        self.containers = ContainerFactory(
            sandbox, config.pool, engine, volumes, task_group, self.instance, self.egress.volume
        )
        self.keeper = SessionKeeper(
            settings, sandbox, self.sessions, self.records, self.containers, self.egress, self.accounting
        )
        self.contents = SessionContents(limits, settings, self.sessions, self.keeper, self.containers)
        self.executor = Executor(
            limits,
            config.pool,
            run_settings,
            settings,
            containers=self.containers,
            keeper=self.keeper,
            contents=self.contents,
            sessions=self.sessions,
            run_files=self.run_files,
            task_group=task_group,
            packages=Packages(config.packages, engine.architecture, admit=self.accounting.admit_installs),
            code_mode=CodeMode(Broker(config.code_mode, task_group)),
            accounting=self.accounting,
            egress=self.egress,
        )
        self.code_mode = self.executor.code_mode
        self.packages = self.executor.packages
        self.files = FileOps(limits, sessions=self.sessions, run_files=self.run_files, keeper=self.keeper)
        self.run_registry = self.executor.run_registry
        self.notebook = Notebook(self.files, settings.history_max_bytes)  # the notebook view's reads
        self.watched = watch_service(self.containers, self.sessions)  # pools, sessions, engines: read when scraped

    @property
    def stateless_pool(self) -> WarmPool:
        """The warm containers stateless runs take."""
        return self.containers.stateless_pool

    @property
    def session_spares(self) -> WarmPool:
        """The warm containers, each on a new volume, that new sessions take."""
        return self.containers.session_spares

    def disk_enforcement(self) -> Enforcement:
        """Who enforces a session's disk quota (decided at start, see ``sandbox/volumes.py``)."""
        return self.volumes.enforcement

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        config: Config,
        engine: ContainerEngine | None = None,
        *,
        identities: Collection[str] | None = None,
        realms: Collection[str] = (),
        scope: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> AsyncIterator[SandboxService]:
        """``identities``: the identities that may come back for their sessions (over HTTP, the
        tokens'), and ``realms`` the hashed realms all of whose identities may (``records.realm_hash``:
        OAuth's); a session a stopped server of this scope left for any other is removed. None: any
        may. ``scope``: the servers whose stopped sessions this one serves again (default
        ``sessions.scope``, else "default"; see ``records``). ``clock``: quotas' wall clock (tests')."""
        if engine is None:
            engine = await open_engine(config.cluster, config.docker_host, config.engine_wait_s, config.image)
        records = SessionRecords(engine, secrets.token_hex(8), scope or config.sessions.scope or DEFAULT_SCOPE)
        RUNNING_HERE.add(records.instance)
        try:
            await require_current_image(engine, config.image)
            known = None if identities is None else known_to(identities, realms)
            adoption = await records.adopt(known, take=config.sessions.durable)
            await sweep(engine, keep=await records.data_volumes())
            await Accounting.sweep(config.quotas, records, clock())
            volumes = SessionVolumes(engine, config.limits)
            await volumes.resolve()  # before any volume is made (its check runs with the sweep's)
            kept: set[str] | None = None  # known once the sessions have stopped: the sweep spares them
            try:
                async with anyio.create_task_group() as tg:
                    service = cls(config, engine, tg, volumes, records, clock, identities)
                    service.keeper.take_over(adoption.adopted)
                    await service.accounting.start(tg, service.sessions.live)
                    await service.egress.start(tg)  # before any sandbox: they mount its socket's volume
                    try:
                        async with service.containers.warm():
                            tg.start_soon(service.keeper.reap)
                            tg.start_soon(service.keeper.stop_burning)
                            try:
                                yield service
                            finally:
                                with anyio.CancelScope(shield=True):
                                    await service.executor.stop_all()
                    finally:
                        with anyio.CancelScope(shield=True):
                            kept = await service.keeper.stop()
                            await service.egress.stop()
                            await service.accounting.stop()
                        tg.cancel_scope.cancel()
            finally:  # also when left by a cancellation (the local service's SIGTERM)
                if kept is not None:
                    with anyio.CancelScope(shield=True):
                        await sweep_instance(engine, records.instance, volumes.names, keep=kept)
        finally:
            RUNNING_HERE.discard(records.instance)
            with anyio.CancelScope(shield=True):
                await engine.aclose()

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until the stateless pool holds a warm container (for tests and benchmarks)."""
        with anyio.fail_after(timeout_s):
            sandbox = await self.stateless_pool.acquire(timeout_s)
        self.stateless_pool.release(sandbox)

    def engine_figures(self) -> list[dict[str, Any]] | None:
        """Per engine, with several (see ``engines.engine_figures``); None with one."""
        return engine_figures(self.engine, self.sessions.all())

    def spec(self, kind: Kind, volume: str | None = None) -> ContainerSpec:
        """The hardened spec of this service's containers (see ``containers``)."""
        return self.containers.spec(kind, volume)

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
        return self.run_registry.get(run_id, owner)

    def deliver(self, run: Run) -> RunResult:
        """A finished run's whole result (its images go out once: a later delivery says so)."""
        return self.run_registry.deliver(run)

    async def cancel_and_wait(self, run: Run) -> None:
        """Cancel a run and wait (bounded) until it reports how it ended."""
        await self.executor.cancel_and_wait(run)

    def running_runs(self, owner: str) -> list[Run]:
        return self.run_registry.running(owner)

    def watch_runs(self, watcher: RunWatcher) -> None:
        """Tell ``watcher`` of every run that ends, whoever waits for it, for as long as it lives."""
        self.executor.watch(watcher)

    def may_see(self, owner: str, uri: str) -> bool:
        """Whether ``owner`` may see the resource ``uri`` (anyone else: "no such resource")."""
        parsed = uris.parse(uri)
        if parsed is None:
            return False
        try:
            if parsed.kind == "session_file":
                self.sessions.get(parsed.id, owner)
            elif parsed.kind == "run_output":
                self.run_registry.get(parsed.id, owner)
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
        """Warm containers, whether the pool has warmed yet, open sessions, the audit log's state: /healthz."""
        pool = self.stateless_pool
        found = {"idle": pool.idle, "warm": pool.ready.is_set(), "sessions": len(self.sessions)}
        return {**found, **self.accounting.health()}

    async def usage(self, owner: str, session_id: str | None = None) -> UsageReport:
        """The owner's quotas (what is used of each, and when it frees) and a session's totals."""
        return await self.accounting.report(owner, None if session_id is None else self.sessions.get(session_id, owner))

    def holds_work(self) -> bool:
        """Whether anything here would be lost if this process went: a run in flight, or, without
        durable sessions, an open session. A durable session is not: the stop pauses a live one as
        ``pause_after_s`` would (its snapshot finished, its container given back), and the next
        start adopts it with the paused ones."""
        return bool(self.run_registry.running()) or (not self.config.sessions.durable and bool(self.sessions.all()))

    # -- sessions ----------------------------------------------------------------------------
    async def new_session(self, owner: str, egress: Sequence[str] | None = None) -> SessionInfo:
        """``egress``: the hosts the session may reach, of those its owner may (None: all of them)."""
        return await self.keeper.new(owner, egress)

    async def close_session(self, owner: str, session_id: str) -> None:
        await self.keeper.close(self.sessions.get(session_id, owner))

    async def reach_text(self, owner: str) -> str:
        """What run_python's description says of the hosts ``owner``'s code may reach ("" without egress)."""
        return self.egress.describe(owner)

    async def restrict_egress(self, owner: str, session_id: str, allow: Sequence[str]) -> SessionInfo:
        """Narrow a session's egress to ``allow`` (its entries; [] cuts it off); its info says what it reaches."""
        return await self.keeper.restrict_egress(self.sessions.get(session_id, owner), allow)

    async def fork_session(self, owner: str, session_id: str, count: int = 1) -> list[str]:
        """New sessions of ``owner``, each starting from the session as it is (files, snapshot)."""
        source = self.sessions.get(session_id, owner)
        return await self.contents.fork(source, owner, count, self.config.files.busy_wait_s)

    async def list_variables(self, owner: str, session_id: str) -> VariableListing:
        """The session namespace's variables (its last snapshot restored first, in a new container)."""
        session = self.sessions.get(session_id, owner)
        return await self.contents.list_variables(session, self.config.files.busy_wait_s)

    async def export_notebook(self, owner: str, session_id: str, path: str = "session.ipynb") -> WrittenFile:
        """The session's history as a notebook in its /mnt/data (written in the sandbox)."""
        session = self.sessions.get(session_id, owner)
        return await self.contents.export_notebook(session, path, self.config.files.busy_wait_s)

    # -- files (see files) ---------------------------------------------------------------------------
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
