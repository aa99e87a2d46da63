"""Running code: admission (limits, a container), then the run in the service's task group.

``start`` returns as soon as the run has what it needs (a warm container, or its session): a
full pool or a busy session is the caller's error, at once. The run itself then goes on in the
background, whatever happens to the call that started it, until it ends, times out, or is
cancelled; its result waits in the registry (``run_registry.py``) for whoever asks.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup

from ..config.accounting import AuditSettings, QuotaSettings
from ..config.sections import Limits, PoolSettings, RunSettings, SessionSettings
from ..errors import EngineDown, SandboxError, SandboxLost
from ..models import ErrorInfo, FileInfo, RunResult
from ..observability import metrics
from ..observability.logs import logged_id
from ..observability.tracing import traced
from ..sandbox.container import Sandbox
from ..sandbox.run_events import RawRun
from ..sandbox.spec import install, run_options
from .accounting import Accounting, code_digest
from .code_mode import CodeMode
from .containers import ContainerFactory
from .egress_runs import EgressRuns
from .keeper import SessionKeeper
from .outcomes import Said, cancelled, closed, container_lost_error, failed, file_info, shown_files, small_text
from .packages.installs import Packages
from .run_files import RunFileStore
from .run_registry import ClientSlots, Run, RunRegistry, RunWatcher, new_run_id
from .session_contents import SessionContents
from .sessions import Session, SessionRegistry
from .uris import run_file_uri, session_file_uri

log = logging.getLogger(__name__)
CANCEL_WAIT_S = 10.0  # how long a cancelled run may take to report how it ended
STOP_RUNS_S = 15.0  # how long the runs still going at the service's end may take to report
CODE_KEPT = 20_000  # characters of a run's code kept with it, for the notebook view
OutputCallback = Callable[[str, str], Awaitable[None]]  # a caller following a run (``run_to_end``)
ENGINE_RETRIES = 2  # a stateless run lost with its engine runs again elsewhere, this many times at most
MOVED_NOTE = "the engine this ran on stopped answering; it ran again from the start on another"


@dataclass
class Lease:
    """The container a stateless run holds, and the agent's account of the run in it."""

    sandbox: Sandbox | None
    raw: RawRun = field(default_factory=RawRun)
    moved_from: list[str] = field(default_factory=list)  # engines it was lost with


