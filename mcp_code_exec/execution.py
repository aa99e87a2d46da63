"""Running code: admission (limits, a container), then the run in the service's task group.

``start`` returns as soon as the run has what it needs (a warm container, or its session): a
full pool or a busy session is the caller's error, at once. The run itself then goes on in the
background, whatever happens to the call that started it, until it ends, times out, or is
cancelled; its result waits in the registry (``runs.py``) for whoever asks.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import anyio
from anyio.abc import TaskGroup

from .config import Config
from .errors import SandboxError, SandboxLost
from .models import ErrorInfo, FileInfo, RunResult
from .packages import Packages
from .pool import WarmPool
from .protocol import messages as wire
from .runs import ClientSlots, Run, RunRegistry, new_run_id
from .sandbox import OutputCallback, RawRun, Sandbox
from .sessions import Session, SessionRegistry
from .store import RunFileStore
from .uris import guess_mime, run_file_uri, session_file_uri

log = logging.getLogger(__name__)
MIB = 1024 * 1024
SETTLE_S = 10.0  # how long a cancelled run may take to report how it ended
FinishedHook = Callable[[Run], Awaitable[None]]
EnsureSandbox = Callable[[Session], Awaitable[Sandbox]]


class Executor:
    def __init__(
        self,
        config: Config,
        *,
        pool: WarmPool,
        sessions: SessionRegistry,
        run_files: RunFileStore,
        task_group: TaskGroup,
        ensure_sandbox: EnsureSandbox,
        packages: Packages,
    ) -> None:
        self.config = config
        self.packages = packages
        self.pool = pool
        self.sessions = sessions
        self.run_files = run_files
        runs = config.runs
        self.runs = RunRegistry(
            keep_s=runs.keep_s, max_kept_bytes=runs.max_kept_mb << 20, max_per_owner=runs.max_kept_per_client
        )
        self.slots = ClientSlots(config.pool.max_runs_per_client, config.pool.acquire_timeout_s)
        self.finished_hooks: list[FinishedHook] = []
        self._tg = task_group
        self._ensure_sandbox = ensure_sandbox
        self.stateless_options = run_options(config, stateless=True)
        self.session_options = run_options(config, stateless=False)

    # -- admission --------------------------------------------------------------------------------
    def timeout(self, timeout: float | None) -> float:
        limits = self.config.limits
        if timeout is None:
            return limits.default_timeout_s
        if timeout <= 0:
            raise SandboxError("timeout must be a positive number of seconds")
        return min(float(timeout), limits.max_run_s)

    def check_code(self, code: str) -> None:
        size = len(code.encode("utf-8", "surrogatepass"))
        cap = self.config.limits.max_code_bytes
        if size > cap:
            raise SandboxError(
                f"the code is {size} bytes, over the cap of {cap} bytes; nothing was run. Put large data in a "
                "file (write_file) and read it from the code instead"
            )

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
        run = Run(id=new_run_id(), owner=owner, session_id=session_id, timeout_s=timeout_s)
        if session_id is not None:
            session = self.sessions.get(session_id, owner)
            await session.check_free()
            session.active_run = run  # no await since the check: the next caller sees it busy
            session.busy += 1
            self.runs.add(run)
            self._tg.start_soon(self._run_in_session, run, session, code, tuple(packages))
            return run
        await self.slots.acquire(owner)
        try:
            sandbox = await self.pool.acquire()
        except BaseException:
            self.slots.release(owner)
            raise
        self.runs.add(run)
        self._tg.start_soon(self._run_stateless, run, sandbox, code, tuple(packages))
        return run

    # -- the runs themselves ------------------------------------------------------------------------
    async def _run_stateless(self, run: Run, sandbox: Sandbox, code: str, packages: tuple[str, ...]) -> None:
        raw = RawRun()
        result: RunResult | None = None
        refused: ErrorInfo | None = None
        try:
            with run.cancel_scope:
                refused = await self.packages.prepare(sandbox, code, packages, timeout_s=run.timeout_s)
                if refused is None:
                    options = install(self.stateless_options, packages)
                    await sandbox.execute(
                        code, timeout_s=run.timeout_s, options=options, on_output=self._writer(run), raw=raw
                    )
            if run.cancel_scope.cancelled_caught:
                raw.status = "cancelled"
            if refused is not None:
                result = RunResult(status="error", error=refused)
            else:
                result = self._result(raw, files=self._keep_run_files(run, raw))
        except SandboxLost as exc:
            result = RunResult(status="crashed", error=lost(exc))
        except Exception as exc:  # noqa: BLE001 - a run ends as a result; nothing may reach the task group
            result = RunResult(status="crashed", error=failed(exc))
        finally:
            self.pool.release(sandbox)
            self.slots.release(run.owner)
            await self._finish(run, result or RunResult(status="cancelled", error=cancelled()))

    async def _run_in_session(self, run: Run, session: Session, code: str, packages: tuple[str, ...]) -> None:
        raw = RawRun()
        result: RunResult | None = None
        try:
            async with session.lock:
                if session.closed:
                    result = RunResult(status="cancelled", session_id=session.id, error=closed())
                    return
                with run.cancel_scope:
                    result = await self._session_cell(run, session, code, raw, packages)
                if run.cancel_scope.cancelled_caught:  # the agent's account after the interrupt, if any
                    raw.status = "cancelled"
                    result = self._session_result(session, raw)
        except Exception as exc:  # noqa: BLE001 - a run ends as a result; nothing may reach the task group
            result = RunResult(status="crashed", session_id=session.id, error=failed(exc))
        finally:
            session.busy -= 1
            session.touch()
            if session.active_run is run:
                session.active_run = None
            await self._finish(run, result or RunResult(status="cancelled", session_id=session.id, error=cancelled()))

    async def _session_cell(
        self, run: Run, session: Session, code: str, raw: RawRun, packages: tuple[str, ...]
    ) -> RunResult:
        sandbox = await self._ensure_sandbox(session)
        options = self.session_options
        quota = {"quota_bytes": options.data_quota_bytes, "quota_files": options.data_quota_files}
        refused = await self.packages.prepare(sandbox, code, packages, timeout_s=run.timeout_s, **quota)
        if refused is not None:
            return RunResult(status="error", session_id=session.id, error=refused)
        restarted, session.lost_state = session.lost_state, False  # reported by this run
        try:
            await sandbox.execute(
                code, timeout_s=run.timeout_s, options=install(options, packages), on_output=self._writer(run), raw=raw
            )
        except SandboxLost as exc:
            if session.closed:
                return RunResult(status="cancelled", session_id=session.id, error=closed())
            session.lost_state = True
            return RunResult(status="crashed", session_id=session.id, session_restarted=True, error=lost(exc))
        result = self._session_result(session, raw)
        result.session_restarted = result.session_restarted or restarted
        return result

    def _session_result(self, session: Session, raw: RawRun) -> RunResult:
        files = [file_info(session_file_uri(session.id, f.path), f) for f in raw.files]
        session.known_files.update((info.path, info) for info in files)
        return self._result(raw, files=files, session_id=session.id)

    def _writer(self, run: Run) -> Callable[[str, str], Awaitable[None]]:
        async def write(stream: str, text: str) -> None:
            run.output.add(stream, text)

        return write

    async def _finish(self, run: Run, result: RunResult) -> None:
        with anyio.CancelScope(shield=True):
            if run.cancelled and result.status not in ("cancelled",):
                result.status = "cancelled"
            run.finish(result)
            for hook in self.finished_hooks:
                try:
                    with anyio.fail_after(5):
                        await hook(run)
                except Exception:
                    log.warning("a finished-run hook failed", exc_info=True)

    # -- waiting --------------------------------------------------------------------------------------
    async def settle(self, run: Run) -> None:
        """Cancel a run and wait (bounded) until it reports how it ended."""
        run.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(SETTLE_S):
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
                await forward_output(run, on_output)
        except anyio.get_cancelled_exc_class():
            await self.settle(run)
            raise
        return self.runs.deliver(run)

    # -- results --------------------------------------------------------------------------------------
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

    def _keep_run_files(self, run: Run, raw: RawRun) -> list[FileInfo]:
        kept: dict[str, tuple[bytes, float]] = {}
        infos = []
        for entry in raw.files:
            if entry.offset is not None and entry.length is not None:
                kept[entry.path] = (raw.file_bytes[entry.offset : entry.offset + entry.length], entry.modified)
                infos.append(file_info(run_file_uri(run.id, entry.path), entry))
            else:
                infos.append(FileInfo(path=entry.path, size=entry.size, modified=entry.modified, note=entry.note))
        if kept:
            self.run_files.put(run.id, run.owner, kept)
        return infos


async def forward_output(run: Run, on_output: OutputCallback) -> None:
    """Pass a run's output on as it comes, until the run ends."""
    positions = {stream: 0 for stream in ("stdout", "stderr")}
    while True:
        changed = run.output.renew()
        for stream in positions:
            text = run.output.since(stream, positions[stream])
            positions[stream] = run.output.end(stream)
            if text:
                await on_output(stream, text)
        if run.done:
            return
        await changed.wait()


