"""Who an HTTP request is: its bearer token, a static one (``[http.tokens]``) or an OAuth 2.1 access
token (``[http.oauth]``), checked on the routes that need one and nowhere else.

- ``Authenticator`` is the MCP SDK's ``TokenVerifier``: a static token (compared in constant time
  with every configured one) is the identity ``token:NAME``; any other token, with OAuth configured,
  is an access token (``oauth_verifier``). Both give a ``Principal``, which names the identity.
- ``takes_bearer``: the routes that take a bearer token are the MCP endpoints and ``/metrics``.
  Anywhere else (``/healthz``, the metadata, ``/files/`` whose URL is its own permission) the
  ``Authorization`` header is dropped before the SDK's middleware could check it: a made-up token
  sent there costs nothing and never reaches the authorization server.
- ``bearer_gate`` also refuses a request with more than one ``Authorization`` header (400: two
  layers could each read another one), and, with OAuth, gives a 401 or 403 the challenge RFC 6750
  §3 and RFC 9728 §5.1 describe: the protected-resource metadata's URL and the scopes to ask for
  (``error`` only when a token was sent), and serves the metadata at the root well-known URL too.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from typing import Any, Literal
from urllib.parse import urlsplit

from mcp.server.auth.routes import build_resource_metadata_url
from mcp.server.auth.settings import AuthSettings
from pydantic import AnyHttpUrl
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...config.faces import HttpSettings
from ...config.oauth import OAuthSettings
from ...errors import ConfigError
from ..identity import token_identity
from .file_routes import FILES_PREFIX, FileLinks
from .guard import Claimant, Identify
from .oauth_keys import IssuerMismatch, Refused
from .oauth_verifier import OAuthVerifier, Principal

log = logging.getLogger(__name__)
AuthChoice = Literal["tokens", "oauth", "both"]

SCOPE = "sandbox"  # what a static token holds when no [http.oauth] names the scopes
BEARER_PATHS = ("/mcp", "/sse", "/metrics")
BEARER_PREFIXES = ("/mcp/", "/messages/")
ROOT_METADATA = "/.well-known/oauth-protected-resource"


def takes_bearer(path: str) -> bool:
    return path in BEARER_PATHS or path.startswith(BEARER_PREFIXES)


class StaticTokens:
    """Bearer tokens from the configuration; each name is a client identity."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self.tokens = tokens

    async def verify_token(self, token: str) -> Principal | None:
        name = self.name_of(token)
        if name is None:
            return None
        return Principal(token=token, client_id=name, scopes=[SCOPE], identity=token_identity(name))

    def name_of(self, token: str) -> str | None:
        found = None
        for name, expected in self.tokens.items():
            if hmac.compare_digest(token.encode(), expected.encode()) and found is None:
                found = name
        return found


class Authenticator:
    """Static tokens first, then (with ``[http.oauth]``) OAuth access tokens."""

    def __init__(self, tokens: dict[str, str], oauth: OAuthSettings | None = None) -> None:
        self.static = StaticTokens(tokens)
        self.oauth = oauth
        self.verifier = OAuthVerifier(oauth) if oauth is not None else None

    async def verify_token(self, token: str) -> Principal | None:
        name = self.static.name_of(token)
        if name is not None:
            scopes = [SCOPE, *self.oauth.scopes] if self.oauth is not None else [SCOPE]
            resource = self.oauth.resource if self.oauth is not None else None  # the SDK checks it with OAuth
            return Principal(
                token=token, client_id=name, scopes=scopes, resource=resource, identity=token_identity(name)
            )
        return await self.verifier.verify_token(token) if self.verifier is not None else None

    async def check_provider(self) -> None:
        """At start: the provider's metadata (bounded). One that names another issuer is a mistake in
        ``issuer`` (every token would be refused): the server does not start. One that cannot be had
        now is only a warning: it is asked again when a token comes."""
        if self.verifier is None:
            return
        try:
            await self.verifier.metadata.get()
        except IssuerMismatch as exc:
            raise ConfigError(f"http.oauth.issuer: {exc}; write it exactly as the provider publishes it") from None
        except Refused as exc:
            log.warning("the authorization server's metadata could not be fetched now (%s); asked again later", exc)
            return
        await self.verifier.keys.refresh()

    def auth_arguments(self) -> dict[str, Any]:
        """``build_server``'s ``auth``: this verifier, and the SDK's settings for it."""
        oauth = self.oauth
        if oauth is None:
            settings = AuthSettings(
                issuer_url="https://auth.invalid", resource_server_url=None, required_scopes=[SCOPE]
            )
        else:
            settings = AuthSettings(
                issuer_url=oauth.issuer,
                resource_server_url=oauth.resource,
                required_scopes=list(oauth.scopes),
                validate_token_resource=True,
            )
        return {"token_verifier": self, "auth": settings}

    async def aclose(self) -> None:
        if self.verifier is not None:
            await self.verifier.aclose()


