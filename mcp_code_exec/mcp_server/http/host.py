"""The HTTP host: the MCP server on SSE or streamable HTTP, with what is HTTP's own, and a clean exit.

The host builds the server (``app.build_server``) with the bearer tokens, static or OAuth 2.1
(``auth``), and the file URLs, and mounts its own routes: ``/healthz``, ``/metrics`` (``observe``)
and ``/files/{token}`` (``file_routes``). Every connection goes through the guard (``guard``), within the budget all the
server's listeners share (``listeners``). Clients are answered at once: the handshake never waits
for a warm container, a first call does (bounded by the pool's wait), and /healthz says whether the
pool has warmed (``warm``). SIGINT/SIGTERM end the server; every container and volume is removed
before the process exits.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import anyio
from mcp.server.transport_security import TransportSecuritySettings

from ...config.faces import FileSettings, HttpSettings, MetricsSettings
from ...config.sections import Limits, SessionSettings
from ...config.settings import Config
from ...errors import ConfigError
from ...sandbox.records import oauth_realms
from ...service.facade import SandboxService
from ...service.port import ServicePort
from ..app import build_server, stop_on_signal
from ..identity import token_identity
from ..sdk import SandboxServer
from .auth import AuthChoice, Authenticator, bearer_gate, client_of, configured_tokens, http_authenticator
from .file_routes import FileLinks, FileRoute
from .file_tokens import FileTokens
from .guard import guarded_config
from .listeners import ConnectionBudget, QuietServer, connection_budget, is_loopback, serve_until_cancelled
from .logs import quiet_http_logs
from .observe import METRICS_MAX_CONNECTIONS, MetricsAccess, check_metrics_port, counting_refusals, metrics_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    transport: Literal["sse", "streamable-http"] = "streamable-http"
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int | None = None  # the metrics on a listener of their own (no token there)
    auth: AuthChoice = "both"  # static tokens, OAuth, or both (what is configured of them)

    @property
    def where(self) -> str:
        return f"http://{self.host}:{self.port}"


async def serve_http(config: Config, options: ServeOptions) -> int:
    """Serve until a signal comes; SIGTERM and SIGINT are the server's own before it starts anything."""
    check_http_options(config.http, config.metrics, options)
    async with anyio.create_task_group() as tg:
        await tg.start(stop_on_signal, tg.cancel_scope)
        await _serve_started(config, options)
        tg.cancel_scope.cancel()
    log.info("shut down cleanly")
    return 0


async def _serve_started(config: Config, options: ServeOptions) -> None:
    authenticator = http_authenticator(config.http, options.auth, options.where)
    await authenticator.check_provider()
    # A session a stopped server left comes back only for a token still configured, or an OAuth
    # identity of the issuer and claim still configured.
    identities = {token_identity(name) for name in authenticator.static.tokens}
    oauth = authenticator.oauth
    realms = oauth_realms(oauth.issuer, oauth.identity_claim) if oauth is not None else set()
    budget = listeners_budget(config.http, options)
    scope = session_scope(config.sessions, options)
    try:
        async with (
            SandboxService.start(config, identities=identities, realms=realms, scope=scope) as service,
            metrics_port(config.metrics, options.metrics_port, config.http, budget),
        ):
            links = file_links(config.files, config.limits, config.http, options)
            server = http_server(service, authenticator, links)
            await _serve_http(server, config.http, options, authenticator, links, budget)
    finally:
        await authenticator.aclose()


def http_server(service: ServicePort, authenticator: Authenticator, links: FileLinks) -> SandboxServer:
    """The MCP server with the bearer tokens and file URLs, and the routes that are HTTP's own mounted."""
    server = build_server(service, auth=authenticator.auth_arguments(), file_urls=links)

    @server.custom_route("/healthz", methods=["GET"])  # type: ignore[untyped-decorator]
    async def healthz(_request: Any) -> Any:
        from starlette.responses import JSONResponse

        health: dict[str, Any] = {"ok": service.accounting.audit.healthy, **service.figures()}
        engines = service.engine_figures()  # several engines: each one's figures (by name, never its URL)
        if engines is not None:
            health["engines"] = engines
            health["ok"] = health["ok"] and any(engine["up"] for engine in engines)
        return JSONResponse(health)

    metrics_scope = authenticator.oauth.metrics_scope if authenticator.oauth is not None else None
    access = MetricsAccess(service.config.metrics, authenticator, metrics_scope)
    server.custom_route("/metrics", methods=["GET"])(access.endpoint)
    assert server.files_changed is not None  # build_server tells it
    route = FileRoute(service, links, server.files_changed)
    server.custom_route("/files/{token}", methods=["GET", "PUT", "POST"])(route)
    return server