def file_info(uri: str, entry: wire.FileEntry | wire.Written) -> FileInfo:
    return FileInfo(
        path=entry.path, size=entry.size, modified=entry.modified, uri=uri, mime_type=guess_mime(entry.path)
    )


def run_options(config: Config, *, stateless: bool) -> wire.RunOptions:
    limits = config.limits
    cap = limits.max_output_bytes
    caps = wire.RunOptions(
        max_output_bytes=cap,
        max_result_bytes=cap,
        max_display_bytes=cap,
        max_displays=limits.max_displays,
        max_images=limits.max_images,
        max_image_bytes=limits.max_image_bytes,
        max_image_pixels=limits.max_image_pixels,
    )
    if not stateless:
        quota = {"data_quota_bytes": limits.session_data_mb * MIB, "data_quota_files": limits.session_max_files}
        return caps.model_copy(update={"keep_originals": True, **quota})
    kept = config.stateless_files.max_file_mb * MIB
    return caps.model_copy(update={"collect_bytes": kept * 4, "collect_file_bytes": kept})


def install(options: wire.RunOptions, packages: tuple[str, ...]) -> wire.RunOptions:
    """The run's options, with the packages its worker installs before the code (run_python's ``packages``)."""
    return options.model_copy(update={"install": list(packages)}) if packages else options


def lost(exc: SandboxLost) -> ErrorInfo:
    return ErrorInfo(type="SandboxLost", message=f"{exc}; the run's state was lost")


def failed(exc: Exception) -> ErrorInfo:
    """The tool failed under the run (the engine, a container start): its sentence, for the model."""
    if isinstance(exc, SandboxError):
        return ErrorInfo(type=type(exc).__name__, message=str(exc))
    log.error("a run failed inside the server", exc_info=exc)
    return ErrorInfo(type="InternalError", message="the server failed to run this; see its log")


def closed() -> ErrorInfo:
    return ErrorInfo(type="SessionClosed", message="the session was closed while this run was going")


def cancelled() -> ErrorInfo:
    return ErrorInfo(type="Cancelled", message="the run was cancelled before it ended")


__all__ = ["Executor", "run_options"]
