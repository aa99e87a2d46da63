"""One client, or one file URL, cannot hold every connection of the real HTTP server (issue 23).

A body trickled past ``http.body_timeout_s`` is cut with 408 and frees its connection; a file URL
serves one transfer at a time; a transfer finds its session held (by another transfer, or by a run
waiting behind one) and is answered 409 within ``files.busy_wait_s`` instead of queueing for the
stall timeout; a client past ``http.max_connections_per_client`` connections (a file URL counting
for the client that asked for it) gets 429 while another client is still served.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any

import anyio
import httpx2
import pytest
from _support import ServerProcess, client_with_token, make_test_config, structured_call, wait_until
from anyio.abc import SocketStream
from mcp import Client

pytestmark = pytest.mark.anyio
TOKENS = {"alice": "alice-conn-4e1b", "bob": "bob-conn-a7d3"}
SHARE = 6
CONFIG = """
image = "{image}"
[limits]
memory_mb = 256
default_timeout_s = 30
max_run_s = 60
[pool]
size = 1
session_spares = 1
acquire_timeout_s = 30
[sessions]
durable = false  # its sessions end with the server: nothing is left on the engine
[http]
body_timeout_s = 3
body_min_rate_kib_s = 1
max_connections_per_client = {share}
[http.tokens]
alice = "{alice}"
bob = "{bob}"
"""
ACCEPT = "application/json, text/event-stream"
INITIALIZE = json.dumps(
    {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
)
BIG = 64 << 20  # far more than the socket buffers hold: a download of it that is never read stays in progress


@pytest.fixture(scope="module")
async def server(service: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServerProcess]:
    # (The suite's shared service is set up first: see test_security_leftovers.one_container.)
    path = tmp_path_factory.mktemp("connections") / "config.toml"
    path.write_text(CONFIG.format(image=make_test_config().image, share=SHARE, **TOKENS))
    async with ServerProcess("streamable-http", args=["--config", str(path)]) as running:
        yield running


def connect(server: ServerProcess, who: str = "alice") -> AbstractAsyncContextManager[Client]:
    return client_with_token(server, TOKENS[who])


call = structured_call


async def url(client: Client, sid: str, path: str, direction: str = "download") -> str:
    return str((await call(client, "file_url", session_id=sid, path=path, direction=direction))["url"])


async def session_with_a_big_file(client: Client) -> str:
    sid = str((await call(client, "new_session"))["session_id"])
    await call(client, "run_python", code=f"open('/mnt/data/big.bin', 'wb').truncate({BIG})", session_id=sid)
    return sid


def initialize(server: ServerProcess, who: str) -> httpx2.Response:
    headers = {"Authorization": f"Bearer {TOKENS[who]}", "Accept": ACCEPT, "Content-Type": "application/json"}
    return httpx2.post(f"{server.url}/mcp", content=INITIALIZE, headers=headers, timeout=30)


# -- the attacking clients ----------------------------------------------------------------------------------
async def first_line(stream: SocketStream) -> bytes:
    received = b""
    while b"\r\n" not in received:
        received += await stream.receive()
    return received.split(b"\r\n", 1)[0]


async def slow_post(server: ServerProcess, who: str, length: int) -> SocketStream:
    """A POST /mcp whose headers are in and whose body has not started: admitted once the server
    asks for the body (100 Continue); a refused one (429) is tried again (the client's earlier
    connections may not be closed on the server's side yet)."""
    head = (
        f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {TOKENS[who]}\r\n"
        f"Content-Type: application/json\r\nAccept: {ACCEPT}\r\nContent-Length: {length}\r\n"
        "Expect: 100-continue\r\n\r\n"
    ).encode()
    while True:
        stream = await anyio.connect_tcp("127.0.0.1", server.port)
        await stream.send(head)
        status = await first_line(stream)
        if status.startswith(b"HTTP/1.1 100"):
            return stream
        await stream.aclose()
        assert status.startswith(b"HTTP/1.1 429"), status
        await anyio.sleep(0.1)  # pacing of the retry; the answer is the synchronisation


async def trickle(stream: SocketStream, piece: bytes, every_s: float, stop: anyio.Event) -> None:
    """The attack: a little of the body, a pause, again, until the server answers or hangs up."""
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        while not stop.is_set():
            await stream.send(piece)
            with anyio.move_on_after(every_s):
                await stop.wait()


async def answer_to_end(stream: SocketStream, heard: anyio.Event) -> bytes:
    received = b""
    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
        while True:
            received += await stream.receive()
            heard.set()
    heard.set()
    return received


def never_read(download: str, port: int) -> tuple[socket.socket, bytes]:
    """GET a download and read its status line and headers, then nothing more: the server's send
    blocks once the socket buffers are full, and the transfer stays in progress."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=20)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    path = download.split(f"127.0.0.1:{port}", 1)[1]
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    received = b""
    while b"\r\n\r\n" not in received and (byte := conn.recv(1)):
        received += byte
    return conn, received.split(b"\r\n", 1)[0]


async def held_download(download: str, port: int) -> socket.socket:
    """``never_read`` until it is admitted (200); a 429 is tried again, as in ``slow_post``."""
    while True:
        conn, status = await anyio.to_thread.run_sync(never_read, download, port)
        if status == b"HTTP/1.1 200 OK":
            return conn
        conn.close()
        assert status.startswith(b"HTTP/1.1 429"), status
        await anyio.sleep(0.1)  # pacing of the retry; the answer is the synchronisation


@contextmanager
def closing_all(sockets: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield sockets
    finally:
        for conn in sockets:
            conn.close()


# -- a body trickled past its deadline ------------------------------------------------------------------------
async def test_a_body_trickled_past_its_deadline_gets_408_and_frees_its_connection(server: ServerProcess) -> None:
    answers: list[bytes] = []

    async def attack(stream: SocketStream) -> None:
        heard = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(trickle, stream, b" ", 0.5, heard)  # a byte every half second, of 1000 announced
            answers.append(await answer_to_end(stream, heard))

    with anyio.fail_after(60):
        streams = [await slow_post(server, "alice", 1000) for _ in range(SHARE)]
        try:
            over = await anyio.to_thread.run_sync(initialize, server, "alice")
            assert over.status_code == 429, over.text  # the trickles hold all of alice's connections
            async with anyio.create_task_group() as tg:
                for stream in streams:
                    tg.start_soon(attack, stream)
        finally:
            for stream in streams:
                await stream.aclose()
    assert len(answers) == SHARE
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"did not arrive in time" in answer, answer
    served = await anyio.to_thread.run_sync(initialize, server, "alice")
    assert served.status_code == 200, served.text


# -- one transfer per URL; a held session answers busy -------------------------------------------------------
async def test_a_download_url_already_in_transfer_answers_409_at_once(server: ServerProcess) -> None:
    async with connect(server) as alice, httpx2.AsyncClient(timeout=30) as http:
        sid = await session_with_a_big_file(alice)
        try:
            download = await url(alice, sid, "big.bin")
            with anyio.fail_after(20):  # far less than files.stall_timeout_s (60 s), which the first would last
                holder, status = await anyio.to_thread.run_sync(never_read, download, server.port)
                with closing_all([holder]):
                    assert status == b"HTTP/1.1 200 OK", status
                    second = await http.get(download)
                    assert second.status_code == 409, second.text
                    assert "in use by another transfer" in second.text, second.text
                    assert (await http.head(download)).status_code == 409  # (a HEAD answer has no body)
            # Its transfer over, the URL works again.
            await wait_until(lambda: httpx2.head(download, timeout=10).status_code == 200, 30, every_s=0.2)
        finally:
            await alice.call_tool("close_session", {"session_id": sid})


async def test_a_transfer_finding_its_session_held_is_answered_busy_instead_of_queueing(
    server: ServerProcess,
) -> None:
    async with connect(server) as alice, httpx2.AsyncClient(timeout=30) as http:
        sid = await session_with_a_big_file(alice)
        try:
            download, other = await url(alice, sid, "big.bin"), await url(alice, sid, "big.bin")
            upload = await url(alice, sid, "in.txt", "upload")
            holder, status = await anyio.to_thread.run_sync(never_read, download, server.port)
            with closing_all([holder]):
                assert status == b"HTTP/1.1 200 OK", status
                with anyio.fail_after(20):  # files.busy_wait_s is 2 s; the holder lasts the stall timeout, 60 s
                    for busy in (await http.get(other), await http.put(upload, content=b"x")):
                        assert busy.status_code == 409, busy.text
                        assert "busy with another file transfer" in busy.text, busy.text
                    # A run started now waits for the session behind the transfer; transfers are
                    # then told about the run, at once.
                    run = await call(alice, "run_python", code="print('after')", session_id=sid, wait=0)
                    behind = await http.get(other)
                    assert behind.status_code == 409, behind.text
                    assert f"busy with run '{run['run_id']}'" in behind.text, behind.text
            with anyio.fail_after(60):  # the holder gone, its transfer ends and the run goes ahead
                done = await call(alice, "get_run", run_id=run["run_id"], wait=50)
            assert done["status"] == "ok" and done["stdout"] == "after\n", done
            assert (await http.head(other)).status_code == 200
        finally:
            await alice.call_tool("close_session", {"session_id": sid})


# -- one client's share of connections ------------------------------------------------------------------------
async def test_a_client_past_its_connection_share_gets_429_while_another_is_served(server: ServerProcess) -> None:
    async with connect(server) as alice:
        sid = await session_with_a_big_file(alice)
        download, another = await url(alice, sid, "big.bin"), await url(alice, sid, "big.bin")
    holder: socket.socket | None = None
    streams: list[SocketStream] = []
    try:
        with anyio.fail_after(90):
            holder = await held_download(download, server.port)  # a file URL counts for alice, who made it
            for _ in range(SHARE - 1):
                streams.append(await slow_post(server, "alice", 10 << 20))
            async with anyio.create_task_group() as tg:
                stop = anyio.Event()
                for stream in streams:  # bodies that keep coming, far above the minimum rate: slow, not stalled
                    tg.start_soon(trickle, stream, b" " * 4096, 0.25, stop)
                refused = await anyio.to_thread.run_sync(initialize, server, "alice")
                assert refused.status_code == 429, refused.text
                assert "too many connections open for this client" in refused.text
                refused_url = await anyio.to_thread.run_sync(lambda: httpx2.get(another, timeout=30))
                assert refused_url.status_code == 429, refused_url.text
                other = await anyio.to_thread.run_sync(initialize, server, "bob")
                assert other.status_code == 200, other.text
                async with connect(server, "bob") as bob:
                    answered = await call(bob, "run_python", code="print('bob')")
                assert answered["stdout"] == "bob\n", answered
                stop.set()
        if holder is not None:
            holder.close()
        for stream in streams:
            await stream.aclose()
        # Alice's connections closed, she is served again.
        await wait_until(lambda: initialize(server, "alice").status_code == 200, 30, every_s=0.2)
    finally:
        if holder is not None:
            holder.close()
        for stream in streams:
            await stream.aclose()
        async with connect(server) as alice:
            await alice.call_tool("close_session", {"session_id": sid})


def refused_then_kept(download: str, port: int) -> tuple[socket.socket, list[bytes]]:
    """Whoever holds a file URL (no token): a PUT to a download URL (405), then a request that names
    no client (/healthz), on one kept-alive connection."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=20)
    path = download.split(f"127.0.0.1:{port}", 1)[1]
    host = f"Host: 127.0.0.1:{port}\r\n"
    received, statuses = b"", []
    for request in (f"PUT {path} HTTP/1.1\r\n{host}Content-Length: 0\r\n\r\n", f"GET /healthz HTTP/1.1\r\n{host}\r\n"):
        conn.sendall(request.encode())
        while b"\r\n\r\n" not in received and (byte := conn.recv(1)):
            received += byte
        head, _, received = received.partition(b"\r\n\r\n")
        if not head:  # the server closed the connection
            statuses.append(b"closed")
            break
        lengths = [line[15:] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
        length = int(lengths[0]) if lengths else 0
        while len(received) < length and (chunk := conn.recv(length - len(received))):
            received += chunk
        received = received[length:]
        statuses.append(head.split(b"\r\n", 1)[0])
    return conn, statuses


async def test_a_file_urls_holder_cannot_keep_connections_counting_for_its_issuer(server: ServerProcess) -> None:
    """docs/security.md#one-client-holding-the-connections: a file URL counts for its issuer only
    while its request runs; requests it refuses, and whatever follows on the connection, do not."""
    async with connect(server) as alice:
        sid = await session_with_a_big_file(alice)
        try:
            download = await url(alice, sid, "big.bin")
            with anyio.fail_after(60):
                held = [await anyio.to_thread.run_sync(refused_then_kept, download, server.port) for _ in range(SHARE)]
                with closing_all([conn for conn, _ in held]):
                    for _, statuses in held:  # none of them counts for alice once answered: none gets 429
                        assert statuses == [b"HTTP/1.1 405 Method Not Allowed", b"HTTP/1.1 200 OK"], statuses
                    served = await anyio.to_thread.run_sync(initialize, server, "alice")
                    assert served.status_code == 200, served.text
        finally:
            await alice.call_tool("close_session", {"session_id": sid})
