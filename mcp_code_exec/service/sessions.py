"""The session registry: ids, owners, per-session locks, idle and lifetime expiry, pausing
(bookkeeping only).

A session is live (it has a container) or paused (only its volume: given back after
``pause_after_s`` idle, taken over from a server that stopped, or a new fork). The caps on both,
and on the disk each identity's volumes hold, are ``caps``'. Every call that uses a session is
admitted one way: a run by ``claim_for``, any other call by ``in_use``; both refuse at once, with
``SessionBusy`` naming the run, while a run uses the session.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal, Protocol

import anyio

from ..config.accounting import QuotaSettings
from ..config.sections import SessionSettings
from ..errors import SessionBusy, SessionNotFound
from ..models import FileInfo, UsageTotals
from ..observability import metrics
from ..sandbox.container import Sandbox
from ..sandbox.records import SessionRecord, identity_hash, identity_realm
from .caps import SessionCaps
from .container_cpu import ContainerCpu

# The most files the server remembers of a session between listings (resources/list shows no more
# of one session): runs report what they changed, never what they removed, so without a bound what
# is remembered would only grow, with every run, in the server's memory.
KNOWN_FILES_MAX = 500
# Why a session has no container, for the note its resume adds: given back (idle, for room), a fork
# not run yet, or left by a server that stopped.
PausedAs = Literal["paused", "forked", "taken_over"]


class RunHandle(Protocol):
    id: str
    cancelled: bool
    finished: anyio.Event

    @property
    def done(self) -> bool: ...


@dataclass(eq=False)
class Session(ContainerCpu):  # its container's CPU as charged to its owner: ``container_cpu``
    id: str
    owner: str
    volume: str | None
    sandbox: Sandbox | None
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    busy: int = 0
    closed: bool = False
    variables_gone: bool = False  # the next run must report session_restarted
    # The session's files as last seen (a listing, a run's changes, a write), by path: what
    # resources/list shows while a run holds the session, instead of waiting for it. At most
    # KNOWN_FILES_MAX, the most recently seen (see ``remember``); a listing replaces them all.
    known_files: dict[str, FileInfo] = field(default_factory=dict)
    active_run: RunHandle | None = None  # the run using the session now (it may outlive its call)
    # Who owns it, hashed as its record says; a session taken over from a stopped server knows only
    # this until its owner first asks for it (``owner`` is "" until then).
    owner_key: str = ""
    owner_realm: str = ""  # its owner's realm, hashed (an OAuth identity's; see sandbox/records.py)
    created_at: float = field(default_factory=time.time)  # epoch seconds, as its record says
    record: str | None = None  # its record volume (a durable session's, see sandbox/records.py)
    restore_due: bool = False  # a new container: its last snapshot is restored before the next run
    paused_as: PausedAs = "paused"  # why it has no container (when it has none)
    notes: list[str] = field(default_factory=list)  # for the next run's result (e.g. when it resumed)
    # What its runs cost since this server has had it (a session taken over starts again from nothing).
    usage: UsageTotals = field(default_factory=UsageTotals)
    usage_since: float = field(default_factory=time.time)
    egress: tuple[str, ...] | None = None  # what it narrowed its egress to (None: all its owner may reach)

    def __post_init__(self) -> None:
        if not self.owner_key:
            self.owner_key = identity_hash(self.owner)
        if not self.owner_realm:
            self.owner_realm = identity_realm(self.owner)

    @classmethod
    def taken_over(cls, record: SessionRecord) -> Session:
        """A session a stopped server left, as a paused one: its owner is known by hash until it
        first asks, and its lifetime still counts from when it was made."""
        now_wall, now = time.time(), time.monotonic()
        return cls(
            id=record.session_id,
            owner="",
            volume=record.volume,
            sandbox=None,
            owner_key=record.identity,
            owner_realm=record.realm,
            created=now - max(0.0, now_wall - record.created),
            created_at=record.created,
            record=record.name,
            egress=record.egress,
            paused_as="taken_over",
        )

    @property
    def paused(self) -> bool:
        """Only its volume is left (no container): it resumes at its next call."""
        return self.sandbox is None and self.volume is not None and not self.closed

    def belongs_to(self, owner: str) -> bool:
        return self.owner == owner if self.owner else self.owner_key == identity_hash(owner)

    def learn_owner(self, owner: str) -> None:
        """Its owner asked for it (``belongs_to`` said so): a session taken over knew only its hash."""
        if not self.owner:
            self.owner = owner

    def touch(self) -> None:
        self.last_used = time.monotonic()

    # -- who holds it ----------------------------------------------------------------------------
    async def claim_for(self, run: RunHandle) -> None:
        """Admit ``run``: ``SessionBusy`` while another run uses the session (see ``_check_free``),
        else the session is marked as used by ``run`` with no await since the check (the next
        caller sees it busy). The run then waits for the lock; ``release`` ends the claim."""
        await self._check_free()
        self.active_run = run
        self.busy += 1

    def release(self, run: RunHandle) -> None:
        """The end of ``run``'s claim: not busy for it any more, and used now (idle counts from here)."""
        self.busy -= 1
        self.touch()
        if self.active_run is run:
            self.active_run = None

    @asynccontextmanager
    async def in_use(self, wait_s: float | None = None) -> AsyncIterator[None]:
        """Admit a call that is not a run (a file call, a transfer, a listing): ``SessionBusy`` at
        once while a run uses the session, then ``held`` for the block; ``SessionNotFound`` if it was
        closed while this waited."""
        await self._check_free()
        async with self.held(wait_s):
            if self.closed:
                raise SessionNotFound(self.id)
            yield

    @asynccontextmanager
    async def held(self, wait_s: float | None = None) -> AsyncIterator[None]:
        """Hold the session's lock for a transfer or a file call, counted as busy (never idle) from
        the moment it waits until it is done. ``wait_s``: wait at most this long for a session that
        another call holds, then raise ``SessionBusy`` (None: as long as it takes)."""
        self.busy += 1
        try:
            await self._acquire(wait_s)
            try:
                yield
            finally:
                self.lock.release()
        finally:
            self.busy -= 1
            self.touch()

    async def _acquire(self, wait_s: float | None) -> None:
        try:
            self.lock.acquire_nowait()
            return
        except anyio.WouldBlock:
            if wait_s is None:
                await self.lock.acquire()
                return
        with anyio.move_on_after(wait_s):
            await self.lock.acquire()
            return
        run = self.active_run  # a run that started meanwhile waits for the same lock
        raise SessionBusy(self.id, run.id if run is not None and not run.done else None)

    # -- its container and what was lost with one --------------------------------------------------
    def replace_sandbox(self, sandbox: Sandbox) -> None:
        """A new container for the session (the old one, if any, already destroyed): its last
        snapshot is to be restored there before anything runs."""
        self.sandbox = sandbox
        self.restore_due = True
        self.cpu_started(sandbox.container_id)  # started for this session: its start is charged to it

    def pause(self) -> Sandbox | None:
        """Give the container up (the caller destroys what this returns); the volume stays."""
        sandbox, self.sandbox = self.sandbox, None
        self.paused_as = "paused"
        return sandbox

    def take_restore(self) -> bool:
        """Whether a restore is due; the caller asking sends it."""
        due, self.restore_due = self.restore_due, False
        return due

    def add_note(self, note: str) -> None:
        """Something for the next run's result (or listing) to say: how it resumed, how its restore went."""
        self.notes.append(note)

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    def mark_variables_gone(self) -> None:
        """The session's variables are gone (its container died or was replaced): the next run
        reports ``session_restarted``."""
        self.variables_gone = True

    def take_variables_gone(self) -> bool:
        """Whether variables were lost since the last run reported it; the run asking reports it."""
        gone, self.variables_gone = self.variables_gone, False
        return gone

    def narrow_egress(self, reach: tuple[str, ...]) -> None:
        """What the session may reach from now on (``egress_runs`` checked it is no wider than before)."""
        self.egress = reach

    def keep_record(self, name: str) -> None:
        """Its record volume was written (``keeper``): a later server takes it over from that."""
        self.record = name

    def record_removed(self) -> None:
        """Its record volume was removed (``keeper``): nothing brings the session back after this server."""
        self.record = None

    def close(self) -> bool:
        """Mark the session closed; False if it already was (the caller then has nothing to do)."""
        if self.closed:
            return False
        self.closed = True
        return True

    def remember(self, files: Iterable[FileInfo]) -> None:
        """Files just seen changed or written: the most recent ``KNOWN_FILES_MAX`` are kept."""
        known = self.known_files
        for info in files:
            known.pop(info.path, None)  # to the end: the most recently seen go last
            known[info.path] = info
        while len(known) > KNOWN_FILES_MAX:
            del known[next(iter(known))]

    def relist(self, files: Iterable[FileInfo]) -> None:
        """A fresh listing of the session's files replaces what was remembered."""
        self.known_files = {}
        self.remember(files)

    async def _check_free(self, settle_s: float = 10.0) -> None:
        """Raise ``SessionBusy`` while a run uses the session (every other call gets a clear answer).

        A run that is being cancelled is waited for (a bounded while): a client that cancelled a
        call and makes the next one at once should not be told the session is busy.
        """
        run = self.active_run
        if run is not None and not run.done and run.cancelled:
            with anyio.move_on_after(settle_s):
                await run.finished.wait()
        run = self.active_run
        if run is not None and not run.done:
            metrics.rejected("session_busy")
            raise SessionBusy(self.id, run.id)


