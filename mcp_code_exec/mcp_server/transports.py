"""Running the server on a transport, with auth and Host/Origin checks for HTTP, and a clean exit.

HTTP always takes a bearer token: a configured static one, an OAuth access token (``[http.oauth]``),
or one made up at start and written to the log (``auth``). The token names the client's identity,
so no two HTTP clients ever share sessions by accident. Clients are answered at once: the
handshake never waits for a warm container, a first call does (bounded by the pool's wait), and
/healthz says whether the pool has warmed (``warm``). SIGINT/SIGTERM (and stdin closing, on stdio)
end the server; every container and volume is removed before the process exits.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import anyio
from mcp.server.transport_security import TransportSecuritySettings

from ..config.settings import Config
from ..errors import ConfigError, SandboxError
from ..sandbox.records import realm_hash
from ..service.facade import SandboxService
from .app import build_server
from .auth import AuthChoice, Authenticator, bearer_gate, client_of, configured_tokens, http_authenticator
from .file_routes import FileLinks
from .file_tokens import FileTokens
from .http_guard import guarded_protocol
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
    auth: AuthChoice = "both"  # over HTTP: static tokens, OAuth, or both (what is configured of them)

    @property
    def where(self) -> str:
        return f"http://{self.host}:{self.port}"


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
    authenticated = (options.auth != "oauth" and configured_tokens(config)) or (
        options.auth != "tokens" and config.http.oauth is not None
    )
    if not is_loopback(options.host) and not authenticated:
        raise ConfigError(
            f"refusing to listen on {options.host} without a bearer token: set MCP_CODE_EXEC_TOKEN "
            "(or http.token, or [http.oauth], in the config), or bind 127.0.0.1"
        )
    oauth = config.http.oauth
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
    check_http_options(config, options)
    http = options.transport != "stdio"
    authenticator = http_authenticator(config, options.auth, options.where) if http else None
    if authenticator is not None:
        await authenticator.check_provider()
    # Over HTTP a session a stopped server left comes back only for a token still configured, or an
    # OAuth identity of the issuer and claim still configured.
    identities = None if authenticator is None else {token_identity(name) for name in authenticator.static.tokens}
    oauth = authenticator.oauth if authenticator is not None else None
    realms = {realm_hash(oauth.issuer, oauth.identity_claim)} if oauth is not None else set()
    budget = listeners_budget(config, options)
    scope = session_scope(config, options)
    try:
        async with (
            SandboxService.start(config, identities=identities, realms=realms, scope=scope) as service,
            metrics_port(config.metrics, options.metrics_port, config.http, budget),
        ):
            links = file_links(config, options) if http else None
            auth = authenticator.auth_arguments() if authenticator is not None else None
            server = build_server(
                service, auth=auth, file_links=links, metrics_access=metrics_access(config, authenticator)
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(stop_on_signal, tg.cancel_scope)
                if authenticator is None:
                    with serving_as(options.stdio_identity or LOCAL):
                        await _serve_stdio(server)
                    log.info("stdin closed; shutting down")
                else:
                    await _serve_http(server, config, options, authenticator, links, budget)
                tg.cancel_scope.cancel()
    finally:
        if authenticator is not None:
            await authenticator.aclose()
    log.info("shut down cleanly")
    return 0


def metrics_access(config: Config, authenticator: Authenticator | None) -> MetricsAccess | None:
    if authenticator is None:
        return None
    scope = authenticator.oauth.metrics_scope if authenticator.oauth is not None else None
    return MetricsAccess(config.metrics, authenticator, scope)


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


async def stop_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for received in signals:
            log.info("received %s; shutting down", signal.Signals(received).name)
            scope.cancel()
            return


async def _serve_http(
    server: Any,
    config: Config,
    options: ServeOptions,
    authenticator: Authenticator,
    links: FileLinks | None,
    budget: ConnectionBudget,
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
        counting_refusals(bearer_gate(app, authenticator.oauth)),
        host=options.host,
        port=options.port,
        log_level="warning",
        lifespan="on",
        backlog=budget.backlog(config.http.max_connections),
        http=guarded_protocol(config.http, client_of(authenticator, links), budget),
        timeout_keep_alive=5,
    )
    log.info("serving %s on http://%s:%d", options.transport, options.host, options.port)
    await serve_until_cancelled(QuietServer(uv_config))


__all__ = ["SandboxError", "ServeOptions", "serve"]
