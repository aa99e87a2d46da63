"""The local service stdio fronts connect to: MCP over a unix socket, one MCP session per connection.

Every connection shares one ``SandboxService``, so the warm pool and the sessions outlive the fronts
(a client that starts a server per call, a desktop client restarting its servers). It listens before
that service has started, which ``late_service`` then starts in the background: docs/architecture.md
draws a client's first second. The wire is the stdio transport's (newline-delimited JSON-RPC),
after one hello line naming the client's identity. Only this OS user can connect: the socket is 0600
in a 0700 directory, and a peer of another uid (as ``SO_PEERCRED`` tells) is closed unanswered. The
identity in the hello is trusted for that reason: whoever runs as this user can reach the Docker
engine anyway.

The service exits after ``stdio.idle_exit_s`` with no connection and no run in flight (and, when
sessions are not durable, no open session), or on SIGTERM/SIGINT, removing its socket; its
sessions end as the server's always do (durable ones paused, kept on disk for the next service).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import SocketAttribute, SocketStream

from ...config.faces import StdioSettings
from ...config.settings import Config
from ..app import build_server, stop_on_signal
from ..http.listeners import raise_descriptor_limit
from ..identity import serving_as
from ..sdk import serve_streams
from .late_service import LateService, StartGate

log = logging.getLogger(__name__)
HELLO_WAIT_S = 10.0
HELLO_MAX_BYTES = 4096
IdentityOf = Callable[[str | None, int], str]  # (the name a hello asks for, the peer's uid) -> identity
Remember = Callable[[dict[str, Any], dict[str, Any]], None]  # (a request, the result it was answered)


@dataclass(frozen=True)
class LocalHooks:
    """What the local service asks of the process that runs it (``cli``'s daemon), and tells it."""

    identity_of: IdentityOf  # whom a connection serves: the name its hello asks for, the peer's uid
    on_listening: Callable[[], None]  # the socket listens; the SandboxService starts in the background
    on_ready: Callable[[str], None]  # hears "ready" once the SandboxService has started
    # Keeps each connection's answer to its first request (the handshake), for fronts to answer their
    # clients with at once (see ``commands.stdio.handshake``); it runs in a worker thread.
    remember: Remember | None = None


async def serve_local(config: Config, socket_path: Path, hooks: LocalHooks) -> int:
    """Serve until idle or signalled (``late_service`` starts the ``SandboxService`` in the background).
    A start that fails stops the service and is raised, once its waiting calls are told."""
    raise_descriptor_limit()  # as every server does: descriptors for the sessions and containers it holds
    late = LateService(config, start_wait_s(config.stdio, config.engine_wait_s))
    server = build_server(late)
    connections = _Connections()
    listener = await anyio.create_unix_listener(socket_path, mode=0o600)
    serving = anyio.CancelScope()
    try:
        hooks.on_listening()
        log.info("local service listening on %s (pid %d)", socket_path, os.getpid())
        async with anyio.create_task_group() as outer:
            await outer.start(stop_on_signal, serving)  # before the SandboxService starts anything
            outer.start_soon(late.run, hooks.on_ready, serving)
            with serving:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_exit_when_idle, late, connections, config.stdio.idle_exit_s, serving)

                    async def serve_one(stream: SocketStream) -> None:
                        await _serve_connection(server, late, stream, hooks, connections)

                    async with listener:
                        await listener.serve(serve_one, task_group=tg)
            outer.cancel_scope.cancel()  # stops the SandboxService (its sessions close, shielded) or its start
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
    if late.failure is not None:
        raise late.failure
    log.info("local service shut down cleanly")
    return 0


def start_wait_s(stdio: StdioSettings, engine_wait_s: float) -> float:
    """How long a call waits for the service's start: as long as a front waits for a service."""
    return stdio.start_timeout_s + engine_wait_s


class _Connections:
    def __init__(self) -> None:
        self.open = 0
        self.last_change = time.monotonic()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1
            self.last_change = time.monotonic()


async def _exit_when_idle(
    service: LateService, connections: _Connections, idle_exit_s: float, scope: anyio.CancelScope
) -> None:
    """A timer, not a synchronisation: every few seconds, see whether the service has been idle long enough."""
    idle_since: float | None = None
    while True:
        await anyio.sleep(min(5.0, idle_exit_s / 4))
        if connections.open or service.holds_work():
            idle_since = None
            continue
        now = time.monotonic()
        idle_since = max(idle_since or now, connections.last_change)
        if now - idle_since >= idle_exit_s:
            log.info("no connection and nothing live for %.0f s; exiting", idle_exit_s)
            scope.cancel()
            return


