"""The HTTP transports' side of observability: ``GET /metrics`` with its own permission, and the
count and log line of every refused bearer token.

``/metrics`` is a custom route, which the SDK never authenticates, so it checks for itself:
anyone when ``metrics.public``, else only a bearer token whose name is in ``metrics.readers`` (an
unknown or missing token: 401; a valid token of another identity: 403). The metrics hold no ids,
paths or user data, but queue depths and error rates are still the operator's business.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..config.sections import MetricsSettings
from ..errors import ConfigError
from ..observability import metrics
from ..observability.listener import metrics_listener

log = logging.getLogger(__name__)
REFUSED = (401, 403)
OWN_CHECKS = ("/files/", "/metrics")  # they answer 401/403 for reasons of their own, counted there


class MetricsAccess:
    """Who may read ``/metrics``: ``verify(token)`` names a token's identity (None: no such token)."""

    def __init__(self, settings: MetricsSettings, name_of: Any) -> None:
        self.settings = settings
        self.name_of = name_of

    def refusal(self, authorization: str | None) -> tuple[int, str] | None:
        """None when the request may read the metrics; else the status and its sentence."""
        if self.settings.public:
            return None
        if authorization is None or authorization[:7].lower() != "bearer ":
            return 401, "/metrics takes a bearer token of an identity listed in metrics.readers\n"
        name = self.name_of(authorization[7:])
        if name is None:
            return 401, "this bearer token is not valid\n"
        if name not in self.settings.readers:
            return 403, "this identity may not read /metrics (it is not listed in metrics.readers)\n"
        return None

    async def endpoint(self, request: Request) -> Response:
        refused = self.refusal(request.headers.get("authorization"))
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
async def metrics_port(settings: MetricsSettings, port: int | None) -> AsyncIterator[tuple[str, int] | None]:
    """``--metrics-port``: the metrics on a listener of their own while the block runs (yields the
    address it is bound to; None without a port)."""
    if port is None:
        yield None
        return
    with metrics_listener(settings.host, port) as bound:
        log.info("metrics on http://%s:%d/metrics", *bound)
        yield bound
