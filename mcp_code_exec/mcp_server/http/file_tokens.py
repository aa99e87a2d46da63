"""Capability tokens for file URLs: who may move which file of which session, which way, until when.

A token is 32 random bytes (``secrets.token_urlsafe``); only its SHA-256 is kept, so the table
itself holds no usable capability. A grant is bound to the identity that asked, a session, a path
under /mnt/data and a direction; it expires after ``ttl_s``; an upload grant works once (it is
spent when a request starts using it, whatever the outcome). An expired or spent grant is kept
for another ``ttl_s`` so that it is refused as such (403) rather than as unknown (404); then it
is forgotten. Each identity holds at most ``max_per_identity`` grants: the oldest go first.

A URL serves one request at a time (``claim``/``release``): a second request for a URL whose
transfer is still going is refused at once (409), so that one URL cannot hold many connections.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Direction = Literal["upload", "download"]
TOKEN_BYTES = 32
TOKEN_CHARS = 43  # token_urlsafe(32)


@dataclass(frozen=True)
class Grant:
    identity: str
    session_id: str
    path: str
    direction: Direction
    expires_at: float  # on the store's clock


class TokenRefused(Exception):
    """The token does not allow this request; ``status`` is the HTTP answer."""

    status = 404

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UnknownToken(TokenRefused):
    status = 404


class ExpiredToken(TokenRefused):
    status = 403


class SpentToken(TokenRefused):
    status = 403


class WrongDirection(TokenRefused):
    status = 405


class InUse(TokenRefused):
    status = 409


@dataclass
class _Entry:
    grant: Grant
    spent: bool = False


def _key(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class FileTokens:
    def __init__(
        self, ttl_s: float, *, max_per_identity: int = 256, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_per_identity = max_per_identity
        self.clock = clock
        self._entries: dict[bytes, _Entry] = {}  # in issue order (dicts keep it)
        self._claimed: set[bytes] = set()  # URLs a request is using now

    def __len__(self) -> int:
        return len(self._entries)

    def issue(self, identity: str, session_id: str, path: str, direction: Direction) -> str:
        now = self.clock()
        self._forget(now)
        mine = [key for key, entry in self._entries.items() if entry.grant.identity == identity]
        for key in mine[: max(0, len(mine) - self.max_per_identity + 1)]:
            del self._entries[key]
        token = secrets.token_urlsafe(TOKEN_BYTES)
        grant = Grant(identity, session_id, path, direction, expires_at=now + self.ttl_s)
        self._entries[_key(token)] = _Entry(grant)
        return token

    def redeem(self, token: str, direction: Direction) -> Grant:
        """The grant a request with this token may use, or ``TokenRefused``. Spends an upload grant."""
        now = self.clock()
        self._forget(now)
        entry = self._entries.get(_key(token)) if len(token) == TOKEN_CHARS else None
        if entry is None:
            raise UnknownToken("no such file URL")
        grant = entry.grant
        if grant.direction != direction:
            verb = "GET" if grant.direction == "download" else "PUT or POST"
            raise WrongDirection(f"this is a {grant.direction} URL: use {verb}")
        if now >= grant.expires_at:
            raise ExpiredToken("this file URL has expired; ask for a new one with the file_url tool")
        if entry.spent:
            raise SpentToken("this upload URL was used already; ask for a new one with the file_url tool")
        if direction == "upload":
            entry.spent = True
        return grant

    def claim(self, token: str, direction: Direction) -> Grant:
        """``redeem``, and hold the URL until ``release``: meanwhile another request for it gets ``InUse``."""
        grant = self.redeem(token, direction)
        key = _key(token)
        if key in self._claimed:
            raise InUse("this file URL is in use by another transfer right now; retry once that one has ended")
        self._claimed.add(key)
        return grant

    def release(self, token: str) -> None:
        self._claimed.discard(_key(token))

    def issuer(self, token: str) -> str | None:
        """The identity that asked for this URL (expired or spent, while it is remembered), or None."""
        entry = self._entries.get(_key(token)) if len(token) == TOKEN_CHARS else None
        return entry.grant.identity if entry is not None else None

    def _forget(self, now: float) -> None:
        """Drop grants past their expiry by more than ``ttl_s`` (the oldest come first)."""
        stale = []
        for key, entry in self._entries.items():
            if entry.grant.expires_at + self.ttl_s > now:
                break
            stale.append(key)
        for key in stale:
            del self._entries[key]
