"""Sessions that outlive their container and their server: records, take-over, pause and resume,
restore, fork, and what a session's namespace and history are asked for.

A session's state is its volume: its files, its installed packages, and (written by the agent in
the sandbox after each run) its namespace's last snapshot and its run history, under
``/mnt/data/.mcpx/``. The host never reads a snapshot: it only asks the agent in the session's own
container to restore one (``Restore``), to finish writing one (``SnapshotSync``), to list the
namespace (``Variables``) or to write the history as a notebook (``ExportNotebook``). An agent
that predates these requests answers "unknown op": a session there simply has no snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from ..config.settings import Config
from ..errors import FileOperationError, InvalidPath, SandboxError, SessionBusy, SessionLimit
from ..models import VariableInfo, VariableListing, WrittenFile
from ..protocol import messages as wire
from ..protocol import paths
from ..sandbox.container import Sandbox
from ..sandbox.records import SessionRecord, SessionRecords
from ..sandbox.volumes import SessionVolumes
from .sessions import Session, SessionRegistry
from .uris import session_file_uri

log = logging.getLogger(__name__)
FORK_MAX = 8  # forks one call makes
VARIABLES_MAX = 200  # names list_variables shows
REPR_CHARS = 120
StartOnVolume = Callable[[str], Awaitable[Sandbox]]
Labels = Callable[[str], dict[str, str]]
Ensure = Callable[[Session], Awaitable[Sandbox]]
MIB = 1024 * 1024


class Unsupported(SandboxError):
    """The sandbox image's agent does not know the request (an image older than the server)."""


