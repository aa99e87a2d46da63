"""OAuth 2.1 access tokens, checked for the MCP SDK's ``TokenVerifier`` protocol (``[http.oauth]``).

- A JWT (RFC 9068) is checked with PyJWT: an asymmetric algorithm from the configured list (never
  ``none``, never HMAC), the issuer's key named by ``kid`` (``oauth_keys``), ``iss`` equal to the
  issuer as it publishes itself, ``aud`` holding this server (``resource``, or ``audience``),
  ``exp``, ``nbf`` and ``iat`` with the same leeway (``leeway_s``, at most 60 s; the SDK's own check
  of ``exp`` sees ``exp + leeway``), and the scopes (``scope``, or Entra ID's and Okta's ``scp``).
  An ID token (``nonce``, ``at_hash``) is refused, whatever its audience, and so is a token bound to
  a key (``cnf``: DPoP, RFC 9449, or mutual TLS, RFC 8705), whose proof this server never checks:
  a stolen one would otherwise be as good as a bearer token.
- An opaque token goes to the issuer's introspection endpoint (RFC 7662) with this server's own
  client credentials, and must come back active, of this issuer and for this server. At most
  ``introspections_per_s`` calls a second on average go out (a bucket of twice as many): past
  that, unknown opaque tokens are refused without a call, so made-up tokens cannot make this server
  flood its provider. A token accepted before (still within its ``exp``) is asked about again from a
  bucket of its own: made-up tokens, which anyone can send, cannot lock out clients signed in.
- The token itself is bounded first: its length, its characters (RFC 6750), the JSON nesting of its
  header and claims (scanned before they are parsed), no encrypted tokens, no ``crit`` header.
- Results are kept by the token's SHA-256: an accepted token for up to ``RESULT_CACHE_S`` (an
  introspected one for ``introspection_cache_s``), never past its expiry; a refused one for
  ``REFUSED_CACHE_S``, unless it was refused because the provider could not be asked.

The identity a token names is ``oauth:<issuer> <identity_claim>=<value>`` (``records.oauth_identity``),
or ``oauth:<issuer> client_id=<id>`` for a token of a client alone (client credentials: no ``sub``, or
a ``sub`` that is its client's id, as oidc-provider and Okta write it), so that a user whose subject
is spelt as a client's id never meets that client (RFC 9700 §4.15). No static token's identity
(``token:NAME``) or stdio client's (``user:NAME``, ``local:NAME``) is spelt so, and two issuers never
share one. ``verify_token`` never raises (Starlette would answer 500): any failure is a refusal,
with its reason kept for the log. A token seen for the first time is logged as a sign-in, with
the identity hashed and nothing of the token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import anyio
import jwt
from jwt.exceptions import PyJWTError
from mcp.server.auth.provider import AccessToken

from ...config.oauth import OAuthSettings
from ...sandbox.records import identity_hash, oauth_identity
from .oauth_keys import MAX_JSON_DEPTH, Fetcher, ProviderMetadata, Refused, SigningKeys, parse_json_object

log = logging.getLogger(__name__)
audit = logging.getLogger("mcp_code_exec.audit")
MAX_TOKEN_BYTES = 8192
MAX_IDENTITY_CHARS = 256
RESULT_CACHE_S = 60.0
REFUSED_CACHE_S = 5.0
CACHE_ENTRIES = 10_000
INTROSPECTION_CONCURRENCY = 8
BEARER_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]+")  # RFC 6750 b64token
BASE64URL = re.compile(r"[A-Za-z0-9_-]*")
ACCESS_TOKEN_TYPES = ("at+jwt", "application/at+jwt", "jwt")
V = TypeVar("V")


class Principal(AccessToken):
    """A verified token and the identity that owns what its requests make."""

    identity: str


class Unavailable(Refused):
    """Refused because the provider could not be asked (not remembered: it may answer in a moment)."""


class TTLCache(Generic[V]):
    """A bounded map with a deadline per entry; the least recently used entry goes first."""

    def __init__(self, entries: int, clock: Callable[[], float]) -> None:
        self.entries = entries
        self.clock = clock
        self.items: OrderedDict[str, tuple[float, V]] = OrderedDict()

    def get(self, key: str) -> tuple[bool, V | None]:
        hit = self.items.get(key)
        if hit is None:
            return False, None
        if hit[0] <= self.clock():
            del self.items[key]
            return False, None
        self.items.move_to_end(key)
        return True, hit[1]

    def put(self, key: str, value: V, ttl_s: float) -> None:
        if ttl_s <= 0:
            return
        self.items[key] = (self.clock() + ttl_s, value)
        self.items.move_to_end(key)
        while len(self.items) > self.entries:
            self.items.popitem(last=False)


class Bucket:
    """A token bucket: ``rate`` a second on average, at most ``burst`` at once."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.level, self.at = burst, clock()

    def take(self) -> bool:
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level < 1:
            return False
        self.level -= 1
        return True


