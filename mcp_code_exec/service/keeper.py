"""The session keeper: what each session's container does over its life.

::

    new ──> live ──idle (pause_after_s), or for room──> paused ──its next call──> live (resumed)
             │ its container died: the next call starts a new one on the same volume (variables gone)
             └─ closed, expired ──> gone: its record, then its container, then its volume

Resuming one session may pause another (the caps on live sessions), so pause, resume and ``ensure``
live here together, above the container factory (``containers``: starting containers, their volumes,
the warm pools, whether an engine was lost), which knows nothing of a session's life. A durable
session also has a record (``sandbox/records.py``): made with it, removed first when it closes, and
how a later server takes it over (as paused). At the service's end the durable sessions are kept
for the next server (snapshot finished, container gone) and the others closed.

With egress, a session's reach is narrowed here too (``egress_runs``: at ``new``, or later by
``restrict_egress``), and its record keeps what it narrowed to, so a later server cannot widen it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import anyio

from ..config.sections import SandboxSettings, SessionSettings
from ..errors import SandboxError, SessionBusy, SessionLimit, SessionNotFound
from ..models import SessionInfo
from ..observability import metrics
from ..observability.logs import identity_hash, logged_id
from ..protocol import messages as wire
from ..sandbox.container import Sandbox
from ..sandbox.records import SessionRecord, SessionRecords
from .accounting import Accounting
from .containers import ContainerFactory
from .egress_runs import EgressRuns
from .sessions import PausedAs, Session, SessionRegistry

log = logging.getLogger(__name__)
STOP_RUNS_S = 15.0  # how long a closed session's run may take to report before its volume goes
RESUMED: dict[PausedAs, str] = {  # the note a resume adds, by why the session had no container
    "paused": "the session was paused; it resumed in {s:.1f} s",
    "forked": "the fork started its first container in {s:.1f} s",
    "taken_over": "the session was kept by a server that stopped; it resumed in {s:.1f} s",
}


class SessionKeeper:
    def __init__(
        self,
        settings: SessionSettings,
        sandbox_settings: SandboxSettings,
        sessions: SessionRegistry,
        records: SessionRecords,
        containers: ContainerFactory,
        egress: EgressRuns | None = None,
        accounting: Accounting | None = None,
    ) -> None:
        """``accounting``: charges a container's CPU between its runs before the container goes."""
        self.settings = settings
        self.sandbox_settings = sandbox_settings  # what new_session tells of a session's container
        self.sessions = sessions
        self.records = records
        self.containers = containers
        self.egress = egress or EgressRuns(None)
        self.accounting = accounting

    # -- a session's container ---------------------------------------------------------------------
    async def ensure(self, session: Session, *, runs_code: bool = False) -> Sandbox:
        """A live container for the session (the caller holds it): a new one on the same volume if
        the old one died, or resumed if it was paused.

        A replacement means the variables are gone: ``variables_gone`` stays set until a run reports it.
        The CPU its container used since the last call is charged here, where its owner has a CPU
        quota (``Accounting.settle``), and a new container's start with it (it was started for the
        session). Past a CPU quota, ``OverQuota`` before a container is started for the call, or
        where the call runs the session's code (``runs_code``: a listing of its variables).
        """
        sandbox = session.sandbox
        if self.accounting is not None and (runs_code or sandbox is None or not sandbox.alive):
            await self.accounting.quotas.admit_call(session.owner)
        if sandbox is None or not sandbox.alive:
            if sandbox is not None:
                await self.settle(session)
                await sandbox.destroy()
                session.mark_variables_gone()
                metrics.session_restarted()
                sandbox = await self.containers.start("session", session.volume)
            else:  # paused: resumed within the caps on live sessions
                sandbox = await self.resume(session)
            if session.closed:  # closed while its new container started: that must not outlive it
                await sandbox.destroy()
                raise SessionNotFound(session.id)
            session.replace_sandbox(sandbox)
        if self.accounting is not None:  # what it used since its last call: charged before the caller's
            await self.accounting.settle(session, before_call=True)
        return sandbox

    async def new(self, owner: str, egress: Sequence[str] | None = None) -> SessionInfo:
        """A new session of ``owner``, live, on a volume of its own; ``egress``: the hosts it may
        reach, of those its owner may (None: all of them)."""
        self.sessions.caps.claim_live(owner, new_volume=True)  # refused here, before a container is taken
        try:
            sandbox = await self.containers.new_session_container()
            session = Session(id=self.sessions.new_id(), owner=owner, volume=sandbox.volume, sandbox=sandbox)
            try:
                self.egress.at_start(session, egress)
                await self.record(session)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await sandbox.destroy(with_volume=True)
                raise
            self.sessions.add(session)
            metrics.session_created()
        finally:
            self.sessions.caps.release_live(owner, new_volume=True)  # held by the session now, if it was made
        return self.info(session)

    def info(self, session: Session) -> SessionInfo:
        """What new_session (and restrict_egress) answer: the session's limits and reach."""
        limits = self.sandbox_settings.limits
        return SessionInfo(
            session_id=session.id,
            idle_timeout_s=self.settings.idle_timeout_s,
            max_lifetime_s=self.settings.max_lifetime_s,
            memory_mb=limits.memory_mb,
            cpus=limits.cpus,
            default_timeout_s=limits.default_timeout_s,
            max_run_s=limits.max_run_s,
            network=self.sandbox_settings.network,
            egress=self.egress.shown(session),
        )

    async def close(self, session: Session) -> None:
        """The end of a session: its record, its container (a run still going ends as "cancelled"),
        then its volume."""
        if not session.close():
            return
        metrics.session_closed()
        self.sessions.pop(session.id)
        self.egress.closed(session)
        with anyio.CancelScope(shield=True):
            await self.forget(session)
            if session.sandbox is not None:
                await self.settle(session)
                await session.sandbox.destroy()  # a run still going ends now, as "cancelled"
            # (one that starts a new container meanwhile removes it itself: see ``ensure``)
            with anyio.move_on_after(STOP_RUNS_S):
                async with session.lock:  # let that run finish reporting before the volume goes
                    pass
            if session.volume is not None:
                await self.containers.remove_volume(session.volume)

    async def stop_burning(self) -> None:
        """For as long as the service runs: pause the idle sessions of each identity a charge took past
        a CPU quota, so that nothing a cell left running burns on (``Accounting.owners_over_cpu``)."""
        if self.accounting is None:
            return
        while True:
            for owner in await self.accounting.owners_over_cpu():
                try:
                    for session in self.sessions.live():
                        # A session a call holds is its call's: that call, or the next, is refused by the quota.
                        idle = session.sandbox is not None and not session.busy and not session.lock.locked()
                        if session.owner == owner and idle and session.volume is not None and await self.pause(session):
                            log.info("session %s paused: its identity is past a CPU quota", logged_id(session.id))
                except Exception:  # the next charge past the quota tries again
                    log.warning("the idle sessions of %s could not all be paused", identity_hash(owner), exc_info=True)

    async def reap(self) -> None:
        """Close expired sessions and pause idle ones, for as long as the service runs."""
        while True:
            for session in self.sessions.expired():
                log.info("session %s expired", logged_id(session.id))
                metrics.session_expired()
                await self.close(session)
            for session in self.sessions.to_pause():
                await self.pause(session)
            upcoming = self.sessions.next_expiry()
            delay = 5.0 if upcoming is None else max(0.05, min(5.0, upcoming - time.monotonic()))
            await anyio.sleep(delay)  # a timer, not synchronisation

    # -- records ---------------------------------------------------------------------------------
    async def record(self, session: Session) -> None:
        """Make a durable session's record (nothing when sessions are not durable)."""
        if self.settings.durable and session.volume is not None:
            made = SessionRecord(
                session_id=session.id,
                identity=session.owner_key,
                realm=session.owner_realm,
                created=session.created_at,
                lifetime_s=self.settings.max_lifetime_s,
                volume=session.volume,
                uid=self.containers.volumes.uid_for(session.volume),
                egress=session.egress,
            )
            session.keep_record((await self.records.write(made)).name)

    async def restrict_egress(self, session: Session, allow: Sequence[str]) -> SessionInfo:
        """Narrow the session's egress to ``allow`` now, and its record with it: the new record first,
        then the old one goes (a server killed between the two leaves two; the next start keeps the
        narrower). Its info says what it reaches now."""
        await self.egress.restrict(session, allow)
        old = session.record
        if old is not None and not session.closed:
            await self.record(session)
            await self.records.remove(old)
            if session.closed:  # closed meanwhile: its new record goes as the old one did
                await self.forget(session)
        return self.info(session)

    async def forget(self, session: Session) -> None:
        """A closed session's record goes first: a server killed before its volume goes does not
        bring it back (the volume is then swept as any a dead server left)."""
        if session.record is not None:
            await self.records.remove(session.record)
            session.record_removed()

    def take_over(self, adopted: list[SessionRecord]) -> None:
        """Sessions a stopped server left, as paused ones (their owner claims them by asking)."""
        for record in adopted:
            self.containers.volumes.adopt(record.volume, record.uid)
            self.sessions.add(Session.taken_over(record))
        if adopted:
            log.info("serving again %d sessions a stopped server left", len(adopted))

    async def settle(self, session: Session) -> None:
        """What the session's container used since its last run, charged before the container goes."""
        if self.accounting is not None:
            await self.accounting.settle(session, final=True)

    # -- pause, resume, stop ---------------------------------------------------------------------
    async def snapshot_sync(self, sandbox: Sandbox) -> wire.SnapshotSynced | None:
        """Let a snapshot being written finish (bounded); None when the agent cannot say."""
        wait_s = self.settings.snapshot_wait_s
        started = time.monotonic()
        try:
            with anyio.fail_after(wait_s + 5):
                event, _ = await sandbox.request(wire.SnapshotSync(timeout=wait_s))
        except (TimeoutError, SandboxError):
            metrics.snapshot_synced(False, time.monotonic() - started)
            return None
        state = event if isinstance(event, wire.SnapshotSynced) else None
        metrics.snapshot_synced(state is not None and state.complete, time.monotonic() - started)
        return state

    async def pause(self, session: Session) -> bool:
        """Give an idle session's container back; False when a call holds it (it is not idle)."""
        try:
            async with session.held(wait_s=0):
                if session.closed or session.sandbox is None:
                    return False
                if session.sandbox.alive:
                    await self.snapshot_sync(session.sandbox)
                await self.settle(session)
                sandbox = session.pause()
                if sandbox is not None:
                    await sandbox.destroy()
        except SessionBusy:
            return False
        log.info("session %s paused (its container given back)", logged_id(session.id))
        return True

    async def resume(self, session: Session) -> Sandbox:
        """A container for a paused session (the caller holds it), within the caps on live ones."""
        assert session.volume is not None
        started = time.monotonic()
        await self._reserve_live(session.owner)
        try:
            sandbox = await self.containers.start("session", session.volume)
        finally:
            self.sessions.caps.release_live(session.owner, new_volume=False)
        session.add_note(RESUMED[session.paused_as].format(s=time.monotonic() - started))
        return sandbox

    async def _reserve_live(self, owner: str) -> None:
        """A live slot; when the caps are reached, the longest-idle live session is paused for it."""
        claim = self.sessions.caps.claim_live
        for _ in range(2 * self.settings.max_sessions):
            try:
                claim(owner, new_volume=False)  # its volume is charged already
                return
            except SessionLimit:
                mine = len([s for s in self.sessions.live() if s.owner == owner])
                victim = self.sessions.least_used(owner if mine >= self.settings.max_per_client else None)
                if victim is None or not await self.pause(victim):
                    raise
        claim(owner, new_volume=False)

    async def stop(self) -> set[str]:
        """The service's end: with durable sessions, each recorded one's snapshot finishes (bounded),
        its container goes, its volume and record stay; every other session is closed. Returns the
        volumes kept."""
        kept = await self._let_go() if self.settings.durable else set()
        async with anyio.create_task_group() as tg:
            for session in self.sessions.all():
                if session.record is None or not self.settings.durable:
                    tg.start_soon(self.close, session)
        return kept

    async def _let_go(self) -> set[str]:
        kept = [s for s in self.sessions.all() if s.record is not None and not s.closed]

        async def let_go(session: Session) -> None:
            if session.sandbox is not None and session.sandbox.alive:
                await self.snapshot_sync(session.sandbox)
            await self.settle(session)
            sandbox = session.pause()
            if sandbox is not None:
                await sandbox.destroy()

        async with anyio.create_task_group() as tg:
            for session in kept:
                tg.start_soon(let_go, session)
        return {s.volume for s in kept if s.volume is not None} | {s.record for s in kept if s.record is not None}