async def _serve_connection(
    server: Any, late: LateService, stream: SocketStream, hooks: LocalHooks, connections: _Connections
) -> None:
    async with stream:
        uid = _peer_uid(stream)
        if uid != os.geteuid():
            log.warning("refused a connection from uid %s: only uid %d may connect", uid, os.geteuid())
            return
        lines = _Lines(stream)
        try:
            with anyio.fail_after(HELLO_WAIT_S):
                first = await lines.next_line(HELLO_MAX_BYTES)
            identity = hooks.identity_of(_hello_name(first), uid)
        except (TimeoutError, ValueError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(json.dumps({"ok": False, "error": str(exc) or "no hello"}).encode() + b"\n")
            return
        await stream.send(b'{"ok": true}\n')
        with connections.held(), serving_as(identity):
            log.debug("a client connected as %s", identity)
            writer = _Writer(stream, lines, hooks.remember)
            await serve_streams(server, StartGate(lines, late, writer), writer)


def _peer_uid(stream: SocketStream) -> int | None:
    raw: socket.socket = stream.extra(SocketAttribute.raw_socket)  # noqa: S610 - anyio's typed attribute, not Django
    try:
        _pid, uid, _gid = struct.unpack("3i", raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        return None
    return int(uid)


def _hello_name(line: bytes) -> str | None:
    try:
        hello = json.loads(line)
    except ValueError:
        raise ValueError("the first line must be the hello (JSON)") from None
    if not isinstance(hello, dict) or hello.get("hello") != 1:
        raise ValueError('the first line must be the hello: {"hello": 1, "identity": ...}')
    name = hello.get("identity")
    if name is not None and not isinstance(name, str):
        raise ValueError("identity must be a string or null")
    return name


class _Lines:
    """The connection's lines (the stdio transport's framing), the hello's included."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.pending = bytearray()
        self.ended = False
        self.first: str | None = None  # the first line after the hello: the client's first request

    async def next_line(self, limit: int | None = None) -> bytes:
        searched = 0  # a long line comes in many reads: each read's bytes are searched once
        while (end := self.pending.find(b"\n", searched)) == -1:
            searched = len(self.pending)
            if limit is not None and len(self.pending) > limit:
                raise ValueError("the hello is too long")
            if self.ended:
                raise anyio.EndOfStream
            try:
                self.pending += await self.stream.receive(1 << 20)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                self.ended = True
        line = bytes(self.pending[: end + 1])
        del self.pending[: end + 1]
        return line

    def __aiter__(self) -> AsyncIterator[str]:
        return self._text_lines()

    async def _text_lines(self) -> AsyncIterator[str]:
        while True:
            try:
                line = (await self.next_line()).decode("utf-8", "replace")
            except anyio.EndOfStream:
                line = self.pending.decode("utf-8", "replace")
                if not line:
                    return
                self.pending.clear()
            if self.first is None:
                self.first = line
            yield line


def _request(line: str) -> dict[str, Any] | None:
    try:
        request = json.loads(line)
    except ValueError:
        return None
    return request if isinstance(request, dict) and "method" in request and "id" in request else None


class _Writer:
    """What the stdio transport writes to: the connection (a client gone is an ended write). It also
    hands ``remember`` the answer to the connection's first request (``lines.first``), if it is one."""

    def __init__(self, stream: SocketStream, lines: _Lines, remember: Remember | None = None) -> None:
        self.stream = stream
        self.lines = lines
        self.lock = anyio.Lock()  # the transport and the start gate both write whole lines
        self.remember = remember
        self.expecting: dict[str, Any] | None = None
        self.settled = remember is None  # the first request's answer was remembered, or there is none to

    async def write(self, text: str) -> None:
        async with self.lock:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await self.stream.send(text.encode("utf-8"))
        if not self.settled and self.lines.first is not None:
            self.expecting = self.expecting or _request(self.lines.first)
            if self.expecting is None:
                self.settled = True  # the first line was no request (a notification): nothing to keep
            else:
                await self._remember_if_answer(self.expecting, text)

    async def _remember_if_answer(self, request: dict[str, Any], text: str) -> None:
        try:
            answer = json.loads(text)
        except ValueError:
            return
        if not isinstance(answer, dict) or answer.get("id") != request["id"] or "method" in answer:
            return  # not the answer (a notification before it, or a request of the server's)
        self.settled = True
        result = answer.get("result")
        if self.remember is not None and isinstance(result, dict):
            await anyio.to_thread.run_sync(self.remember, request, result)

    async def flush(self) -> None:
        return None
