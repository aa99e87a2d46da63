"""Durable sessions' records: what a server needs to serve a session again after it stopped.

Docker cannot relabel a volume, and a session's data volume is made before its session (a warm
spare's), so each durable session has a record of its own: an empty volume whose labels say the
session id, a hash of its owner identity, when it was made and how long it may live, its data
volume and the sandbox uid owning the files there, and which server holds it now (the owner
label, as on every container and volume: ``ownership.owner_token``). A server that starts takes
over (adopts) the records whose holder is gone: it makes a record of its own with the same
session, then removes the old one. It never touches a record a live server holds.

Each record names its scope: the servers that may serve it again (``sessions.scope``; by default
one listening address over HTTP, the local user over stdio). Servers of other scopes sharing the
engine (another deployment, with other tokens) neither take over nor remove a session whose server
is stopped; only its lifetime ends it for them.

The identity is hashed: the labels are visible to whoever lists the engine's volumes, and the
token names of an HTTP server are its business. An identity of an open set (OAuth's: any subject
an issuer vouches for) also has its realm, hashed: the issuer and claim that name it
(``identity_realm``). A starting server knows its static identities one by one, and an OAuth realm
as a whole: a record is served again when its identity is one of those, or its realm is.
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from ..errors import SandboxError
from ..observability.logs import identity_hash as identity_hash  # re-exported: where the records are
from ..observability.logs import logged_id
from ..runtime.base import (
    LABEL_CREATED,
    LABEL_EGRESS,
    LABEL_IDENTITY,
    LABEL_INSTANCE,
    LABEL_KIND,
    LABEL_LIFETIME,
    LABEL_OWNER,
    LABEL_REALM,
    LABEL_SCOPE,
    LABEL_SESSION,
    LABEL_UID,
    LABEL_VOLUME,
    ContainerEngine,
    VolumeRecord,
)
from .ownership import RECORD_KIND, SANDBOX_UIDS, VOLUME_NAME, VOLUME_PREFIX, owner_alive, owner_token

log = logging.getLogger(__name__)
RECORD_PREFIX = VOLUME_PREFIX + "rec-"
DEFAULT_SCOPE = "default"  # services started in-process without one (and records made before scopes)
SESSION_ID = re.compile(r"s_[A-Za-z0-9_-]{8,40}")


def oauth_identity(issuer: str, claim: str, value: str) -> str:
    """The identity an OAuth access token names: ``oauth:<issuer> <claim>=<value>``. The issuer has no
    whitespace and the claim's name no ``=`` (``config.oauth`` holds both to it), so the text says
    which issuer and claim it came from; no static token (``token:``) or stdio client (``user:``,
    ``local:``, ``local``) is spelt so."""
    return f"oauth:{issuer} {claim}={value}"


def realm_hash(issuer: str, claim: str) -> str:
    """The realm of every identity ``oauth_identity(issuer, claim, ...)``, hashed as identities are."""
    return identity_hash(f"realm\0oauth:{issuer} {claim}")


def oauth_realms(issuer: str, claim: str) -> set[str]:
    """The realms of the identities a server of ``issuer`` and ``claim`` names: its claim's, and a
    client's alone (``client_id``: a client-credentials token, see ``oauth_verifier``)."""
    return {realm_hash(issuer, claim), realm_hash(issuer, "client_id")}


def identity_realm(identity: str) -> str:
    """The hashed realm of an OAuth identity; "" for every other (they are known one by one)."""
    if not identity.startswith("oauth:"):
        return ""
    issuer, space, named = identity.removeprefix("oauth:").partition(" ")
    claim, equals, _ = named.partition("=")
    return realm_hash(issuer, claim) if space and equals else ""


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    identity: str  # the hash (``identity_hash``)
    created: float  # epoch seconds
    lifetime_s: float
    volume: str
    uid: int
    name: str = ""  # the record volume's name, once made or found
    egress: tuple[str, ...] | None = None  # what the session narrowed its egress to, when it did
    realm: str = ""  # the hash of its identity's realm (``identity_realm``), if it has one

    def labels(self, instance: str, scope: str) -> dict[str, str]:
        narrowed = {} if self.egress is None else {LABEL_EGRESS: json.dumps(list(self.egress))}
        return narrowed | {
            LABEL_OWNER: owner_token(),
            LABEL_INSTANCE: instance,
            LABEL_SCOPE: scope,
            LABEL_KIND: RECORD_KIND,
            LABEL_SESSION: self.session_id,
            LABEL_IDENTITY: self.identity,
            LABEL_CREATED: f"{self.created:.3f}",
            LABEL_LIFETIME: f"{self.lifetime_s:.3f}",
            LABEL_VOLUME: self.volume,
            LABEL_UID: str(self.uid),
            **({LABEL_REALM: self.realm} if self.realm else {}),
        }

    @classmethod
    def parse(cls, volume: VolumeRecord) -> SessionRecord | None:
        """A record from a volume's labels; None when they are not a whole record (never trusted
        further than that: a malformed one is removed with what it names, by ``adopt``'s caller)."""
        labels = volume.labels
        try:
            record = cls(
                session_id=labels[LABEL_SESSION],
                identity=labels[LABEL_IDENTITY],
                created=float(labels[LABEL_CREATED]),
                lifetime_s=float(labels[LABEL_LIFETIME]),
                volume=labels[LABEL_VOLUME],
                uid=int(labels[LABEL_UID]),
                name=volume.name,
                egress=_narrowed(labels.get(LABEL_EGRESS)),
                realm=labels.get(LABEL_REALM, ""),
            )
        except (KeyError, ValueError):
            return None
        sound = (
            SESSION_ID.fullmatch(record.session_id)
            and VOLUME_NAME.fullmatch(record.volume)
            and record.uid in SANDBOX_UIDS
            and math.isfinite(record.created + record.lifetime_s)
        )
        return record if sound else None

    def expired(self, now: float) -> bool:
        return now - self.created >= self.lifetime_s


