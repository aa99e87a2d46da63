"""Who is asking: the identity that owns sessions, runs and their files.

Over HTTP the bearer token's name is the identity, in both protocol eras and on every connection:
a client that opens a connection per call (LangChain's default, the Inspector's CLI) still
reaches its own sessions and files. HTTP always has a token (see ``transports``), so two clients
without one cannot share an identity by accident. Over stdio the process serves one client, and
that client is the identity; in memory likewise.
"""

from __future__ import annotations

from typing import Any

from mcp.server.auth.middleware.auth_context import get_access_token

LOCAL = "local"


def current_identity() -> str:
    """The identity of the request being served (read from the auth context, so it works anywhere
    inside the request: a tool, a resource, a subscription)."""
    token = get_access_token()
    return token_identity(token.client_id) if token is not None else LOCAL


def token_identity(name: str) -> str:
    """The identity of the bearer token named ``name``."""
    return f"token:{name}"


def owner_of(ctx: Any = None) -> str:
    """The identity that owns what this request makes (``ctx`` is accepted for readability)."""
    return current_identity()