class DurableSessions:
    def __init__(
        self, config: Config, sessions: SessionRegistry, records: SessionRecords, volumes: SessionVolumes
    ) -> None:
        self.settings = config.sessions
        self.limits = config.limits
        self.engine = records.engine
        self.volumes = volumes
        self.sessions = sessions
        self.records = records

    def connect(self, start_on: StartOnVolume, ensure: Ensure, labels: Labels) -> None:
        """``start_on``: a session container on a volume; ``ensure``: the session's live container
        (a new one if its old one died, or resumed if paused); ``labels(kind)``: a new volume's."""
        self._start_on = start_on
        self._ensure = ensure
        self._labels = labels

    # -- records ---------------------------------------------------------------------------------
    def _record_of(self, session: Session) -> SessionRecord:
        assert session.volume is not None
        return SessionRecord(
            session_id=session.id,
            identity=session.owner_key,
            created=session.created_at,
            lifetime_s=self.settings.max_lifetime_s,
            volume=session.volume,
            uid=self.volumes.uid_for(session.volume),
            egress=session.egress,
        )

    async def record(self, session: Session) -> None:
        """Make a durable session's record (nothing when sessions are not durable)."""
        if self.settings.durable and session.volume is not None:
            session.record = (await self.records.write(self._record_of(session))).name

    async def rerecord(self, session: Session) -> None:
        """The session's record again, as it is now (a narrowed egress): the new one first, then the
        old one goes (a server killed between the two leaves two, and the next start keeps one)."""
        old = session.record
        if old is not None:
            session.record = (await self.records.write(self._record_of(session))).name
            await self.records.remove(old)

    async def forget(self, session: Session) -> None:
        """A closed session's record goes first: a server killed before its volume goes does not
        bring it back (the volume is then swept as any a dead server left)."""
        if session.record is not None:
            await self.records.remove(session.record)
            session.record = None

    def take_over(self, adopted: list[SessionRecord]) -> None:
        """Sessions a stopped server left, as paused ones (their owner claims them by asking)."""
        now_wall, now = time.time(), time.monotonic()
        for record in adopted:
            self.volumes.uids[record.volume] = record.uid
            session = Session(
                id=record.session_id, owner="", volume=record.volume, sandbox=None, owner_key=record.identity
            )
            session.created = now - max(0.0, now_wall - record.created)
            session.created_at, session.record = record.created, record.name
            session.egress = record.egress
            self.sessions.add(session)
        if adopted:
            log.info("serving again %d sessions a stopped server left", len(adopted))

    # -- pause, resume, stop ---------------------------------------------------------------------
    async def sync(self, sandbox: Sandbox) -> wire.SnapshotState | None:
        """Let a snapshot being written finish (bounded); None when the agent cannot say."""
        wait_s = self.settings.snapshot_wait_s
        try:
            with anyio.fail_after(wait_s + 5):
                event, _ = await sandbox.request(wire.SnapshotSync(timeout=wait_s))
        except (TimeoutError, SandboxError):
            return None
        return event if isinstance(event, wire.SnapshotState) else None

    async def pause(self, session: Session) -> bool:
        """Give an idle session's container back; False when a call holds it (it is not idle)."""
        try:
            async with session.held(wait_s=0):
                if session.closed or session.sandbox is None:
                    return False
                if session.sandbox.alive:
                    await self.sync(session.sandbox)
                sandbox = session.pause()
                if sandbox is not None:
                    await sandbox.destroy()
        except SessionBusy:
            return False
        log.info("session %s paused (its container given back)", session.id)
        return True

    async def resume(self, session: Session) -> Sandbox:
        """A container for a paused session (the caller holds it), within the caps on live ones."""
        assert session.volume is not None
        started = time.monotonic()
        await self._reserve_live(session.owner)
        try:
            sandbox = await self._start_on(session.volume)
        finally:
            self.sessions.unreserve(session.owner)
        session.notes.append(f"the session was paused; it resumed in {time.monotonic() - started:.1f} s")
        return sandbox

    async def _reserve_live(self, owner: str) -> None:
        """A live slot; when the caps are reached, the longest-idle live session is paused for it."""
        for _ in range(2 * self.settings.max_sessions):
            try:
                self.sessions.reserve(owner)
                return
            except SessionLimit:
                mine = len([s for s in self.sessions.live() if s.owner == owner])
                victim = self.sessions.least_used(owner if mine >= self.settings.max_per_client else None)
                if victim is None or not await self.pause(victim):
                    raise
        self.sessions.reserve(owner)

    async def stop(self) -> set[str]:
        """A clean stop of a durable service: each recorded session's snapshot finishes (bounded),
        its container goes, its volume and record stay. Returns the volumes kept."""
        kept = [s for s in self.sessions.all() if s.record is not None and not s.closed]

        async def let_go(session: Session) -> None:
            sandbox = session.pause()
            if sandbox is not None:
                if sandbox.alive:
                    await self.sync(sandbox)
                await sandbox.destroy()

        async with anyio.create_task_group() as tg:
            for session in kept:
                tg.start_soon(let_go, session)
        return {s.volume for s in kept if s.volume is not None} | {s.record for s in kept if s.record is not None}

    # -- restore ---------------------------------------------------------------------------------
    async def restore(self, session: Session, sandbox: Sandbox) -> bool:
        """Before a run (or a listing) in a new container: restore the last snapshot. Its note and
        any pending ones go to ``session.notes``; True when a snapshot was found and loaded."""
        if not session.take_restore():
            return True
        try:
            event, _ = await sandbox.request(wire.Restore())
        except FileOperationError as exc:  # an agent without snapshots: "unknown op"
            log.debug("session %s: no restore (%s)", session.id, exc)
            return False
        if not isinstance(event, wire.Restored):
            return False
        if event.found or event.note:
            session.notes.append(event.note)
        return event.found

    # -- fork ------------------------------------------------------------------------------------
    async def fork(self, source: Session, owner: str, count: int, busy_wait_s: float) -> list[str]:
        """``count`` new paused sessions of ``owner``, each a copy of ``source``'s volume as it is
        (after its snapshot being written, if any, is complete)."""
        if not 1 <= count <= FORK_MAX:
            raise SandboxError(f"count must be 1 to {FORK_MAX}")
        if len(self.sessions.paused()) + count > self.settings.max_paused:
            raise SessionLimit(
                f"forks start paused, and the server keeps at most {self.settings.max_paused} paused sessions; "
                "close some with close_session"
            )
        await source.check_free()
        made: list[str] = []
        async with source.held(busy_wait_s):
            if source.volume is None or source.closed:
                raise SandboxError("this session has no volume to fork")
            if source.sandbox is not None and source.sandbox.alive:
                await self.sync(source.sandbox)
            for _ in range(count):
                made.append(await self._copy(source, owner))
        return made

    async def _copy(self, source: Session, owner: str) -> str:
        assert source.volume is not None
        name = self.volumes.new_name()
        size = self.volumes.size if self.volumes.enforced else None
        await self.engine.copy_volume(source.volume, name, self._labels("session"), size)
        self.volumes.uids[name] = self.volumes.uid_for(source.volume)  # the same owner: its files as they are
        fork = Session(id=self.sessions.new_id(), owner=owner, volume=name, sandbox=None, restore_due=True)
        fork.egress = source.egress  # a fork reaches what its source reaches now
        try:
            await self.record(fork)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.volumes.remove(name)
            raise
        self.sessions.add(fork)
        return fork.id

    # -- looking inside --------------------------------------------------------------------------
    async def list_variables(self, session: Session, busy_wait_s: float) -> VariableListing:
        await session.check_free()
        async with session.held(busy_wait_s):
            sandbox = await self._ensure(session)
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
        await session.check_free()
        async with session.held(busy_wait_s):
            sandbox = await self._ensure(session)
            quota = self.limits.session_data_mb * MIB, self.limits.session_max_files
            request = wire.ExportNotebook(path=relative, data_quota_bytes=quota[0], data_quota_files=quota[1])
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
