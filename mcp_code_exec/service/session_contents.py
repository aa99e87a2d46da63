"""What a session holds, asked of the agent in its container: its namespace restored in a new
container, forks of it, its variables listed, its history exported as a notebook.

What a session holds is its volume: its files, its installed packages, and (written by the agent in
the sandbox after each run) its namespace's last snapshot and its run history, under
``/mnt/data/.mcpx/``. The host never reads a snapshot: it only asks the agent in the session's own
container to restore one (``Restore``), to finish writing one (``SnapshotSync``, the keeper's), to
list the namespace (``Variables``) or to write the history as a notebook (``ExportNotebook``). An
agent that refuses a restore (one that predates these requests answers "unknown op") restores
nothing: the session there goes on as one without a snapshot.
"""

from __future__ import annotations

import logging
import time

import anyio

from ..config.sections import Limits, SessionSettings
from ..errors import FileOperationError, InvalidPath, SandboxError, Unsupported
from ..models import RestoreOutcome, VariableInfo, VariableListing, WrittenFile
from ..observability import metrics
from ..protocol import messages as wire
from ..protocol import paths
from ..sandbox.container import Sandbox
from .containers import ContainerFactory
from .keeper import SessionKeeper
from .sessions import Session, SessionRegistry
from .uris import session_file_uri

log = logging.getLogger(__name__)
FORK_MAX = 8  # forks one call makes
VARIABLES_MAX = 200  # names list_variables shows
REPR_CHARS = 120


class SessionContents:
    def __init__(
        self,
        limits: Limits,
        settings: SessionSettings,
        sessions: SessionRegistry,
        keeper: SessionKeeper,
        containers: ContainerFactory,
    ) -> None:
        self.limits = limits
        self.history_read_max = settings.history_max_bytes + (1 << 20)  # as the notebook view reads it
        self.sessions = sessions
        self.keeper = keeper
        self.containers = containers

    # -- restore ---------------------------------------------------------------------------------
    async def restore(self, session: Session, sandbox: Sandbox) -> RestoreOutcome | None:
        """Before a run (or a listing) in a new container: restore the last snapshot. How it went,
        or None when no restore was due (the session kept its container); its note and any pending
        ones go to ``session.notes``."""
        if not session.take_restore():
            return None
        started = time.monotonic()
        try:
            event, _ = await sandbox.request(wire.Restore())
        except FileOperationError as exc:  # an agent without snapshots: "unknown op"
            log.debug("session %s: no restore (%s)", session.id, exc)
            metrics.session_restored(False, time.monotonic() - started)
            return "none"
        if not isinstance(event, wire.Restored):
            metrics.session_restored(False, time.monotonic() - started)
            return "failed"
        metrics.session_restored(event.outcome == "restored", time.monotonic() - started)
        if event.note:  # an empty note says nothing (a clean restore need not)
            session.add_note(event.note)
        return event.outcome

    # -- fork ------------------------------------------------------------------------------------
    async def fork(self, source: Session, owner: str, count: int, busy_wait_s: float) -> list[str]:
        """``count`` new paused sessions of ``owner``, each a copy of ``source``'s volume as it is
        (after its snapshot being written, if any, is complete), ending when ``source`` does.

        The caps are claimed for all of them before anything is copied (``SessionLimit`` otherwise),
        and each fork takes its claim over once it is in the registry."""
        if not 1 <= count <= FORK_MAX:
            raise SandboxError(f"count must be 1 to {FORK_MAX}")
        self.sessions.caps.claim_forks(owner, count)
        made: list[str] = []
        try:
            async with source.in_use(busy_wait_s):
                if source.volume is None:
                    raise SandboxError("this session has no volume to fork")
                if source.sandbox is not None and source.sandbox.alive:
                    await self.keeper.snapshot_sync(source.sandbox)
                for _ in range(count):
                    made.append(await self._copy(source, owner))
        finally:
            self.sessions.caps.release_forks(owner, count - len(made))
        return made

    async def _copy(self, source: Session, owner: str) -> str:
        assert source.volume is not None
        name = await self.containers.copy_volume(source.volume)
        # A copy of the source's data ends when the source's would: its creation time is the source's
        # (in its record too, so across a restart), whatever the lifetime counts from.
        fork = Session(
            id=self.sessions.new_id(),
            owner=owner,
            volume=name,
            sandbox=None,
            created=source.created,
            created_at=source.created_at,
            egress=source.egress,  # a fork reaches what its source reaches now
            paused_as="forked",
        )
        try:
            await self.keeper.record(fork)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.containers.remove_volume(name)
            raise
        self.sessions.add(fork)
        self.sessions.caps.release_forks(owner, 1)  # the fork holds its slot and volume now
        return fork.id

    # -- looking inside --------------------------------------------------------------------------
    async def list_variables(self, session: Session, busy_wait_s: float) -> VariableListing:
        async with session.in_use(busy_wait_s):
            # It runs the session's code (each value's __repr__; a restore's __reduce__s): past a CPU quota, refused.
            sandbox = await self.keeper.ensure(session, runs_code=True)
            await self.restore(session, sandbox)
            request = wire.Variables(limit=VARIABLES_MAX, repr_chars=REPR_CHARS)
            event = await self._ask(sandbox, request, "list variables")
        if not isinstance(event, wire.VariableList):
            raise SandboxError("the sandbox gave no list of variables")
        listed = [VariableInfo.model_validate(item.model_dump()) for item in event.variables]
        notes = session.take_notes()
        return VariableListing(session_id=session.id, variables=listed, truncated=event.truncated, notes=notes)

    async def export_notebook(self, session: Session, path: str, busy_wait_s: float) -> WrittenFile:
        relative = paths.normalize(path)
        if not relative.endswith(".ipynb"):
            raise InvalidPath("a notebook's path ends in .ipynb")
        async with session.in_use(busy_wait_s):
            sandbox = await self.keeper.ensure(session)
            quota = self.limits.session_data_bytes, self.limits.session_max_files
            request = wire.ExportNotebook(
                path=relative, data_quota_bytes=quota[0], data_quota_files=quota[1], read_max=self.history_read_max
            )
            event = await self._ask(sandbox, request, "export a notebook")
        if not isinstance(event, wire.Written):
            raise SandboxError("the sandbox did not say where it wrote the notebook")
        return WrittenFile(path=event.path, size=event.size, uri=session_file_uri(session.id, event.path))

    async def _ask(self, sandbox: Sandbox, request: wire.Request, what: str) -> wire.Event:
        try:
            event, _ = await sandbox.request(request)
        except FileOperationError as exc:
            if "unknown op" in str(exc):
                raise Unsupported(
                    f"this server's sandbox image cannot {what} yet (its agent predates it); rebuild the image "
                    "with `mcp-code-exec image build`"
                ) from None
            raise
        return event
