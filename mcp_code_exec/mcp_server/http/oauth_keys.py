"""What the resource server fetches from its authorization server: the metadata and the signing keys.

Every fetch is bounded: a connect and read timeout, an overall deadline, no redirects, no proxy from
the environment, a cap on the body as decoded (a compressed bomb stops at the cap), JSON nesting
scanned before it is parsed, a JSON object required. Nothing is ever fetched from a URL a token
names (``jku``, ``x5u``): only the issuer's own metadata says where its keys are.

- The metadata comes from RFC 8414's path-inserted well-known URL, else OpenID Connect discovery;
  its ``issuer`` must be the configured one, byte for byte (RFC 8414 §3.3).
- The keys (JWKS) are kept ``MAX_AGE_S`` and fetched again when a token is checked after that; a
  token whose key is known never waits for that fetch. An unknown ``kid`` fetches them again at most
  once per ``MIN_REFRESH_S``, counted from the last attempt whatever its outcome, so a provider that
  is down is not hammered; fetches are single-flight. A failed fetch keeps the keys held. At most
  ``MAX_KEYS`` keys are read, public members only.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx2
import jwt

log = logging.getLogger(__name__)
MAX_DOCUMENT_BYTES = 256 * 1024
MAX_JSON_DEPTH = 16
MAX_KEYS = 32
MAX_AGE_S = 600.0
MIN_REFRESH_S = 15.0
FETCH_TIMEOUT_S = 5.0
PRIVATE_MEMBERS = ("d", "p", "q", "dp", "dq", "qi", "oth", "k")
KEY_TYPES = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}


class Refused(Exception):
    """Why a token was refused or a document not used (for logs and tests; the client sees 401/403)."""


class IssuerMismatch(Refused):
    """The provider's metadata names another issuer than the configured one."""


