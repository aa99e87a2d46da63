"""File URLs over HTTP: ``GET /files/{token}`` streams a session's file out, ``PUT`` (or ``POST``)
with a raw body streams one in.

The token is the capability (see ``file_tokens``): no bearer token is asked for, but the Host and
Origin checks of the MCP endpoints apply, and the body cap of those endpoints does not (uploads
have their own, ``files.max_upload_mb``, and the session's quota). Bytes move a chunk at a time
both ways (the service's ``read_stream``/``write_stream``): the server holds about a chunk of a
file at a time whatever its size, and a slow client slows the transfer down, never grows the
server; a client that moves nothing for ``files.stall_timeout_s`` is dropped.

Answers: 200 and the bytes (GET), or 201 and the file's path, size and URI as JSON (PUT/POST);
404 an unknown token, a closed session, a missing file; 403 an expired or spent token; 405 the
wrong method for the URL; 409 a URL another request is using, a session busy with a run (at
once) or held by another transfer past ``files.busy_wait_s``, or a write refused (a directory in
the way, permissions); 413 over the upload cap; 507 over the session's quota; 408 a client that
stopped sending; 503 a sandbox that failed meanwhile; 421/403 a wrong Host/Origin. A download
that fails after its first byte can only end its connection early (short of Content-Length).
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass

import anyio
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from ...config.faces import FileSettings
from ...errors import FileOperationError, SandboxError
from ...observability import metrics
from ...observability.tracing import traced
from ...service.port import ServicePort
from .file_tokens import Direction, FileTokens, Grant, TokenRefused, WrongDirection

log = logging.getLogger(__name__)
HOST = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,300}")
FILES_PREFIX = "/files/"  # and the token: the route's path
Notify = Callable[[str, list[str]], Awaitable[None]]


class ClientGone(Exception):
    """The client closed the connection mid-upload."""


@dataclass
class FileLinks:
    """What the file_url tool and the route share: the tokens, the settings, the URLs' base."""

    tokens: FileTokens
    settings: FileSettings
    security: TransportSecuritySettings
    fallback_base: str  # http://host:port the server listens on
    max_upload_bytes: int  # files.max_upload_mb, or the sandbox's file-size limit when lower

    @property
    def ttl_s(self) -> float:
        return self.tokens.ttl_s

    def issue(self, identity: str, session_id: str, path: str, direction: Direction) -> str:
        return self.tokens.issue(identity, session_id, path, direction)

    def url(self, token: str, headers: Mapping[str, str] | None) -> str:
        return f"{self.base_url(headers)}{FILES_PREFIX}{token}"

    def base_url(self, headers: Mapping[str, str] | None) -> str:
        """``public_base_url``; else the Host the client used (when it is one the server accepts)."""
        if self.settings.public_base_url:
            return self.settings.public_base_url.rstrip("/")
        host = (headers or {}).get("host")
        if host and HOST.fullmatch(host) and host_allowed(host, self.security.allowed_hosts):
            return f"http://{host}"
        return self.fallback_base


def host_allowed(host: str, allowed: list[str]) -> bool:
    """The SDK's rule for allowed Host values: exact, or ``name:*`` for any port."""
    return host in allowed or any(a.endswith(":*") and host.startswith(a[:-2] + ":") for a in allowed)


