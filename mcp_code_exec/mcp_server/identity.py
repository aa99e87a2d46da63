"""Who is asking: the identity that owns sessions, runs and their files.

Over HTTP the bearer token's name is the identity (``token:NAME``), or, for an OAuth access token,
the issuer and the subject it names (``oauth:<issuer> <claim>=<value>``, see ``oauth_verifier``),
in both protocol eras and on every connection:
a client that opens a connection per call (LangChain's default, the Inspector's CLI) still
reaches its own sessions and files. HTTP always has a token (see ``http.host``), so two clients
without one cannot share an identity by accident. Over stdio the identity is the OS user (or the
name configured for stdio clients), the same for every stdio process of that user: a client that
starts a server per call, or restarts it, finds its sessions again. The local service sets it per
connection (see ``local.daemon``). A server built in memory serves ``local``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from mcp.server.auth.middleware.auth_context import get_access_token

LOCAL = "local"
_connection_identity: ContextVar[str | None] = ContextVar("mcp_code_exec_connection_identity", default=None)


def current_identity() -> str:
    """The identity of the request being served (read from the auth context, so it works anywhere
    inside the request: a tool, a resource, a subscription)."""
    token = get_access_token()
    if token is not None:
        named = getattr(token, "identity", None)  # an ``auth.Principal``'s
        return named if isinstance(named, str) else token_identity(token.client_id)
    return _connection_identity.get() or LOCAL


@contextmanager
def serving_as(identity: str) -> Iterator[None]:
    """Serve the requests of this connection (every task started inside) as ``identity``."""
    reset = _connection_identity.set(identity)
    try:
        yield
    finally:
        _connection_identity.reset(reset)


def token_identity(name: str) -> str:
    """The identity of the bearer token named ``name``."""
    return f"token:{name}"


def owner_of(ctx: Any = None) -> str:
    """The identity that owns what this request makes (``ctx`` is accepted for readability)."""
    return current_identity()
