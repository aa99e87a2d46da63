"""Running the server on a transport, with auth and Host/Origin checks for HTTP, and a clean exit.

HTTP always takes a bearer token: the configured ones, or one made up at start and written to the
log. The token's name is the client's identity, so no two HTTP clients ever share sessions by
accident. Clients are answered at once: the handshake never waits for a warm container, a first
call does (bounded by the pool's wait), and /healthz says whether the pool has warmed (``warm``).
SIGINT/SIGTERM (and stdin closing, on stdio) end the server; every container and volume
is removed before the process exits.
"""

from __future__ import annotations

import fcntl
import hmac
import ipaddress
import logging
import os
import secrets
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.transport_security import TransportSecuritySettings
from starlette.types import Scope

from ..config.settings import Config
from ..errors import ConfigError, SandboxError
from ..service.facade import SandboxService
from .app import build_server
from .file_routes import FileLinks
from .file_tokens import FileTokens
from .http_guard import Claimant, Identify, guarded_protocol
from .http_logs import quiet_http_logs
from .identity import LOCAL, serving_as, token_identity
from .listeners import ConnectionBudget, QuietServer, connection_budget, serve_until_cancelled
from .observe_http import METRICS_MAX_CONNECTIONS, MetricsAccess, check_metrics_port, counting_refusals, metrics_port

log = logging.getLogger(__name__)
SCOPE = "sandbox"
FILES_PREFIX = "/files/"


@dataclass(frozen=True)
class ServeOptions:
    transport: Literal["stdio", "sse", "streamable-http"] = "stdio"
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int | None = None  # the metrics on a listener of their own (no token there)
    stdio_identity: str | None = None  # over stdio in this process: who the client is (else "local")


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


def configured_tokens(config: Config) -> dict[str, str]:
    tokens = {name: secret.get_secret_value() for name, secret in config.http.tokens.items()}
    if config.http.token is not None:
        tokens.setdefault("default", config.http.token.get_secret_value())
    return {name: value for name, value in tokens.items() if value}


def http_tokens(config: Config, options: ServeOptions) -> dict[str, str]:
    """The configured tokens; with none, one made up for this run and written to the log."""
    tokens = configured_tokens(config)
    if not tokens:
        token = secrets.token_urlsafe(32)
        tokens = {"default": token}
        log.warning(
            "no token configured (MCP_CODE_EXEC_TOKEN or http.token): clients of this run must send "
            "'Authorization: Bearer %s' to http://%s:%d; set a token to keep it across restarts",
            token,
            options.host,
            options.port,
        )
    return tokens


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_http_options(config: Config, options: ServeOptions) -> None:
    check_metrics_port(config.metrics, options.metrics_port, is_loopback)
    if options.transport == "stdio":
        return
    if not is_loopback(options.host) and not configured_tokens(config):
        raise ConfigError(
            f"refusing to listen on {options.host} without a bearer token: set MCP_CODE_EXEC_TOKEN "
            "(or http.token in the config), or bind 127.0.0.1"
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


def security_settings(config: Config, options: ServeOptions) -> TransportSecuritySettings:
    hosts = [
        "127.0.0.1:*",
        "localhost:*",
        "[::1]:*",
        "127.0.0.1",
        "localhost",
        f"{options.host}:*",
        *config.http.allowed_hosts,
    ]
    origins = [
        "http://127.0.0.1:*",
        "http://localhost:*",
        "http://[::1]:*",
        *config.http.allowed_origins,
    ]
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins)


def file_links(config: Config, options: ServeOptions) -> FileLinks:
    """File URLs on this listener: under ``files.public_base_url``, else the Host clients use."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(options.host, options.host)  # noqa: S104 - a name, not a bind
    base = f"http://[{host}]:{options.port}" if ":" in host else f"http://{host}:{options.port}"
    tokens = FileTokens(config.files.url_ttl_s)
    cap = min(config.files.max_upload_mb, config.limits.fsize_mb) * 1024 * 1024
    security = security_settings(config, options)
    return FileLinks(tokens, config.files, security, fallback_base=base, max_upload_bytes=cap)


def auth_arguments(tokens: dict[str, str]) -> dict[str, Any]:
    return {
        "token_verifier": StaticTokens(tokens),
        "auth": AuthSettings(issuer_url="https://auth.invalid", resource_server_url=None, required_scopes=[SCOPE]),
    }


def session_scope(config: Config, options: ServeOptions) -> str:
    """Whose stopped sessions this server serves again: ``sessions.scope``, or by default the same
    address (another deployment on the engine, with its own tokens, listens elsewhere) or, over
    stdio, the same user."""
    if config.sessions.scope:
        return config.sessions.scope
    if options.transport == "stdio":
        return f"stdio:{os.getuid()}"
    return f"http:{options.host}:{options.port}"


async def serve(config: Config, options: ServeOptions) -> int:
    """Serve until stdin closes (stdio) or a signal comes. SIGTERM and SIGINT are the server's own
    before it starts anything: one that comes while it starts (its pool warming) stops it as cleanly
    as later, where Python's default would end it at once and leave its containers behind."""
    check_http_options(config, options)
    async with anyio.create_task_group() as tg:
        await tg.start(stop_on_signal, tg.cancel_scope)
        await _serve_started(config, options)
        tg.cancel_scope.cancel()
    log.info("shut down cleanly")
    return 0