class SessionRegistry:
    def __init__(self, settings: SessionSettings, volume_bytes: int, quotas: QuotaSettings | None = None) -> None:
        """``volume_bytes``: what each session volume is charged against its identity's ``stored_mb`` quota."""
        self.settings = settings
        self._sessions: dict[str, Session] = {}
        self.caps = SessionCaps(settings, volume_bytes, self.open, quotas)

    def __len__(self) -> int:
        return len(self._sessions)

    @staticmethod
    def new_id() -> str:
        return "s_" + secrets.token_urlsafe(12)

    def open(self) -> list[Session]:
        return [s for s in self._sessions.values() if not s.closed]

    def live(self) -> list[Session]:
        return [s for s in self._sessions.values() if not s.closed and not s.paused]

    def paused(self) -> list[Session]:
        return [s for s in self._sessions.values() if s.paused]

    def add(self, session: Session) -> None:
        self._sessions[session.id] = session

    def get(self, session_id: str, owner: str) -> Session:
        session = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.closed or not session.belongs_to(owner):
            raise SessionNotFound(str(session_id)[:100])
        session.learn_owner(owner)
        return session

    def pop(self, session_id: str) -> Session | None:
        return self._sessions.pop(session_id, None)

    def owned_by(self, owner: str) -> list[Session]:
        return [s for s in self._sessions.values() if s.belongs_to(owner) and not s.closed]

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    def expired(self, now: float | None = None) -> list[Session]:
        now = time.monotonic() if now is None else now
        out = []
        for session in self._sessions.values():
            idle = session.busy == 0 and now - session.last_used >= self.settings.idle_timeout_s
            if idle or now - session.created >= self.settings.max_lifetime_s:
                out.append(session)
        return out

    def to_pause(self, now: float | None = None) -> list[Session]:
        """Live sessions idle for ``pause_after_s``, within the caps on paused ones (in all and per identity)."""
        now = time.monotonic() if now is None else now
        idle = [
            s
            for s in self.live()
            if s.busy == 0 and s.volume is not None and now - s.last_used >= self.settings.pause_after_s
        ]
        return self.caps.may_pause(sorted(idle, key=lambda s: s.last_used))

    def least_used(self, owner: str | None) -> Session | None:
        """The live session idle longest (of ``owner``, or of anyone), to pause for room; None if
        every live one is in use."""
        idle = [s for s in self.live() if s.busy == 0 and s.volume is not None and (owner is None or s.owner == owner)]
        return min(idle, key=lambda s: s.last_used) if idle else None

    def next_expiry(self) -> float | None:
        cap = self.settings
        times = [min(s.last_used + cap.idle_timeout_s, s.created + cap.max_lifetime_s) for s in self._sessions.values()]
        times += [s.last_used + cap.pause_after_s for s in self.live()]
        return min(times) if times else None