class Executor:
    def __init__(
        self,
        limits: Limits,
        pool_settings: PoolSettings,
        run_settings: RunSettings,
        session_settings: SessionSettings,
        *,
        containers: ContainerFactory,
        keeper: SessionKeeper,
        contents: SessionContents,
        sessions: SessionRegistry,
        run_files: RunFileStore,
        task_group: TaskGroup,
        packages: Packages,
        code_mode: CodeMode | None = None,
        accounting: Accounting | None = None,
        egress: EgressRuns | None = None,
    ) -> None:
        self.limits = limits
        self.packages = packages
        self.containers = containers
        self.stateless_pool = containers.stateless_pool
        self.keeper = keeper
        self.contents = contents
        self.sessions = sessions
        self.run_files = run_files
        self.run_registry = RunRegistry.kept_as(run_settings)
        self.slots = ClientSlots(pool_settings.max_runs_per_client, pool_settings.acquire_timeout_s)
        self.watchers: weakref.WeakSet[RunWatcher] = weakref.WeakSet()  # see ``watch``
        self._tg = task_group
        self.code_mode = code_mode or CodeMode(None)
        self.accounting = accounting or Accounting(QuotaSettings(), AuditSettings())
        self.egress = egress or EgressRuns(None)
        self.stateless_options = run_options(limits, session_settings, run_settings, "stateless")
        self.session_options = run_options(limits, session_settings, run_settings, "session")
        if containers.volumes.enforced:  # every session volume is a filesystem of the quota's size
            self.session_options = self.session_options.model_copy(update={"disk_enforced": True})

    # -- admission --------------------------------------------------------------------------------
    def timeout(self, timeout: float | None) -> float:
        limits = self.limits
        if timeout is None:
            return limits.default_timeout_s
        # Every path checks it here, whatever checked it before (the Tasks path has no tool schema).
        number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
        if not number or not math.isfinite(timeout) or timeout <= 0:
            raise SandboxError("timeout must be a positive, finite number of seconds")
        return min(float(timeout), limits.max_run_s)

    def check_code(self, code: str) -> None:
        size = len(code.encode("utf-8", "surrogatepass"))
        cap = self.limits.max_code_bytes
        if size > cap:
            metrics.rejected("code_too_large")
            raise SandboxError(
                f"the code is {size} bytes, over the cap of {cap} bytes; nothing was run. Put large data in a "
                "file (write_file) and read it from the code instead"
            )

    @traced("mcpx.admission")
    async def start(
        self,
        owner: str,
        code: str,
        *,
        session_id: str | None,
        timeout: float | None,  # noqa: ASYNC109 - the run's deadline inside the sandbox, not ours
        packages: Sequence[str] = (),
    ) -> Run:
        """Admit a run and start it; the caller's errors (limits, busy, no container) come from here.
        ``packages`` are installed before the code runs (as its pip lines are, see ``packages``)."""
        timeout_s = self.timeout(timeout)
        self.check_code(code)
        budget = self.code_mode.new_budget()  # made with the run: the MCP layer reads its approvals
        # The cell kept (capped) with its digest and size (code_sha256, code_bytes: the audit log's).
        run = Run(new_run_id(), owner, session_id, timeout_s, code[:CODE_KEPT], *code_digest(code), tool_budget=budget)
        session = self.sessions.get(session_id, owner) if session_id is not None else None
        async with self.accounting.admitted(owner):  # quotas and the audit log; taken back if it fails here
            if session is not None:
                await session.claim_for(run)  # the next caller sees it busy
                self.run_registry.add(run)
                self._tg.start_soon(self._run_session, run, session, code, tuple(packages))
                return run
            await self.slots.acquire(owner)
            try:
                sandbox = await self.stateless_pool.acquire()
            except BaseException:
                self.slots.release(owner)
                raise
        self.run_registry.add(run)
        self._tg.start_soon(self._run_stateless, run, sandbox, code, tuple(packages))
        return run

    # -- the runs themselves ------------------------------------------------------------------------
    async def _run_stateless(self, run: Run, sandbox: Sandbox, code: str, packages: tuple[str, ...]) -> None:
        lease = Lease(sandbox)
        result: RunResult | None = None
        refused: ErrorInfo | None = None
        before: float | None = None  # where its owner has a CPU quota, the host's count of the container
        try:
            before = await self.accounting.container_cpu(run.owner, sandbox)
            with run.cancel_scope:
                refused = await self._stateless_cell(run, lease, code, packages)
            raw = lease.raw
            if run.cancel_scope.cancelled_caught:
                raw.result.status = "cancelled"
            if refused is not None:
                result = RunResult(status="error", error=refused)
            else:
                files = self._keep_run_files(run, raw)
                shown, omitted = shown_files(files)
                result = self._result(raw, files=list(shown))
                result.files_omitted = omitted
                result.notes += [f"{MOVED_NOTE} ({name})" for name in lease.moved_from]
        except SandboxLost as exc:
            result = RunResult(status="crashed", error=container_lost_error(exc))
        except Exception as exc:  # noqa: BLE001 - a run ends as a result; nothing may reach the task group
            result = RunResult(status="crashed", error=failed(exc))
        finally:
            moved = lease.sandbox is not sandbox  # run again elsewhere: the host's count is of another
            host_s = None if moved else await self.accounting.container_cpu_since(before, run.owner, sandbox)
            if lease.sandbox is not None:
                self.stateless_pool.release(lease.sandbox)
            self.slots.release(run.owner)
            notes = self.egress.stateless_ended(run)  # its grant ends now (its connections are cut)
            if result is not None:
                result.notes += notes
            await self._finish(run, result or RunResult(status="cancelled", error=cancelled()), host_s=host_s)

    async def _stateless_cell(self, run: Run, lease: Lease, code: str, packages: tuple[str, ...]) -> ErrorInfo | None:
        """Install, then run. Over several engines, a run whose container was lost with its engine
        (not by what the code did) runs again from the start in another container, elsewhere."""
        while True:
            sandbox = lease.sandbox
            assert sandbox is not None
            try:
                refused = await self.packages.prepare(sandbox, run, code, packages)
                if refused is None:
                    options, tools = await self.code_mode.prepare(run, install(self.stateless_options, packages))
                    options = self.egress.stateless(run, options, sandbox)
                    await sandbox.execute(
                        code,
                        timeout_s=run.timeout_s,
                        options=options,
                        output=run.output,
                        raw=lease.raw,
                        tools=tools,
                    )
                return refused
            except SandboxLost:
                gone = None
                if len(lease.moved_from) < ENGINE_RETRIES:
                    gone = await self.containers.engine_lost(sandbox)
                if gone is None:
                    raise
            log.warning(
                "run %s: engine %s stopped answering under it; running it again elsewhere", logged_id(run.id), gone
            )
            lease.moved_from.append(gone)
            lease.sandbox = None
            self.stateless_pool.release(sandbox)
            lease.sandbox = await self.stateless_pool.acquire()
            lease.raw = RawRun()

    async def _run_session(self, run: Run, session: Session, code: str, packages: tuple[str, ...]) -> None:
        raw, said = RawRun(), Said()
        result: RunResult | None = None
        try:
            async with session.lock:
                if session.closed:
                    result = RunResult(status="cancelled", session_id=session.id, error=closed())
                    return
                with run.cancel_scope:
                    result = await self._session_cell(run, session, code, raw, packages, said)
                if run.cancel_scope.cancelled_caught:  # the agent's account after the interrupt, if any
                    raw.result.status = "cancelled"
                    result = said.told(self._session_result(session, raw))
        except Exception as exc:  # noqa: BLE001 - a run ends as a result; nothing may reach the task group
            result = said.told(RunResult(status="crashed", session_id=session.id, error=failed(exc)))
        finally:
            session.release(run)
            ended = result or RunResult(status="cancelled", session_id=session.id, error=cancelled())
            await self._finish(run, ended, session)

    async def _session_cell(
        self, run: Run, session: Session, code: str, raw: RawRun, packages: tuple[str, ...], said: Said
    ) -> RunResult:
        sandbox = await self.keeper.ensure(session)
        said.variables_gone = session.take_variables_gone()  # its container, since a run last said so: this one says it
        said.restore = await self.contents.restore(session, sandbox)
        said.notes = session.take_notes()
        options = self.session_options
        quota = {"quota_bytes": options.data_quota_bytes, "quota_files": options.data_quota_files}
        refused = await self.packages.prepare(sandbox, run, code, packages, **quota)
        if refused is not None:
            return said.told(RunResult(status="error", session_id=session.id, error=refused))
        options, tools = await self.code_mode.prepare(run, install(options, packages))
        options = self.egress.session(session, options, sandbox)
        try:
            await sandbox.execute(
                code, timeout_s=run.timeout_s, options=options, output=run.output, raw=raw, tools=tools
            )
        except SandboxLost as exc:
            if session.closed:
                return RunResult(status="cancelled", session_id=session.id, error=closed())
            session.mark_variables_gone()
            gone = await self.containers.engine_lost(sandbox)
            error = container_lost_error(exc) if gone is None else failed(EngineDown(gone))
            return said.told(RunResult(status="crashed", session_id=session.id, session_restarted=True, error=error))
        result = self._session_result(session, raw)
        result.notes += self.egress.session_notes(session)
        return said.told(result)

    def _session_result(self, session: Session, raw: RawRun) -> RunResult:
        shown, omitted = shown_files(raw.files)
        files = [file_info(session_file_uri(session.id, f.path), f) for f in shown]
        session.remember(files)
        result = self._result(raw, files=files, session_id=session.id)
        result.files_omitted = omitted
        return result

    async def _finish(
        self, run: Run, result: RunResult, session: Session | None = None, host_s: float | None = None
    ) -> None:
        with anyio.CancelScope(shield=True):
            if run.cancelled and result.status not in ("cancelled",):
                result.status = "cancelled"
            run.stop_clock()  # its usage counts its time up to here
            result.usage = await self.accounting.run_ended(run, result, session, host_s)
            run.finish(result)
            for watcher in list(self.watchers):
                try:
                    with anyio.fail_after(5):
                        await watcher.run_finished(run)
                except Exception:
                    log.warning("a run watcher failed", exc_info=True)

    def watch(self, watcher: RunWatcher) -> None:
        """Tell ``watcher`` of every run that ends from now on, for as long as it lives."""
        self.watchers.add(watcher)

    # -- waiting --------------------------------------------------------------------------------------
    async def cancel_and_wait(self, run: Run) -> None:
        """Cancel a run and wait (bounded) until it reports how it ended."""
        run.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_WAIT_S):
            await run.finished.wait()

    async def stop_all(self) -> None:
        """Cancel every run still going, and wait (bounded) until each has said how it ended."""
        running = self.run_registry.running()
        for run in running:
            run.cancel()
        with anyio.move_on_after(STOP_RUNS_S):
            for run in running:
                await run.finished.wait()

    async def run_to_end(
        self,
        owner: str,
        code: str,
        *,
        session_id: str | None,
        timeout: float | None,  # noqa: ASYNC109 - the run's deadline inside the sandbox, not ours
        on_output: OutputCallback | None = None,
        packages: Sequence[str] = (),
    ) -> RunResult:
        """Start a run and wait for its result; cancelling the caller cancels the run. ``on_output``
        gets output streamed while the run goes (a run of under a tenth of a second streams none);
        the result holds all of it."""
        run = await self.start(owner, code, session_id=session_id, timeout=timeout, packages=packages)
        try:
            if on_output is None:
                await run.finished.wait()
            else:
                async with aclosing(run.output.follow()) as batches:
                    async for batch in batches:
                        for stream, text in batch:
                            await on_output(stream, text)
        except anyio.get_cancelled_exc_class():
            await self.cancel_and_wait(run)
            raise
        return self.run_registry.deliver(run)

    # -- results --------------------------------------------------------------------------------------
    def _result(self, raw: RawRun, *, files: list[FileInfo], session_id: str | None = None) -> RunResult:
        return raw.result.model_copy(update={"files": files, "session_id": session_id})

    def _keep_run_files(self, run: Run, raw: RawRun) -> list[FileInfo]:
        kept: dict[str, tuple[bytes, float]] = {}
        infos = []
        for entry in raw.files:
            if entry.offset is not None and entry.length is not None:
                data = raw.file_bytes[entry.offset : entry.offset + entry.length]
                kept[entry.path] = (data, entry.modified)
                info = file_info(run_file_uri(run.id, entry.path), entry)
                info.text = small_text(data, info.mime_type or "text/plain")
                infos.append(info)
            else:
                infos.append(FileInfo(path=entry.path, size=entry.size, modified=entry.modified, note=entry.note))
        if kept:
            self.run_files.put(run.id, run.owner, kept)
        return infos


__all__ = ["Executor"]
