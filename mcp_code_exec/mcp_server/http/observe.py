"""The HTTP transports' side of observability: ``GET /metrics`` with its own permission, the
count and log line of every refused bearer token, and ``--metrics-port``.

``/metrics`` is a custom route, which the SDK never authenticates, so it checks for itself:
anyone when ``metrics.public``, else only a bearer token whose name is in ``metrics.readers``, or
an OAuth access token that holds ``http.oauth.metrics_scope`` (an unknown or missing token: 401; a
valid token of another identity: 403). The metrics hold no ids,
paths or user data, but queue depths and error rates are still the operator's business.

``--metrics-port`` serves ``GET /metrics`` without a token (loopback unless ``metrics.public``)
through the main listener's guarded stack (``guard``: the header and body deadlines, a share
per client address, at most ``METRICS_MAX_CONNECTIONS``), within the connection budget of all the
server's listeners, in the server's event loop.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from mcp.server.auth.provider import TokenVerifier
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...config.faces import HttpSettings, MetricsSettings
from ...errors import ConfigError
from ...observability import metrics
from .guard import Claimant, guarded_config
from .listeners import ConnectionBudget, QuietServer, serve_until_cancelled
from .logs import quiet_http_logs
from .oauth_verifier import granted

log = logging.getLogger(__name__)
REFUSED = (401, 403)
OWN_CHECKS = ("/files/", "/metrics")  # they answer 401/403 for reasons of their own, counted there
METRICS_MAX_CONNECTIONS = 64  # of --metrics-port: a scraper needs one or two
METRICS_PER_CLIENT = 16  # of one client address (over loopback, every local user is one client)


class MetricsAccess:
    """Who may read ``/metrics``: ``verifier`` checks a bearer token (the server's ``TokenVerifier``);
    ``scope``: an OAuth token holding it may read too."""

    def __init__(self, settings: MetricsSettings, verifier: TokenVerifier, scope: str | None = None) -> None:
        self.settings = settings
        self.verifier = verifier
        self.scope = scope
        self.readers = {f"token:{name}" for name in settings.readers} | set(settings.readers)

    async def refusal(self, authorization: str | None) -> tuple[int, str] | None:
        """None when the request may read the metrics; else the status and its sentence."""
        if self.settings.public:
            return None
        if authorization is None or authorization[:7].lower() != "bearer ":
            return 401, "/metrics takes a bearer token of an identity listed in metrics.readers\n"
        token = await self.verifier.verify_token(authorization[7:])
        if token is None:
            return 401, "this bearer token is not valid\n"
        identity = getattr(token, "identity", None) or f"token:{token.client_id}"
        if identity in self.readers or (self.scope is not None and granted(self.scope, token.scopes)):
            return None
        return 403, "this identity may not read /metrics (not in metrics.readers, nor holding metrics_scope)\n"

    async def endpoint(self, request: Request) -> Response:
        refused = await self.refusal(request.headers.get("authorization"))
        if refused is not None:
            status, text = refused
            metrics.rejected("auth_refused")
            log.warning("auth refused: %d on GET /metrics", status)
            return PlainTextResponse(text, status_code=status, headers={"WWW-Authenticate": "Bearer"})
        return Response(metrics.exposition(), media_type=metrics.CONTENT_TYPE)


def counting_refusals(app: ASGIApp) -> ASGIApp:
    """``app``, with each 401 or 403 it answers (a missing, unknown or under-scoped token) counted
    as a rejection and logged (rate-limited with the HTTP layer's other warnings; never the token)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or str(scope.get("path", "")).startswith(OWN_CHECKS):
            await app(scope, receive, send)
            return

        async def watching(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in REFUSED:
                metrics.rejected("auth_refused")
                log.warning("auth refused: %d on %s %s", message["status"], scope.get("method"), scope.get("path"))
            await send(message)

        await app(scope, receive, watching)

    return wrapped


def check_metrics_port(settings: MetricsSettings, port: int | None, is_loopback: Callable[[str], bool]) -> None:
    """The --metrics-port listener takes no token: loopback only, unless the metrics are public."""
    if port is not None and not is_loopback(settings.host) and not settings.public:
        raise ConfigError(
            f"refusing to serve the metrics on {settings.host} without a token: --metrics-port binds "
            "loopback (metrics.host) unless metrics.public = true"
        )


@asynccontextmanager
async def metrics_port(
    settings: MetricsSettings,
    port: int | None,
    http: HttpSettings | None = None,
    budget: ConnectionBudget | None = None,
) -> AsyncIterator[tuple[str, int] | None]:
    """``--metrics-port``: the metrics on a listener of their own while the block runs (yields the
    address it is bound to; None without a port). ``http``: the deadlines (the server's ``[http]``);
    ``budget``: the connections all the server's listeners may hold together."""
    if port is None:
        yield None
        return
    guard = (http or HttpSettings()).model_copy(
        update={"max_connections": METRICS_MAX_CONNECTIONS, "max_connections_per_client": METRICS_PER_CLIENT}
    )
    budget = budget or ConnectionBudget(METRICS_MAX_CONNECTIONS)
    listening = _bind(settings.host, port, budget.backlog(METRICS_MAX_CONNECTIONS))
    quiet_http_logs()
    server = QuietServer(
        guarded_config(
            _metrics_app,
            guard,
            _client_address,
            budget,
            log_config=None,  # uvicorn's own would add a handler on stdout, the stdio protocol's
            access_log=False,
            log_level="warning",
            lifespan="off",
            backlog=budget.backlog(METRICS_MAX_CONNECTIONS),
        )
    )
    bound = listening.getsockname()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_until_cancelled, server, [listening])
            log.info("metrics on http://%s:%d/metrics", bound[0], bound[1])
            try:
                yield str(bound[0]), int(bound[1])
            finally:
                tg.cancel_scope.cancel()
    finally:
        listening.close()  # (uvicorn closed it already, unless it was cancelled before it listened)


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((host, port))
        listening.listen(backlog)
        listening.setblocking(False)
    except OSError:
        listening.close()
        raise
    return listening


async def _client_address(scope: Scope) -> Claimant | None:
    """A --metrics-port request counts for its client's address (it names no identity)."""
    client = scope.get("client")
    return Claimant(f"address:{client[0]}") if client else None


async def _metrics_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    if scope.get("path") != "/metrics" or scope.get("method") not in ("GET", "HEAD"):
        await PlainTextResponse("only GET /metrics is served here\n", status_code=404)(scope, receive, send)
        return
    await Response(metrics.exposition(), media_type=metrics.CONTENT_TYPE)(scope, receive, send)
