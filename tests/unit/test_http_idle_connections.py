"""The HTTP guard's two deadlines between requests (``mcp_server/http/guard.py``), on a real uvicorn
listener on loopback: an idle connection waits ``keep_alive_s`` for the client's next request, longer
than clients keep theirs, and a request that began must finish its headers within ``header_timeout_s``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from mcp_code_exec.config.faces import HttpSettings
from mcp_code_exec.mcp_server.http.guard import guarded_protocol
from mcp_code_exec.mcp_server.http.listeners import QuietServer, serve_until_cancelled

pytestmark = pytest.mark.anyio
REQUEST = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"hi"})


@asynccontextmanager
async def listening(settings: HttpSettings) -> AsyncIterator[tuple[str, int]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections wait in the backlog until uvicorn serves: no readiness to poll
    config = uvicorn.Config(
        hello,
        log_config=None,
        lifespan="off",
        http=guarded_protocol(settings),
        timeout_keep_alive=settings.keep_alive_s,
    )
    server = QuietServer(config)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(serve_until_cancelled, server, [sock])
        yield sock.getsockname()
        tasks.cancel_scope.cancel()


async def answered(stream: anyio.abc.ByteStream) -> bytes:
    await stream.send(REQUEST)
    got = b""
    with anyio.fail_after(10):
        while not got.endswith(b"hi"):
            got += await stream.receive()
    return got


async def seconds_until_closed(stream: anyio.abc.ByteStream, bound: float) -> float:
    start = time.monotonic()
    with anyio.fail_after(bound):
        try:
            while await stream.receive():
                pass
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    return time.monotonic() - start


async def test_an_idle_connection_stays_open_for_keep_alive_s_past_the_header_deadline() -> None:
    settings = HttpSettings(header_timeout_s=0.2, keep_alive_s=2)
    async with listening(settings) as (host, port), await anyio.connect_tcp(host, port) as stream:
        assert (await answered(stream)).startswith(b"HTTP/1.1 200")
        assert await seconds_until_closed(stream, bound=10) >= settings.keep_alive_s  # timers never fire early


async def test_a_client_may_send_its_next_request_after_waiting_longer_than_the_header_deadline() -> None:
    settings = HttpSettings(header_timeout_s=0.2, keep_alive_s=30)
    async with listening(settings) as (host, port), await anyio.connect_tcp(host, port) as stream:
        await answered(stream)
        await anyio.sleep(0.5)  # idle past the header deadline, as a client's pool leaves a connection
        assert (await answered(stream)).startswith(b"HTTP/1.1 200")


async def test_a_request_whose_headers_stall_is_closed_at_the_header_deadline_not_the_keep_alive() -> None:
    settings = HttpSettings(header_timeout_s=0.2, keep_alive_s=600)
    async with listening(settings) as (host, port), await anyio.connect_tcp(host, port) as stream:
        await answered(stream)
        await stream.send(REQUEST[:10])
        await seconds_until_closed(stream, bound=10)  # keep_alive_s alone would take 600


async def test_a_connection_that_never_sends_a_request_is_closed_at_the_header_deadline() -> None:
    settings = HttpSettings(header_timeout_s=0.2, keep_alive_s=600)
    async with listening(settings) as (host, port), await anyio.connect_tcp(host, port) as stream:
        await seconds_until_closed(stream, bound=10)