def configured_tokens(http: HttpSettings) -> dict[str, str]:
    tokens = {name: secret.get_secret_value() for name, secret in http.tokens.items()}
    if http.token is not None:
        tokens.setdefault("default", http.token.get_secret_value())
    return {name: value for name, value in tokens.items() if value}


def http_authenticator(http: HttpSettings, choice: AuthChoice, where: str) -> Authenticator:
    """The static tokens and OAuth as ``choice`` (``serve --auth``) keeps them. With neither, one
    token is made up for this run and written to the log (HTTP always takes a token)."""
    oauth = http.oauth if choice != "tokens" else None
    if choice == "oauth" and oauth is None:
        raise ConfigError("--auth oauth needs an [http.oauth] section in the configuration")
    tokens = configured_tokens(http) if choice != "oauth" else {}
    if not tokens and oauth is None:
        token = secrets.token_urlsafe(32)
        tokens = {"default": token}
        log.warning(
            "no token configured (MCP_CODE_EXEC_TOKEN, http.token or [http.oauth]): clients of this run must "
            "send 'Authorization: Bearer %s' to %s; set a token to keep it across restarts",
            token,
            where,
        )
    return Authenticator(tokens, oauth)


def client_of(authenticator: Authenticator, links: FileLinks | None) -> Identify:
    """The client a request is from, for its share of connections: its bearer token's identity, on a
    route that takes one, or for a file URL the identity that asked for the URL, while that request
    runs; None when it names no client (it is refused anyway: 401, or 404 for an unknown URL)."""

    async def identify(scope: Scope) -> Claimant | None:
        path = str(scope.get("path", ""))
        if links is not None and path.startswith(FILES_PREFIX):
            issuer = links.tokens.issuer(path.removeprefix(FILES_PREFIX))
            return Claimant(issuer, this_request_only=True) if issuer is not None else None
        if not takes_bearer(path):
            return None
        for header, value in scope.get("headers", ()):
            if header == b"authorization":
                text = value.decode("latin-1")
                if text[:7].lower() != "bearer ":
                    return None
                principal = await authenticator.verify_token(text[7:])
                return Claimant(principal.identity) if principal is not None else None
        return None

    return identify


def auth_arguments(tokens: dict[str, str]) -> dict[str, Any]:
    """``build_server``'s ``auth`` for static tokens alone (tests and embedders)."""
    return Authenticator(tokens).auth_arguments()


class Challenge:
    """The ``WWW-Authenticate`` of a refusal on an MCP endpoint, with OAuth configured."""

    def __init__(self, oauth: OAuthSettings) -> None:
        self.metadata_url = str(build_resource_metadata_url(AnyHttpUrl(oauth.resource)))
        self.metadata_path = urlsplit(self.metadata_url).path  # where the SDK serves it
        self.scope = " ".join(oauth.scopes)

    def header(self, status: int, sent_token: bool) -> bytes:
        hints = [f'resource_metadata="{self.metadata_url}"'] + ([f'scope="{self.scope}"'] if self.scope else [])
        if status == 403:
            error = ['error="insufficient_scope"', 'error_description="the token lacks a scope this server requires"']
        elif sent_token:
            error = ['error="invalid_token"', 'error_description="the token is not valid here"']
        else:
            error = []  # RFC 6750 §3.1: no error code to a request that sent no credentials
        return ("Bearer " + ", ".join(error + hints)).encode()


def bearer_gate(app: ASGIApp, oauth: OAuthSettings | None) -> ASGIApp:
    """``app`` behind the rules of the module's docstring."""
    challenge = Challenge(oauth) if oauth is not None else None

    async def gate(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        sent = sum(1 for name, _ in headers if name == b"authorization")
        if sent > 1:
            await refuse(send, 400, b"one Authorization header at most\n")
            return
        path = str(scope.get("path", ""))
        if not takes_bearer(path):
            if sent:
                scope = {**scope, "headers": [(name, value) for name, value in headers if name != b"authorization"]}
            if challenge is not None and path == ROOT_METADATA != challenge.metadata_path:
                inserted = challenge.metadata_path  # the resource's own metadata, at the root URL too
                scope = {**scope, "path": inserted, "raw_path": inserted.encode()}
            await app(scope, receive, send)
            return
        if challenge is None or path == "/metrics":
            await app(scope, receive, send)
            return

        async def challenged(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in (401, 403):
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"www-authenticate"]
                kept.append((b"www-authenticate", challenge.header(message["status"], bool(sent))))
                message = {**message, "headers": kept}
            await send(message)

        await app(scope, receive, challenged)

    return gate


async def refuse(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