def b64url(segment: str) -> bytes:
    if not BASE64URL.fullmatch(segment):
        raise Refused("a JWT segment is not base64url")
    try:
        return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
    except (binascii.Error, ValueError):
        raise Refused("a JWT segment is not base64url") from None


def scopes_of(claims: Mapping[str, Any]) -> list[str]:
    """``scope`` (RFC 9068: a space-separated string), else ``scp`` (a string or a list)."""
    for name in ("scope", "scp"):
        value = claims.get(name)
        if isinstance(value, str):
            return value.split()
        if isinstance(value, list) and all(isinstance(scope, str) for scope in value):
            return list(value)
    return []


def audiences(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    return []


def granted(required: str, held: list[str]) -> bool:
    """Is ``required`` among the token's scopes? A configured scope written as a URI
    (``api://app/mcp.tools``) is also held by its last part alone: Entra ID's ``scp`` names a
    resource's scopes without the resource, whose audience is checked already."""
    return required in held or ("/" in required and required.rsplit("/", 1)[1] in held)


class OAuthVerifier:
    """``TokenVerifier`` for one issuer and this server (see the module's docstring)."""

    def __init__(
        self, settings: OAuthSettings, fetcher: Fetcher | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.fetcher = fetcher or Fetcher()
        self.metadata = ProviderMetadata(settings.issuer, self.fetcher)
        self.keys = SigningKeys(self.metadata, self.fetcher)
        self.results: TTLCache[Principal | None] = TTLCache(CACHE_ENTRIES, time.monotonic)
        self.seen: TTLCache[bool] = TTLCache(CACHE_ENTRIES, time.monotonic)
        rate = settings.introspections_per_s
        self.introspections = Bucket(rate, 2 * rate, time.monotonic)  # tokens not seen before
        self.renewals = Bucket(rate, 2 * rate, time.monotonic)  # tokens accepted before, asked about again
        self.introspecting = anyio.Semaphore(INTROSPECTION_CONCURRENCY)
        self.last_refusal: str | None = None  # for the log and the tests

    async def verify_token(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
        hit, cached = self.results.get(digest)
        if hit:
            return cached
        known, _ = self.seen.get(digest)
        try:
            principal = await self.check(token, known=bool(known))
        except Unavailable as exc:
            self.refused(str(exc))
            return None
        except Refused as exc:
            self.refused(str(exc))
            self.results.put(digest, None, REFUSED_CACHE_S)
            return None
        except Exception as exc:  # any failure is a refusal, never a 500
            log.warning("a token check failed unexpectedly: %s", exc.__class__.__name__, exc_info=True)
            self.refused(f"unexpected {exc.__class__.__name__}")
            return None
        until = (principal.expires_at or 0) - self.clock()
        cache_s = self.settings.introspection_cache_s if "." not in token else RESULT_CACHE_S
        self.results.put(digest, principal, min(cache_s, until))
        self.signed_in(digest, principal, until)
        return principal

    def refused(self, reason: str) -> None:
        self.last_refusal = reason
        log.info("oauth token refused: %s", reason)

    def signed_in(self, digest: str, principal: Principal, valid_s: float) -> None:
        hit, _ = self.seen.get(digest)
        if hit:
            return
        self.seen.put(digest, True, valid_s)
        fields = {
            "event": "oauth_sign_in",
            "identity": principal.identity,  # as every line names it: hashed or named by ``audit.identities``
            "issuer": self.settings.issuer,
            "client": principal.client_id[:128],
            "scopes": " ".join(principal.scopes)[:512],
            "expires_at": principal.expires_at,
        }
        audit.info(
            "oauth sign-in identity=%s client=%s scopes=%s",
            identity_hash(principal.identity), fields["client"], fields["scopes"], extra={"fields": fields},
        )  # fmt: skip

    async def check(self, token: str, known: bool = False) -> Principal:
        if len(token) > MAX_TOKEN_BYTES:
            raise Refused(f"the token is longer than {MAX_TOKEN_BYTES} bytes")
        if not token.isascii() or not BEARER_TOKEN.fullmatch(token):
            raise Refused("the token has characters a bearer token cannot have")
        dots = token.count(".")
        if dots == 2:
            return await self.check_jwt(token)
        if dots == 4:
            raise Refused("encrypted (JWE) tokens are not accepted")
        return await self.introspect(token, known)

    # -- JWT access tokens ---------------------------------------------------------------------
    async def check_jwt(self, token: str) -> Principal:
        settings = self.settings
        head, body, _ = token.split(".")
        header = parse_json_object(b64url(head), 4, "JWT header")
        parse_json_object(b64url(body), MAX_JSON_DEPTH, "JWT claims")  # nesting, before PyJWT parses it
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in settings.algorithms:
            raise Refused(f"the algorithm {str(alg)[:20]!r} is not accepted")
        if "crit" in header:
            raise Refused("a critical header extension is not understood")
        kind = header.get("typ")
        if kind is not None and (not isinstance(kind, str) or kind.lower() not in ACCESS_TOKEN_TYPES):
            raise Refused(f"the token type {str(kind)[:40]!r} is not an access token's")
        kid = header.get("kid")
        if kid is not None and (not isinstance(kid, str) or len(kid) > 256):
            raise Refused("the kid is not a short string")
        key = await self.keys.key(kid, alg)
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key=key,
                algorithms=[alg],
                audience=settings.expected_audience,
                issuer=settings.issuer,
                leeway=settings.leeway_s,
                options={"require": ["exp", "iss", "aud"]},
            )
        except PyJWTError as exc:
            raise Refused(f"{exc.__class__.__name__}: {exc}") from None
        if "nonce" in claims or "at_hash" in claims:
            raise Refused("an ID token is not an access token")
        issued = claims.get("iat")  # PyJWT checks only that it is a number
        if isinstance(issued, int | float) and issued > self.clock() + settings.leeway_s:
            raise Refused("ImmatureSignatureError: the token was issued in the future (iat)")
        return self.principal(token, claims)

    def principal(self, token: str, claims: Mapping[str, Any], claim: str | None = None) -> Principal:
        settings = self.settings
        if "cnf" in claims:  # RFC 9449 §7, RFC 8705 §3: a bound token is refused where its binding is not checked
            raise Refused("a sender-constrained token (cnf: DPoP or mTLS) is not a bearer token")
        claim = claim or settings.identity_claim
        value = claims.get(claim)
        if not isinstance(value, str) or not value or len(value) > MAX_IDENTITY_CHARS or not value.isprintable():
            raise Refused(f"the claim {claim!r} names no identity")
        scopes = scopes_of(claims)
        # The SDK compares scopes as strings: a configured scope held by its last part is added whole.
        scopes += [scope for scope in settings.scopes if scope not in scopes and granted(scope, scopes)]
        named = next((claims[c] for c in ("client_id", "azp", "appid") if isinstance(claims.get(c), str)), None)
        client = named or value
        if claim == "sub" and named == value:
            claim = "client_id"  # no resource owner: the client itself, never a user whose sub is spelt so
        exp = claims.get("exp")
        return Principal(
            token=token,
            client_id=str(client)[:MAX_IDENTITY_CHARS],
            scopes=scopes,
            expires_at=int(exp + settings.leeway_s) if isinstance(exp, int | float) else None,
            resource=settings.resource,
            subject=value,
            claims={"iss": settings.issuer},
            identity=oauth_identity(settings.issuer, claim, value),
        )

    # -- opaque tokens: introspection ----------------------------------------------------------
    async def introspect(self, token: str, known: bool = False) -> Principal:
        settings = self.settings
        if settings.introspection_client_id is None or settings.introspection_client_secret is None:
            raise Refused("an opaque token, and no introspection is configured")
        endpoint = await self.introspection_endpoint()
        if not (self.renewals if known else self.introspections).take():
            raise Unavailable("introspection refused: more than introspections_per_s")
        credentials = (settings.introspection_client_id, settings.introspection_client_secret.get_secret_value())
        async with self.introspecting:
            try:
                answer = await self.fetcher.json(
                    "POST",
                    endpoint,
                    what="introspection",
                    data={"token": token, "token_type_hint": "access_token"},
                    auth=credentials,
                )
            except Refused as exc:
                raise Unavailable(str(exc)) from None
        return self.introspected(token, answer)

    async def introspection_endpoint(self) -> str:
        try:
            return await self.metadata.endpoint("introspection_endpoint")
        except Refused as exc:
            raise Unavailable(str(exc)) from None

    def introspected(self, token: str, answer: Mapping[str, Any]) -> Principal:
        settings, now = self.settings, self.clock()
        if answer.get("active") is not True:
            raise Refused("introspection: the token is not active")
        if answer.get("iss", settings.issuer) != settings.issuer:
            raise Refused("introspection: another issuer's token")
        if settings.expected_audience not in audiences(answer.get("aud")):
            raise Refused("introspection: the token is not for this server (aud)")
        exp, nbf = answer.get("exp"), answer.get("nbf")
        if not isinstance(exp, int | float) or exp + settings.leeway_s <= now:
            raise Refused("introspection: expired, or no exp")
        if isinstance(nbf, int | float) and nbf > now + settings.leeway_s:
            raise Refused("introspection: not valid yet")
        kind = answer.get("token_type")
        if kind is not None and str(kind).lower() not in ("bearer", "access_token"):
            raise Refused("introspection: not an access token")
        if "sub" not in answer and settings.identity_claim not in answer and isinstance(answer.get("client_id"), str):
            return self.principal(token, answer, "client_id")  # no resource owner (client credentials): the client
        return self.principal(token, answer)

    async def aclose(self) -> None:
        await self.fetcher.aclose()
