"""Answers a client never reads do not hold its connections, nor the server's memory, for ever.

A client asks for megabytes (read_file) on every connection of its share and reads none of them:
past ``http.response_timeout_s`` (and the minimum rate) the connections are aborted, what waited for
them dropped, and the client is served again.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from _support import ServerProcess, make_test_config, wait_until
from test_security_connections import ACCEPT, CONFIG, INITIALIZE, TOKENS, call, closing_all, connect, initialize

pytestmark = pytest.mark.anyio


# -- answers the client never reads --------------------------------------------------------------------------
UNREAD_SHARE = 3
UNREAD_CONFIG = CONFIG.replace("[http]\n", "[http]\nresponse_timeout_s = 2\nresponse_min_rate_kib_s = 1\n")


def mcp_session(server: ServerProcess) -> str:
    """Alice's MCP session, initialized (2025-06-18), for raw requests."""
    headers = {"Authorization": f"Bearer {TOKENS['alice']}", "Accept": ACCEPT, "Content-Type": "application/json"}
    started = httpx2.post(f"{server.url}/mcp", content=INITIALIZE, headers=headers, timeout=30)
    assert started.status_code == 200, started.text
    session = str(started.headers["mcp-session-id"])
    headers |= {"Mcp-Session-Id": session, "Mcp-Protocol-Version": "2025-06-18"}
    ready = json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert httpx2.post(f"{server.url}/mcp", content=ready, headers=headers, timeout=30).status_code == 202
    return session


def unread_read_file(server: ServerProcess, session: str, sid: str) -> socket.socket:
    """A tools/call read_file of megabytes whose answer is never read: the server holds what the
    socket does not take, and the connection counts for alice."""
    arguments = {"session_id": sid, "path": "mid.bin"}
    body = json.dumps(
        {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "read_file", "arguments": arguments}}
    )
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.sendall(
        (
            f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {TOKENS['alice']}\r\n"
            f"Content-Type: application/json\r\nAccept: {ACCEPT}\r\nMcp-Session-Id: {session}\r\n"
            f"Mcp-Protocol-Version: 2025-06-18\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
    )
    return conn


async def test_answers_a_client_never_reads_are_dropped_and_free_its_connections(service: Any, tmp_path: Path) -> None:
    """docs/security.md#one-client-holding-the-connections: a client that asks for megabytes
    (read_file) on every connection of its share and reads none of it holds them only until
    ``http.response_timeout_s``: the connections are aborted (what waited for them dropped), and
    the client is served again."""
    path = tmp_path / "config.toml"
    path.write_text(UNREAD_CONFIG.format(image=make_test_config().image, share=UNREAD_SHARE, **TOKENS))
    async with ServerProcess("streamable-http", args=["--config", str(path)]) as server:
        async with connect(server) as alice:
            sid = str((await call(alice, "new_session"))["session_id"])
            await call(
                alice, "run_python", code="open('/mnt/data/mid.bin', 'wb').write(bytes(8 << 20))", session_id=sid
            )
        session = await anyio.to_thread.run_sync(mcp_session, server)
        unread = [await anyio.to_thread.run_sync(unread_read_file, server, session, sid) for _ in range(UNREAD_SHARE)]
        with closing_all(unread):
            # Without the deadline the unread answers hold alice's share (and their megabytes) for
            # as long as she keeps the connections: 429 for ever.
            await wait_until(lambda: initialize(server, "alice").status_code == 200, 45, every_s=0.5)