async def _serve_started(config: Config, options: ServeOptions) -> None:
    tokens = http_tokens(config, options) if options.transport != "stdio" else {}
    # Over HTTP a session a stopped server left comes back only for a token still configured.
    identities = None if options.transport == "stdio" else {token_identity(name) for name in tokens}
    budget = listeners_budget(config, options)
    async with (
        SandboxService.start(config, identities=identities, scope=session_scope(config, options)) as service,
        metrics_port(config.metrics, options.metrics_port, config.http, budget),
    ):
        links = file_links(config, options) if options.transport != "stdio" else None
        access = MetricsAccess(config.metrics, StaticTokens(tokens).name_of) if tokens else None
        server = build_server(
            service, auth=auth_arguments(tokens) if tokens else None, file_links=links, metrics_access=access
        )
        if options.transport == "stdio":
            with serving_as(options.stdio_identity or LOCAL):
                await _serve_stdio(server)
            log.info("stdin closed; shutting down")
        else:
            await _serve_http(server, config, options, client_of(tokens, links), budget)


def listeners_budget(config: Config, options: ServeOptions) -> ConnectionBudget:
    """The connections this server's listeners may hold together, descriptors kept for the rest
    (the descriptor limit is raised to its hard limit first, on every transport)."""
    http = config.http.max_connections if options.transport != "stdio" else 0
    return connection_budget(http, METRICS_MAX_CONNECTIONS if options.metrics_port is not None else 0)


async def _serve_stdio(server: Any) -> None:
    """``run_stdio_async`` with a stdin reader that a signal can cancel.

    The SDK reads stdin in a worker thread; cancellation cannot interrupt that read, so SIGTERM
    or SIGINT would wait until the client wrote another line or closed the pipe.
    """
    from mcp.server.stdio import stdio_server

    lowlevel = server._lowlevel_server
    with _claimed_stdin() as stdin:
        async with stdio_server(stdin=stdin) as (read_stream, write_stream):  # type: ignore[arg-type]
            await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())


@contextmanager
def _claimed_stdin() -> Iterator[_StdinLines]:
    """Read the client from a private copy of fd 0; fd 0 itself reads /dev/null meanwhile (as in the SDK)."""
    private = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
    finally:
        os.close(null)
    try:
        yield _StdinLines(private)
    finally:
        os.dup2(private, 0)
        os.close(private)


class _StdinLines:
    """Lines from a file descriptor, read only once it is readable (so the wait is cancellable)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        pending = bytearray()
        pollable = True
        while True:
            try:
                if pollable:
                    await anyio.wait_readable(self.fd)
                    chunk = os.read(self.fd, 1 << 20)
                else:  # a regular file cannot be polled (epoll refuses it), and reads never block
                    chunk = await anyio.to_thread.run_sync(os.read, self.fd, 1 << 20)
            except BlockingIOError:
                continue
            except PermissionError:
                pollable = False
                continue
            except OSError:
                chunk = b""
            if not chunk:
                if pending:
                    yield pending.decode("utf-8", "replace")
                return
            start = len(pending)
            pending += chunk
            end = pending.find(b"\n", start)
            while end != -1:
                yield pending[: end + 1].decode("utf-8", "replace")
                del pending[: end + 1]
                end = pending.find(b"\n")


async def stop_on_signal(scope: anyio.CancelScope, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
    """Cancel ``scope`` at the first SIGINT or SIGTERM; started with ``TaskGroup.start``, the
    handlers are in place when the start returns."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for received in signals:
            log.info("received %s; shutting down", signal.Signals(received).name)
            scope.cancel()
            return


async def _serve_http(
    server: Any, config: Config, options: ServeOptions, identify: Identify, budget: ConnectionBudget
) -> None:
    import uvicorn

    security = security_settings(config, options)
    body_cap = config.http.max_body_mb * 1024 * 1024
    if options.transport == "sse":
        app = server.sse_app(transport_security=security, max_request_body_size=body_cap, host=options.host)
    else:
        app = server.streamable_http_app(transport_security=security, max_request_body_size=body_cap, host=options.host)
    quiet_http_logs()
    uv_config = uvicorn.Config(
        counting_refusals(app),
        host=options.host,
        port=options.port,
        log_level="warning",
        lifespan="on",
        backlog=budget.backlog(config.http.max_connections),
        http=guarded_protocol(config.http, identify, budget),
        timeout_keep_alive=5,
    )
    log.info("serving %s on http://%s:%d", options.transport, options.host, options.port)
    await serve_until_cancelled(QuietServer(uv_config))


__all__ = ["SandboxError", "ServeOptions", "serve"]
