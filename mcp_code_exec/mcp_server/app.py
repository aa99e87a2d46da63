"""The MCP server over a running service: tools, resources, notifications, tasks, a health route.

Built once per process (SSE enters the lifespan per connection; the service outlives them all).
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from mcp.server.caching import CacheableMethod, CacheHint
from mcp.server.mcpserver import MCPServer

from .. import __version__
from ..config.greeting import SERVER_NAME
from ..service.facade import SandboxService
from ..service.runs import Run
from .file_routes import FileLinks, FileRoute
from .identity import current_identity
from .notebook_view import NotebookTools, view_extension
from .notify import Notifier
from .observe_http import MetricsAccess
from .resources import owns, register_resources
from .sdk import SandboxServer, make_input_schemas_strict, serve_legacy_subscriptions
from .tasks import TasksExtension
from .texts import instructions
from .tools import Tools, tool_errors

# How long a client may keep a list (the 2026 revision's cache hints). Tools, resources and reads
# are per caller (code mode's tools, app-only tools, each identity's files): "private", reused only
# within the authorization that asked. Files change with every run (and list-changed events say so):
# never fresh. The templates are the same for everyone. (server/discover keeps the SDK's default: the
# stdio front composes that answer itself, and must give the same.)
CACHE_HINTS: dict[CacheableMethod, CacheHint] = {
    "tools/list": CacheHint(ttl_ms=300_000, scope="private"),
    "resources/list": CacheHint(ttl_ms=0, scope="private"),
    "resources/read": CacheHint(ttl_ms=0, scope="private"),
    "resources/templates/list": CacheHint(ttl_ms=3_600_000, scope="public"),
    "prompts/list": CacheHint(ttl_ms=3_600_000, scope="public"),
}


def build_server(
    service: SandboxService,
    *,
    auth: dict[str, Any] | None = None,
    file_links: FileLinks | None = None,
    metrics_access: MetricsAccess | None = None,
) -> SandboxServer:
    """``file_links``: the HTTP transports' file URLs (``/files/{token}`` and the file_url tool);
    without them (stdio, in memory) file_url says that URLs need HTTP. ``metrics_access``: who may
    read ``GET /metrics`` (HTTP only)."""

    @asynccontextmanager
    async def lifespan(_: MCPServer) -> AsyncIterator[SandboxService]:
        yield service  # per connection on SSE, once on stdio: the service itself outlives them

    notifier = Notifier(lambda identity, uri: owns(service, identity, uri))
    server = SandboxServer(
        SERVER_NAME,
        version=__version__,
        instructions=instructions(service.config),
        lifespan=lifespan,
        subscriptions=notifier.bus,
        extensions=[TasksExtension(service), view_extension()],
        cache_hints=CACHE_HINTS,
        **(auth or {}),
    )
    serve_legacy_subscriptions(server, notifier.subscribe, notifier.unsubscribe)
    Tools(server, service, notifier, file_links).register()
    NotebookTools(server, service).register(tool_errors)
    register_resources(server, service)
    make_input_schemas_strict(server)
    _announce_run_files(service, notifier)

    @server.custom_route("/healthz", methods=["GET"])  # type: ignore[untyped-decorator]
    async def healthz(_request: Any) -> Any:
        from starlette.responses import JSONResponse

        health: dict[str, Any] = {"ok": True, **service.figures()}
        engines = service.engine_figures()  # several engines: each one's figures (by name, never its URL)
        if engines is not None:
            health["engines"] = engines
            health["ok"] = any(engine["up"] for engine in engines)
        return JSONResponse(health)

    if metrics_access is not None:
        server.custom_route("/metrics", methods=["GET"])(metrics_access.endpoint)
    if file_links is not None:
        route = FileRoute(service, file_links, notifier.changed)
        server.custom_route("/files/{token}", methods=["GET", "PUT", "POST"])(route)
    return server


def _announce_run_files(service: SandboxService, notifier: Notifier) -> None:
    """When a run that changed files ends (whoever waits for it, if anyone), tell its owner's clients.

    The service may outlive this server (tests build several over one service): the hook holds the
    notifier weakly and goes quiet when it is gone.
    """
    weak = weakref.ref(notifier)

    async def announce(run: Run) -> None:
        alive = weak()
        if alive is not None and run.result is not None and run.result.files:
            await alive.changed(run.owner, [info.uri for info in run.result.files if info.uri is not None])

    service.on_run_finished(announce)


__all__ = ["build_server", "current_identity"]