def check_http_options(http: HttpSettings, metrics: MetricsSettings, options: ServeOptions) -> None:
    check_metrics_port(metrics, options.metrics_port, is_loopback)
    authenticated = (options.auth != "oauth" and configured_tokens(http)) or (
        options.auth != "tokens" and http.oauth is not None
    )
    if not is_loopback(options.host) and not authenticated:
        raise ConfigError(
            f"refusing to listen on {options.host} without a bearer token: set MCP_CODE_EXEC_TOKEN "
            "(or http.token, or [http.oauth], in the config), or bind 127.0.0.1"
        )
    oauth = http.oauth
    endpoint = "/sse" if options.transport == "sse" else "/mcp"
    if oauth is not None and options.auth != "tokens" and not urlsplit(oauth.resource).path.endswith(endpoint):
        log.warning(
            "http.oauth.resource %s does not end in %s, this transport's endpoint: clients are told to use it",
            oauth.resource,
            endpoint,
        )
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((options.host, options.port))
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {options.host}:{options.port} ({exc.strerror}); pick another --port"
            ) from None


def security_settings(http: HttpSettings, options: ServeOptions) -> TransportSecuritySettings:
    hosts = [
        "127.0.0.1:*",
        "localhost:*",
        "[::1]:*",
        "127.0.0.1",
        "localhost",
        f"{options.host}:*",
        *http.allowed_hosts,
    ]
    origins = [
        "http://127.0.0.1:*",
        "http://localhost:*",
        "http://[::1]:*",
        *http.allowed_origins,
    ]
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins)


def file_links(files: FileSettings, limits: Limits, http: HttpSettings, options: ServeOptions) -> FileLinks:
    """File URLs on this listener: under ``files.public_base_url``, else the Host clients use; an
    upload's cap is the lower of ``files.max_upload_mb`` and the sandbox's file size limit."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(options.host, options.host)  # noqa: S104 - a name, not a bind
    base = f"http://[{host}]:{options.port}" if ":" in host else f"http://{host}:{options.port}"
    tokens = FileTokens(files.url_ttl_s)
    cap = min(files.max_upload_bytes, limits.fsize_bytes)
    security = security_settings(http, options)
    return FileLinks(tokens, files, security, fallback_base=base, max_upload_bytes=cap)


def session_scope(sessions: SessionSettings, options: ServeOptions) -> str:
    """Whose stopped sessions this server serves again: ``sessions.scope``, or by default the same
    address (another deployment on the engine, with its own tokens, listens elsewhere)."""
    return sessions.scope or f"http:{options.host}:{options.port}"


def listeners_budget(http: HttpSettings, options: ServeOptions) -> ConnectionBudget:
    """The connections this server's listeners may hold together, descriptors kept for the rest
    (the descriptor limit is raised to its hard limit first)."""
    metrics = METRICS_MAX_CONNECTIONS if options.metrics_port is not None else 0
    return connection_budget(http.max_connections, metrics)


async def _serve_http(
    server: Any,
    http: HttpSettings,
    options: ServeOptions,
    authenticator: Authenticator,
    links: FileLinks,
    budget: ConnectionBudget,
) -> None:
    security = security_settings(http, options)
    body_cap = http.max_body_bytes
    if options.transport == "sse":
        app = server.sse_app(transport_security=security, max_request_body_size=body_cap, host=options.host)
    else:
        app = server.streamable_http_app(transport_security=security, max_request_body_size=body_cap, host=options.host)
    quiet_http_logs()
    uv_config = guarded_config(
        counting_refusals(bearer_gate(app, authenticator.oauth)),
        http,
        client_of(authenticator, links),
        budget,
        host=options.host,
        port=options.port,
        log_level="warning",
        lifespan="on",
        backlog=budget.backlog(http.max_connections),
    )
    log.info("serving %s on http://%s:%d", options.transport, options.host, options.port)
    await serve_until_cancelled(QuietServer(uv_config))


__all__ = ["ServeOptions", "http_server", "serve_http"]