class FileRoute:
    """The ASGI app behind ``/files/{token}``."""

    def __init__(self, service: ServicePort, links: FileLinks, notify: Notify) -> None:
        self.service = service
        self.links = links
        self.notify = notify
        self.guard = TransportSecurityMiddleware(links.security)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = await self.guard.validate_request(Request(scope, receive))
        if refused is not None:
            await refused(scope, receive, send)
            return
        direction: Direction = "download" if scope["method"] in ("GET", "HEAD") else "upload"
        token = str(scope["path_params"].get("token", ""))
        try:
            grant = self.links.tokens.claim(token, direction)
        except TokenRefused as exc:
            allow = (
                {"Allow": "PUT, POST" if direction == "download" else "GET"} if isinstance(exc, WrongDirection) else {}
            )
            await answer(send, exc.status, exc.message, allow)
            return
        try:
            if direction == "download":
                await self.download(grant, receive, send, head=scope["method"] == "HEAD")
            else:
                await self.upload(grant, Headers(scope=scope), receive, send)
        finally:
            self.links.tokens.release(token)

    @traced("mcpx.file.transfer", direction="out", way="url")
    async def download(self, grant: Grant, receive: Receive, send: Send, *, head: bool = False) -> None:
        started = False
        try:
            busy_wait_s = self.links.settings.busy_wait_s
            async with self.service.read_stream(
                grant.identity, grant.session_id, grant.path, busy_wait_s=busy_wait_s
            ) as found:
                headers = {
                    "Content-Type": "application/octet-stream",
                    "Content-Length": str(found.size),
                    "Content-Disposition": disposition(found.path),
                    **PRIVATE,
                }
                await send({"type": "http.response.start", "status": 200, "headers": encode(headers)})
                started = True
                if head:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_on_disconnect, receive, tg.cancel_scope)
                    async for chunk in found.chunks():
                        with anyio.fail_after(self.links.settings.stall_timeout_s):
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        metrics.file_bytes("out", "url", len(chunk))
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    tg.cancel_scope.cancel()
        except (SandboxError, TimeoutError) as exc:
            if started:  # the connection ends short of Content-Length: the client sees a failed download
                log.warning("a download through a file URL ended early: %s", exc)  # (never the path)
                return
            await answer(send, status_of(exc, "download"), str(exc))

    @traced("mcpx.file.transfer", direction="in", way="url")
    async def upload(self, grant: Grant, headers: Headers, receive: Receive, send: Send) -> None:
        cap = self.links.max_upload_bytes
        declared = headers.get("content-length")
        if declared is not None and not declared.isdigit():
            await answer(send, 400, "Content-Length is not a number")
            return
        expected = int(declared) if declared is not None else None
        if expected is not None and expected > cap:
            await answer(send, 413, f"{expected} bytes is over the upload cap of {cap} bytes; nothing was written")
            return
        body = request_body(receive, self.links.settings.stall_timeout_s)
        audit, outcome, written = None, "ok", 0
        try:
            audit = self.service.accounting.audit
            audit.require()  # a log that must record the upload and cannot: refused before a byte is written
            info = await self.service.write_stream(
                grant.identity,
                grant.session_id,
                grant.path,
                body,
                max_bytes=cap,
                expected_size=expected,
                busy_wait_s=self.links.settings.busy_wait_s,
            )
            written = info.size
        except ClientGone:
            outcome = "error: ClientGone"
            return
        except (SandboxError, TimeoutError) as exc:
            outcome = f"error: {type(exc).__name__}"
            await answer(send, status_of(exc, "upload"), str(exc))
            return
        finally:
            await body.aclose()
            if audit is not None:
                who = {"identity": grant.identity, "session": grant.session_id}
                audit.record("file_upload", **who, bytes=written, outcome=outcome)
        metrics.file_bytes("in", "url", info.size)
        if info.uri is not None:
            await self.notify(grant.identity, [info.uri])
        await answer(send, 201, info.model_dump_json(), content_type="application/json")


PRIVATE = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",  # the URL is a capability: no Referer may carry it elsewhere
    "X-Content-Type-Options": "nosniff",
}


def status_of(exc: SandboxError | TimeoutError, direction: Direction) -> int:
    """The error's own ``http_status``; 408 for a client that stalled, and 404 for a read the agent
    refused (no such file to give, where a refused write conflicts with what is there)."""
    if isinstance(exc, TimeoutError):
        return 408
    if direction == "download" and type(exc) is FileOperationError:
        return 404
    return exc.http_status


async def request_body(receive: Receive, stall_s: float) -> AsyncGenerator[bytes, None]:
    """The request's body as it arrives; ``TimeoutError`` when the client stalls."""
    while True:
        with anyio.fail_after(stall_s):
            message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        data = message.get("body", b"")
        if data:
            yield data
        if not message.get("more_body", False):
            return


async def cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def disposition(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    plain = "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "_" for c in name)
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{urllib.parse.quote(name, safe='')}"


def encode(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(key.lower().encode("latin-1"), value.encode("latin-1")) for key, value in headers.items()]


async def answer(
    send: Send, status: int, text: str, headers: dict[str, str] | None = None, *, content_type: str = ""
) -> None:
    body = (text if content_type else text + "\n").encode()
    fields = {"Content-Type": content_type or "text/plain; charset=utf-8", "Content-Length": str(len(body))}
    await send(
        {"type": "http.response.start", "status": status, "headers": encode({**fields, **PRIVATE, **(headers or {})})}
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