def json_depth(text: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text, counted outside strings, without
    parsing it (``json.loads`` recurses, and deep enough input raises RecursionError)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def parse_json_object(text: bytes, max_depth: int, what: str) -> dict[str, Any]:
    if json_depth(text) > max_depth:
        raise Refused(f"{what}: JSON nested deeper than {max_depth}")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise Refused(f"{what}: not JSON ({exc.__class__.__name__})") from None
    if not isinstance(value, dict):
        raise Refused(f"{what}: not a JSON object")
    return value


class Fetcher:
    """Bounded JSON fetches (see the module's docstring)."""

    def __init__(self, http: httpx2.AsyncClient | None = None, timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.http = http or httpx2.AsyncClient(
            timeout=httpx2.Timeout(timeout_s), follow_redirects=False, trust_env=False
        )
        self.fetched: list[str] = []  # every URL asked for, for tests

    async def json(self, method: str, url: str, *, what: str, **kwargs: Any) -> dict[str, Any]:
        self.fetched.append(url)
        body = bytearray()
        try:
            with anyio.fail_after(self.timeout_s * 2):
                async with self.http.stream(method, url, headers={"accept": "application/json"}, **kwargs) as answer:
                    if answer.status_code != 200:
                        raise Refused(f"{what}: HTTP {answer.status_code} from {url}")
                    declared = answer.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > MAX_DOCUMENT_BYTES:
                        raise Refused(f"{what}: {declared} bytes is more than {MAX_DOCUMENT_BYTES}")
                    async for chunk in answer.aiter_bytes():
                        body += chunk
                        if len(body) > MAX_DOCUMENT_BYTES:
                            raise Refused(f"{what}: more than {MAX_DOCUMENT_BYTES} bytes")
        except TimeoutError:
            raise Refused(f"{what}: {url} did not answer in time") from None
        except httpx2.HTTPError as exc:
            raise Refused(f"{what}: {exc.__class__.__name__} from {url}") from None
        return parse_json_object(bytes(body), MAX_JSON_DEPTH, what)

    async def aclose(self) -> None:
        await self.http.aclose()


class ProviderMetadata:
    """The issuer's metadata, fetched once (again after a failure, at most once per ``MIN_REFRESH_S``)."""

    def __init__(self, issuer: str, fetcher: Fetcher, clock: Callable[[], float] = time.monotonic) -> None:
        self.issuer = issuer
        self.fetcher = fetcher
        self.clock = clock
        self.document: dict[str, Any] | None = None
        self.attempted = float("-inf")
        self.lock = anyio.Lock()

    def urls(self) -> list[str]:
        parts = urlsplit(self.issuer)
        origin, path = f"{parts.scheme}://{parts.netloc}", parts.path.rstrip("/")
        return [
            f"{origin}/.well-known/oauth-authorization-server{path}",
            f"{self.issuer.rstrip('/')}/.well-known/openid-configuration",
        ]

    async def get(self) -> dict[str, Any]:
        async with self.lock:
            if self.document is not None:
                return self.document
            if self.clock() - self.attempted < MIN_REFRESH_S:
                raise Refused(f"no metadata for {self.issuer} (the last attempt failed moments ago)")
            self.attempted = self.clock()
            last: Refused | None = None
            for url in self.urls():
                try:
                    document = await self.fetcher.json("GET", url, what="provider metadata")
                except Refused as exc:
                    last = exc
                    continue
                if document.get("issuer") != self.issuer:
                    raise IssuerMismatch(
                        f"the metadata at {url} names issuer {document.get('issuer')!r}, not {self.issuer!r}"
                    )
                self.document = document
                return document
            raise Refused(f"no metadata for {self.issuer}: {last}")

    async def endpoint(self, name: str) -> str:
        value = (await self.get()).get(name)
        if not isinstance(value, str) or not value.startswith(("https://", "http://")):
            raise Refused(f"the provider's metadata has no {name}")
        return value


@dataclass
class KeySet:
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)  # kid -> public JWK
    anonymous: list[dict[str, Any]] = field(default_factory=list)  # keys without a kid
    fetched: float = float("-inf")
    parsed: dict[tuple[str, str], jwt.PyJWK] = field(default_factory=dict)  # (kid or the JWK, alg) -> key

    def lookup(self, kid: str | None, alg: str) -> jwt.PyJWK | None:
        """The key for ``kid`` and ``alg``; without a kid, only when exactly one key could have signed."""
        if kid is not None:
            found = [self.keys[kid]] if kid in self.keys and fits(self.keys[kid], alg) else []
        else:
            found = [k for k in [*self.keys.values(), *self.anonymous] if fits(k, alg)]
        if len(found) != 1:
            return None
        name = kid if kid is not None else json.dumps(found[0], sort_keys=True)
        key = self.parsed.get((name, alg))
        if key is None:  # parsing a JWK costs more than checking a signature: once per key set
            key = self.parsed[(name, alg)] = jwt.PyJWK(found[0], algorithm=alg)
        return key


def fits(jwk: Mapping[str, Any], alg: str) -> bool:
    """May this key check a signature made with ``alg``? (its ``kty``, and ``alg``/``use`` when it says)"""
    if jwk.get("alg") not in (None, alg) or jwk.get("use") not in (None, "sig"):
        return False
    return jwk.get("kty") == KEY_TYPES.get(alg[:2])


def parse_jwks(document: Mapping[str, Any], now: float) -> KeySet:
    raw = document.get("keys")
    if not isinstance(raw, list):
        raise Refused("the JWKS has no keys list")
    fresh = KeySet(fetched=now)
    for jwk in raw[:MAX_KEYS]:
        if not isinstance(jwk, dict) or jwk.get("kty") not in ("RSA", "EC", "OKP"):
            continue
        public = {name: value for name, value in jwk.items() if name not in PRIVATE_MEMBERS}
        kid = public.get("kid")
        if isinstance(kid, str):
            fresh.keys.setdefault(kid, public)
        else:
            fresh.anonymous.append(public)
    return fresh


class SigningKeys:
    """The issuer's public keys (see the module's docstring for when they are fetched)."""

    def __init__(
        self,
        metadata: ProviderMetadata,
        fetcher: Fetcher,
        jwks_uri: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metadata = metadata
        self.fetcher = fetcher
        self.jwks_uri = jwks_uri
        self.clock = clock
        self.held = KeySet()
        self.attempted = float("-inf")
        self.failure = ""  # why the last fetch failed, for the refusals it leaves
        self.lock = anyio.Lock()

    async def key(self, kid: str | None, alg: str) -> jwt.PyJWK:
        found = self.held.lookup(kid, alg)
        stale = self.clock() - self.held.fetched >= MAX_AGE_S
        if found is not None and (not stale or self.lock.locked()):
            return found  # a refresh another request is doing is not waited for
        if await self.refresh():
            found = self.held.lookup(kid, alg)  # a key the issuer stopped publishing is not used
        if found is None:
            raise Refused(f"no key {kid!r} for {alg} in the issuer's JWKS{self.failure}")
        return found

    async def refresh(self) -> bool:
        """Fetch the keys, unless the last attempt is younger than ``MIN_REFRESH_S``; a task that
        waited for another's fetch uses its result. True when the keys may have changed."""
        attempted = self.attempted
        async with self.lock:
            if self.attempted != attempted:
                return True
            now = self.clock()
            if now - attempted < MIN_REFRESH_S:
                return False
            self.attempted = now
            try:
                uri = self.jwks_uri or await self.metadata.endpoint("jwks_uri")
                self.held = parse_jwks(await self.fetcher.json("GET", uri, what="JWKS"), now)
            except Refused as exc:
                log.warning("could not fetch the issuer's keys (keeping the %d held): %s", len(self.held.keys), exc)
                self.failure = f" (the last fetch failed: {exc})"
                return False
            self.failure = ""
            return True
