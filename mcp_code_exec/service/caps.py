"""The caps on sessions, per identity and in all, and the claims on them of sessions being made.

Live sessions (a container each) count against ``max_sessions`` and ``max_per_client``; paused ones
(a volume only: paused when idle, taken over from a stopped server, or a new fork) against
``max_paused`` and ``max_paused_per_client``. Every session volume an identity holds, live or paused,
forks included, is charged its quota (``limits.session_data_mb``: what it may come to hold at any
time, and with the filesystem what its image takes from the start) against the identity's
``stored_mb`` quota (``[quotas]``). A session being made holds a claim, taken with no await between the
check and the count, before any slow work (a container, a copy), and given back once the session is
in the registry (again with no await between) or the work failed: two calls racing cannot both pass
a cap, and a refusal comes before anything is made.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ..config.accounting import STORED, QuotaSettings
from ..config.sections import SessionSettings
from ..config.units import MIB
from ..errors import OverQuota, SessionLimit
from ..observability import metrics
from ..sandbox.records import identity_hash


class Counted(Protocol):
    """What the caps read of a session (``sessions.Session``): whose it is, and what it holds."""

    owner_key: str  # its identity, hashed
    volume: str | None

    @property
    def paused(self) -> bool: ...


C = TypeVar("C", bound=Counted)
OpenSessions = Callable[[], Iterable[Counted]]


@dataclass
class Claims:
    """What sessions being made will hold: live slots, paused slots, volumes."""

    live: int = 0
    paused: int = 0
    volumes: int = 0

    def add(self, other: Claims, sign: int = 1) -> None:
        self.live += sign * other.live
        self.paused += sign * other.paused
        self.volumes += sign * other.volumes

    @property
    def empty(self) -> bool:
        return not (self.live or self.paused or self.volumes)


def refuse(message: str) -> SessionLimit:
    metrics.rejected("session_limit")
    return SessionLimit(message)


class SessionCaps:
    def __init__(
        self,
        settings: SessionSettings,
        volume_bytes: int,
        open_sessions: OpenSessions,
        quotas: QuotaSettings | None = None,
    ) -> None:
        self.settings = settings
        self.quotas = quotas or QuotaSettings()
        self.volume_bytes = volume_bytes  # what each session volume is charged
        self._open = open_sessions  # every session not closed
        self._claims: dict[str, Claims] = {}  # by identity hash
        self._total = Claims()

    def claims_of(self, owner: str) -> Claims:
        return self._claims.get(identity_hash(owner), Claims())

    # -- live sessions: a new session (with a new volume), or a paused one resuming ---------------
    def claim_live(self, owner: str, *, new_volume: bool) -> None:
        """Claim a live slot (and, for a new session, its volume's disk); ``SessionLimit`` past a cap."""
        caps, key = self.settings, identity_hash(owner)
        sessions = list(self._open())
        live = [s for s in sessions if not s.paused]
        if len(live) + self._total.live >= caps.max_sessions:
            raise refuse(
                f"too many sessions open ({caps.max_sessions}); close one with close_session, "
                "or use run_python without a session_id"
            )
        mine = sum(s.owner_key == key for s in live) + self._claims.get(key, Claims()).live
        if mine >= caps.max_per_client:
            raise refuse(
                f"your limit of {caps.max_per_client} open sessions is reached; close one with close_session, "
                "or use run_python without a session_id"
            )
        if new_volume:
            self._check_disk(owner, sessions, 1)
        self._take(key, Claims(live=1, volumes=int(new_volume)))

    def release_live(self, owner: str, *, new_volume: bool) -> None:
        self._give(identity_hash(owner), Claims(live=1, volumes=int(new_volume)))

    # -- forks: new paused sessions, each a new volume ---------------------------------------------
    def claim_forks(self, owner: str, count: int) -> None:
        """Claim ``count`` paused slots and their volumes' disk, all or none; ``SessionLimit`` past a cap."""
        caps, key = self.settings, identity_hash(owner)
        sessions = list(self._open())
        paused = [s for s in sessions if s.paused]
        if len(paused) + self._total.paused + count > caps.max_paused:
            raise refuse(
                f"forks start paused, and the server keeps at most {caps.max_paused} paused sessions "
                "(all clients together); close some with close_session"
            )
        mine = sum(s.owner_key == key for s in paused) + self._claims.get(key, Claims()).paused
        if mine + count > caps.max_paused_per_client:
            raise refuse(
                f"forks start paused, and your limit of {caps.max_paused_per_client} paused sessions (forks "
                f"included) would be passed: you hold {mine}; close some with close_session"
            )
        self._check_disk(owner, sessions, count)
        self._take(key, Claims(paused=count, volumes=count))

    def release_forks(self, owner: str, count: int) -> None:
        if count > 0:
            self._give(identity_hash(owner), Claims(paused=count, volumes=count))

    # -- pausing idle sessions -----------------------------------------------------------------------
    def may_pause(self, idle: Iterable[C]) -> list[C]:
        """Of ``idle`` (in order of preference), those that may pause: within ``max_paused`` and each
        identity's ``max_paused_per_client``."""
        caps = self.settings
        paused = Counter(s.owner_key for s in self._open() if s.paused)
        room = caps.max_paused - sum(paused.values()) - self._total.paused
        for key, claims in self._claims.items():
            paused[key] += claims.paused
        chosen = []
        for session in idle:
            if room <= 0:
                break
            if paused[session.owner_key] < caps.max_paused_per_client:
                paused[session.owner_key] += 1
                room -= 1
                chosen.append(session)
        return chosen

    # -- bookkeeping ----------------------------------------------------------------------------------
    def _check_disk(self, owner: str, sessions: list[Counted], more: int) -> None:
        """The identity's ``stored_mb`` quota: at any time, and it frees as sessions close."""
        limits, key = self.quotas.limits_for(owner), identity_hash(owner)
        held = sum(s.owner_key == key and s.volume is not None for s in sessions)
        held += self._claims.get(key, Claims()).volumes
        if (held + more) * self.volume_bytes > limits.stored_bytes:
            metrics.quota_refused(STORED)
            raise OverQuota(
                f"quota {STORED} reached: your sessions may hold at most {limits.stored_mb} MiB of disk at any "
                f"time, each session counted at its quota of {self.volume_bytes // MIB} MiB (live, paused and "
                f"forked alike): you hold {held}, and {more} more would pass it; it frees as sessions close "
                "(close_session)",
                STORED,
                None,
                None,
            )

    def _take(self, key: str, claims: Claims) -> None:
        self._claims.setdefault(key, Claims()).add(claims)
        self._total.add(claims)

    def _give(self, key: str, claims: Claims) -> None:
        mine = self._claims.get(key)
        if mine is None:
            return
        mine.add(claims, -1)
        self._total.add(claims, -1)
        if mine.empty:
            del self._claims[key]