def _narrowed(text: str | None) -> tuple[str, ...] | None:
    """A record's egress label: a JSON list of allow entries' texts (only ever narrowed further, see
    ``egress.reach.kept``); ``ValueError`` for anything else."""
    if text is None:
        return None
    found = json.loads(text)
    if not isinstance(found, list) or not all(isinstance(item, str) and len(item) < 300 for item in found):
        raise ValueError("not a list of host patterns")
    return tuple(found)


def _narrower(one: tuple[str, ...] | None, other: tuple[str, ...] | None) -> bool:
    """Whether ``one`` reaches less than ``other``: a session's egress is only ever narrowed."""
    return one is not None and (other is None or set(one) < set(other))


def known_to(identities: Collection[str], realms: Collection[str] = ()) -> Callable[[SessionRecord], bool]:
    """Whether a record's owner may come back: one of ``identities``, or of one of the hashed ``realms``."""
    hashes, realm_set = {identity_hash(identity) for identity in identities}, set(realms)
    return lambda record: record.identity in hashes or (record.realm != "" and record.realm in realm_set)


@dataclass
class Adoption:
    """What a start found: records to serve again, and data volumes not to sweep."""

    adopted: list[SessionRecord]
    held_elsewhere: set[str]  # data volumes of records live servers hold
    removed: int = 0


# The services running in this process (their instances): their records carry this process's
# owner token, as a stopped service's do, and must not be taken over by a service started beside them.
RUNNING_HERE: set[str] = set()


class SessionRecords:
    def __init__(self, engine: ContainerEngine, instance: str, scope: str = DEFAULT_SCOPE) -> None:
        self.engine = engine
        self.instance = instance
        self.scope = scope

    @staticmethod
    def new_name() -> str:
        return RECORD_PREFIX + secrets.token_hex(8)

    async def write(self, record: SessionRecord) -> SessionRecord:
        """Make the record (held by this server); returns it with its name."""
        name = self.new_name()
        await self.engine.create_volume(name, record.labels(self.instance, self.scope))
        return SessionRecord(**{**record.__dict__, "name": name})

    async def remove(self, name: str) -> None:
        try:
            await self.engine.remove_volume(name)
        except SandboxError as exc:
            log.warning("could not remove the session record %s: %s", name, exc)

    async def listed(self) -> list[VolumeRecord]:
        return await self.engine.volumes(f"{LABEL_KIND}={RECORD_KIND}")

    async def data_volumes(self) -> set[str]:
        """Every data volume a record names (whoever holds it): never swept."""
        return {volume.labels.get(LABEL_VOLUME, "") for volume in await self.listed()} - {""}

    async def adopt(
        self, known: Callable[[SessionRecord], bool] | None, *, take: bool, now: float | None = None
    ) -> Adoption:
        """Take over the records of this scope's servers that are gone (``take``; otherwise only
        clear what is past its lifetime). ``known``: whether a record's identity may come back
        (one configured, or of a configured realm; None: any identity may). Records past their lifetime, whose
        identity is not known, or that are malformed, are removed with their data volume; of
        another scope, only those past their lifetime (its identities are not this server's to judge)."""
        now = time.time() if now is None else now
        mine = owner_token()
        found = Adoption(adopted=[], held_elsewhere=set())
        by_session: dict[str, SessionRecord] = {}
        for volume in await self.listed():
            holder = volume.labels.get(LABEL_OWNER, "")
            record = SessionRecord.parse(volume)
            held_here = holder == mine and volume.labels.get(LABEL_INSTANCE) in RUNNING_HERE
            if held_here or (holder != mine and owner_alive(holder)):
                if record is not None:
                    found.held_elsewhere.add(record.volume)
                continue
            if volume.labels.get(LABEL_SCOPE, DEFAULT_SCOPE) != self.scope:
                if record is not None and record.expired(now):
                    found.removed += await self._drop(volume.name, record)
                continue
            if record is None or record.expired(now) or (known is not None and not known(record)):
                found.removed += await self._drop(volume.name, record)
                continue
            if not take:
                continue
            other = by_session.get(record.session_id)
            if other is not None:  # two records of one session (an adoption or a narrowing cut short)
                kept, dropped = (record, other) if _narrower(record.egress, other.egress) else (other, record)
                await self.remove(dropped.name)
                by_session[record.session_id] = kept
                continue
            by_session[record.session_id] = record
        for record in by_session.values():
            try:
                fresh = await self.write(record)
            except SandboxError as exc:
                log.warning("could not take over session %s: %s", logged_id(record.session_id), exc)
                continue
            await self.remove(record.name)
            found.adopted.append(fresh)
        return found

    async def _drop(self, name: str, record: SessionRecord | None) -> int:
        await self.remove(name)
        if record is None:  # what a malformed record names is not trusted to be ours: left alone
            return 0
        try:
            await self.engine.remove_volume(record.volume)
        except SandboxError as exc:
            log.warning("could not remove the volume %s of an ended session: %s", record.volume, exc)
            return 0
        log.info("removed session %s (past its lifetime, or its owner is gone)", logged_id(record.session_id))
        return 1
