"""The MCP server over a running service: tools, resources, notifications, tasks.

Built once per process (SSE enters the lifespan per connection; the service outlives them all). It
knows no transport: a host (``http``, ``local``) builds it, mounts what is its own (the HTTP host's
routes) and serves it, ending it with ``stop_on_signal``.
"""

from __future__ import annotations

import functools
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus
from mcp.server.caching import CacheableMethod, CacheHint
from mcp.server.mcpserver import MCPServer

from .. import __version__
from ..config.greeting import SERVER_NAME
from ..service.port import ServicePort
from .descriptions import instructions
from .identity import current_identity
from .notebook_view import NotebookTools, view_extension
from .notify import Notifier
from .resources import list_resources, owns, register_resources
from .sdk import SandboxServer, make_input_schemas_strict, nullable_as_type_lists, serve_legacy_subscriptions
from .tasks import TasksExtension
from .tools import FileUrls, Tools, code_mode_descriptions, tool_errors

log = logging.getLogger(__name__)

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
    service: ServicePort, *, auth: dict[str, Any] | None = None, file_urls: FileUrls | None = None
) -> SandboxServer:
    """``auth``: the SDK's ``token_verifier`` and ``auth`` settings (HTTP). ``file_urls``: the file URLs
    the host serves (the HTTP host's ``/files/{token}``), for the file_url tool; without them (stdio,
    in memory) file_url says that URLs need HTTP."""

    @asynccontextmanager
    async def lifespan(_: MCPServer) -> AsyncIterator[ServicePort]:
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
        resource_lister=lambda ctx: list_resources(service, ctx),
        description_extras=functools.partial(code_mode_descriptions, service),
        files_changed=notifier.changed,
        **(auth or {}),
    )
    serve_legacy_subscriptions(server, notifier.subscribe, notifier.unsubscribe)
    Tools(server, service, notifier, file_urls).register()
    NotebookTools(server, service).register(tool_errors)
    register_resources(server, service)
    make_input_schemas_strict(server)
    nullable_as_type_lists(server)
    service.watch_runs(notifier)  # held weakly: the service may outlive this server (tests build several)
    return server


async def stop_on_signal(scope: anyio.CancelScope, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
    """Cancel ``scope`` (a host's task group) on SIGINT or SIGTERM: every host ends this way. Started
    with ``TaskGroup.start`` before the host starts anything, the handlers are in place when the start
    returns: a signal that comes while the pool warms stops the host as cleanly as later, where
    Python's default would end it at once and leave its containers behind."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for received in signals:
            log.info("received %s; shutting down", signal.Signals(received).name)
            scope.cancel()
            return


__all__ = ["build_server", "current_identity", "stop_on_signal"]
