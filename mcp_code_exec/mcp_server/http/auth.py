"""Who an HTTP request is from: the bearer tokens, and the identity each names.

HTTP always takes a bearer token: the configured ones, or one made up at start and written to the
log. The token's name is the client's identity (``identity.token_identity``), so no two HTTP clients
ever share sessions by accident. The SDK checks the token of every MCP request (``auth_arguments``);
the connection guard counts a request for the client its token names, and a file URL's request for
the identity that asked for the URL (``client_of``).
"""

from __future__ import annotations

import hmac
import logging
import secrets
from typing import Any

from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from starlette.types import Scope

from ...config.settings import Config
from ..identity import token_identity
from .file_routes import FILES_PREFIX, FileLinks
from .guard import Claimant, Identify

log = logging.getLogger(__name__)
SCOPE = "sandbox"


class StaticTokens:
    """Bearer tokens from the configuration; each name is a client identity."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self.tokens = tokens

    async def verify_token(self, token: str) -> AccessToken | None:
        name = self.name_of(token)
        return AccessToken(token=token, client_id=name, scopes=[SCOPE]) if name is not None else None

    def name_of(self, token: str) -> str | None:
        found = None
        for name, expected in self.tokens.items():
            if hmac.compare_digest(token.encode(), expected.encode()) and found is None:
                found = name
        return found


def configured_tokens(config: Config) -> dict[str, str]:
    tokens = {name: secret.get_secret_value() for name, secret in config.http.tokens.items()}
    if config.http.token is not None:
        tokens.setdefault("default", config.http.token.get_secret_value())
    return {name: value for name, value in tokens.items() if value}


def http_tokens(config: Config, host: str, port: int) -> dict[str, str]:
    """The configured tokens; with none, one made up for this run and written to the log."""
    tokens = configured_tokens(config)
    if not tokens:
        token = secrets.token_urlsafe(32)
        tokens = {"default": token}
        log.warning(
            "no token configured (MCP_CODE_EXEC_TOKEN or http.token): clients of this run must send "
            "'Authorization: Bearer %s' to http://%s:%d; set a token to keep it across restarts",
            token,
            host,
            port,
        )
    return tokens


def auth_arguments(tokens: dict[str, str]) -> dict[str, Any]:
    """What ``build_server`` passes the SDK so that it checks every MCP request's bearer token."""
    return {
        "token_verifier": StaticTokens(tokens),
        "auth": AuthSettings(issuer_url="https://auth.invalid", resource_server_url=None, required_scopes=[SCOPE]),
    }


def client_of(tokens: dict[str, str], links: FileLinks | None) -> Identify:
    """The client a request is from, for its share of connections: its bearer token's identity, or
    for a file URL the identity that asked for the URL, while that request runs; None when it names no client (it is
    refused anyway: 401, or 404 for an unknown URL)."""
    verifier = StaticTokens(tokens)

    def identify(scope: Scope) -> Claimant | None:
        path = str(scope.get("path", ""))
        if links is not None and path.startswith(FILES_PREFIX):
            issuer = links.tokens.issuer(path.removeprefix(FILES_PREFIX))
            return Claimant(issuer, this_request_only=True) if issuer is not None else None
        for header, value in scope.get("headers", ()):
            if header == b"authorization":
                text = value.decode("latin-1")
                if text[:7].lower() != "bearer ":
                    return None
                name = verifier.name_of(text[7:])
                return Claimant(token_identity(name)) if name is not None else None
        return None

    return identify
