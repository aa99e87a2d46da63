"""The HTTP guard between requests (``mcp_server/http/guard.py``), on a real uvicorn listener on
loopback configured as the server's are (``guarded_config``): an idle connection waits
``keep_alive_s`` for the client's next request, longer than clients keep theirs; a request that began
must finish its headers within ``header_timeout_s``; and no connection leaves the guard's count.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from starlette.types import Receive, Scope, Send

from mcp_code_exec.config.faces import HttpSettings
from mcp_code_exec.mcp_server.http.guard import guarded_config
from mcp_code_exec.mcp_server.http.listeners import ConnectionBudget, QuietServer, serve_until_cancelled

pytestmark = pytest.mark.anyio
REQUEST = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "websocket":  # what Starlette answers for a WebSocket route it lacks
        await send({"type": "websocket.close", "code": 1000})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"hi"})


@asynccontextmanager
async def listening(settings: HttpSettings, budget: ConnectionBudget | None = None) -> AsyncIterator[tuple[str, int]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections wait in the backlog until uvicorn serves: no readiness to poll
    config = guarded_config(hello, settings, budget=budget, log_config=None, lifespan="off")
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


async def test_a_request_begun_in_the_same_packet_as_the_last_must_finish_its_headers_in_time() -> None:
    settings = HttpSettings(header_timeout_s=0.2, keep_alive_s=600)
    async with listening(settings) as (host, port), await anyio.connect_tcp(host, port) as stream:
        await stream.send(REQUEST + REQUEST[:10])  # the next request's first bytes wait in the parser
        await seconds_until_closed(stream, bound=10)  # keep_alive_s alone would take 600


async def test_a_websocket_upgrade_leaves_no_connection_counted_in_the_budget() -> None:
    budget = ConnectionBudget(64)
    upgrade = (
        b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    async with listening(HttpSettings(keep_alive_s=1), budget) as (host, port):
        for _ in range(5):
            async with await anyio.connect_tcp(host, port) as stream:
                await stream.send(upgrade)
                assert not (await stream.receive()).startswith(b"HTTP/1.1 101")
        with anyio.fail_after(10):
            while budget.open:  # noqa: ASYNC110 - the server hears of each close on its own turn
                await anyio.sleep(0.01)  # pacing of the poll; the count is the synchronisation
