"""The session registry: ids, owners, per-session locks, idle and lifetime expiry (bookkeeping only)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

import anyio

from .config import SessionSettings
from .errors import SessionLimit, SessionNotFound
from .models import FileInfo
from .sandbox import Sandbox


@dataclass(eq=False)
class Session:
    id: str
    owner: str
    volume: str | None
    sandbox: Sandbox | None
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    busy: int = 0
    closed: bool = False
    lost_state: bool = False  # the next run must report session_restarted
    # The session's files as last seen (a listing, a run's changes, a write), by path: what
    # resources/list shows while a run holds the session, instead of waiting for it.
    known_files: dict[str, FileInfo] = field(default_factory=dict)

    def touch(self) -> None:
        self.last_used = time.monotonic()


class SessionRegistry:
    def __init__(self, settings: SessionSettings) -> None:
        self.settings = settings
        self._sessions: dict[str, Session] = {}
        self._reserved = 0

    def __len__(self) -> int:
        return len(self._sessions)

    @staticmethod
    def new_id() -> str:
        return "s_" + secrets.token_urlsafe(12)

    def reserve(self) -> None:
        """Claim a slot before the (slow) container work, so concurrent creates respect the cap."""
        if len(self._sessions) + self._reserved >= self.settings.max_sessions:
            raise SessionLimit(
                f"too many sessions open ({self.settings.max_sessions}); close one with close_session, "
                "or use run_python without a session_id"
            )
        self._reserved += 1

    def unreserve(self) -> None:
        self._reserved -= 1

    def add(self, session: Session) -> None:
        self._sessions[session.id] = session

    def get(self, session_id: str, owner: str) -> Session:
        session = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.closed or session.owner != owner:
            raise SessionNotFound(str(session_id)[:100])
        return session

    def pop(self, session_id: str) -> Session | None:
        return self._sessions.pop(session_id, None)

    def owned_by(self, owner: str) -> list[Session]:
        return [s for s in self._sessions.values() if s.owner == owner and not s.closed]

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

    def next_expiry(self) -> float | None:
        times = [
            min(s.last_used + self.settings.idle_timeout_s, s.created + self.settings.max_lifetime_s)
            for s in self._sessions.values()
        ]
        return min(times) if times else None
