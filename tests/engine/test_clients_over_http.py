"""Several clients of one HTTP server (docs/security.md#clients-of-one-server), and sessions across connections.

One server, two bearer tokens (alice, bob). A token is an identity on every connection and in
both protocol eras; nothing of one identity reaches the other; neither can take every session
slot or warm container; and a flood of connections that never finish cannot lock clients out.
"""

from __future__ import annotations

import resource
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from _support import ServerProcess, make_test_config, wait_until
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

pytestmark = pytest.mark.anyio
TOKENS = {"alice": "alice-token-5f2c", "bob": "bob-token-91ad"}
CONFIG = """
image = "{image}"
[limits]
memory_mb = 256
default_timeout_s = 20
max_run_s = 120
wait_s = 5
[pool]
size = 2
max_size = 4
max_runs_per_client = 2
grow_after_s = 0.5
acquire_timeout_s = 4
session_spares = 1
[sessions]
max_sessions = 5
max_per_client = 2
durable = false  # its sessions end with the server: nothing is left on the engine
[http]
header_timeout_s = 3
[http.tokens]
alice = "{alice}"
bob = "{bob}"
"""


@pytest.fixture(scope="module")
async def server(service: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServerProcess]:
    # (The suite's shared service is set up first: see test_security_leftovers.one_container.)
    path = tmp_path_factory.mktemp("http") / "config.toml"
    path.write_text(CONFIG.format(image=make_test_config().image, **TOKENS))
    async with ServerProcess("streamable-http", args=["--config", str(path)]) as running:
        yield running


@asynccontextmanager
async def connect(server: ServerProcess, who: str, mode: str = "auto") -> AsyncIterator[Client]:
    """A new connection (a new HTTP client and MCP client) as ``who``."""
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKENS[who]}"}, timeout=60)
    async with http, Client(streamable_http_client(f"{server.url}/mcp", http_client=http), mode=mode) as client:
        yield client


def structured(result: Any) -> dict[str, Any]:
    assert result.structured_content is not None, result
    return dict(result.structured_content)


def text(result: Any) -> str:
    return str(result.content[0].text)


async def test_a_token_reaches_its_session_and_run_files_from_any_connection_in_both_eras(
    server: ServerProcess,
) -> None:
    async with connect(server, "alice", "legacy") as first:
        sid = structured(await first.call_tool("new_session", {}))["session_id"]
        await first.call_tool("run_python", {"code": "kept = 'from the first connection'", "session_id": sid})
        await first.call_tool("write_file", {"session_id": sid, "path": "notes.txt", "content": "n"})
        made = structured(await first.call_tool("run_python", {"code": "open('/mnt/data/out.txt', 'w').write('x')"}))
    try:
        for mode in ("auto", "legacy"):  # each a new connection, as LangChain and the Inspector CLI make
            async with connect(server, "alice", mode) as later:
                kept = structured(await later.call_tool("run_python", {"code": "kept", "session_id": sid}))
                assert kept["result"] == "'from the first connection'", (mode, kept)
                read = await later.call_tool("read_file", {"run_id": made["run_id"], "path": "out.txt"})
                assert text(read) == "x", (mode, read)
                listed = [str(r.uri) for r in (await later.list_resources()).resources]
                assert f"sandbox://sessions/{sid}/files/notes.txt" in listed, (mode, listed)
    finally:
        async with connect(server, "alice") as last:
            await last.call_tool("close_session", {"session_id": sid})


async def test_another_token_sees_nothing_of_it(server: ServerProcess) -> None:
    async with connect(server, "alice") as alice, connect(server, "bob", "legacy") as bob:
        sid = structured(await alice.call_tool("new_session", {}))["session_id"]
        made = structured(await alice.call_tool("run_python", {"code": "open('/mnt/data/s.txt', 'w').write('x')"}))
        slow = structured(await alice.call_tool("run_python", {"code": "import time; time.sleep(5)", "wait": 0}))
        try:
            for tool, arguments, refusal in [
                ("run_python", {"code": "1", "session_id": sid}, f"no such session: '{sid}'"),
                ("list_files", {"session_id": sid}, f"no such session: '{sid}'"),
                ("write_file", {"session_id": sid, "path": "a", "content": "x"}, f"no such session: '{sid}'"),
                ("close_session", {"session_id": sid}, f"no such session: '{sid}'"),
                ("read_file", {"run_id": made["run_id"], "path": "s.txt"}, f"no such run: '{made['run_id']}'"),
                ("get_run", {"run_id": slow["run_id"]}, f"no such run: '{slow['run_id']}'"),
                ("cancel_run", {"run_id": slow["run_id"]}, f"no such run: '{slow['run_id']}'"),
            ]:
                result = await bob.call_tool(tool, arguments)
                assert result.is_error and refusal in text(result), (tool, result)
            uris = [str(r.uri) for r in (await bob.list_resources()).resources]
            assert not any(sid in uri or made["run_id"] in uri for uri in uris), uris
            with pytest.raises(MCPError):
                await bob.read_resource(made["files"][0]["uri"])
            with pytest.raises(MCPError):  # 2025-era subscription to someone else's file
                await bob.session.subscribe_resource(f"sandbox://sessions/{sid}/files/a")
        finally:
            await alice.call_tool("close_session", {"session_id": sid})


async def test_change_events_reach_only_their_own_identity(server: ServerProcess) -> None:
    async with connect(server, "alice") as alice, connect(server, "bob") as bob:
        alice_sid = structured(await alice.call_tool("new_session", {}))["session_id"]
        bob_sid = structured(await bob.call_tool("new_session", {}))["session_id"]
        alice_uri = f"sandbox://sessions/{alice_sid}/files/a.txt"
        bob_uri = f"sandbox://sessions/{bob_sid}/files/b.txt"
        try:
            with anyio.fail_after(60):
                async with bob.listen(
                    resources_list_changed=True, resource_subscriptions=[alice_uri, bob_uri]
                ) as heard:
                    await alice.call_tool("write_file", {"session_id": alice_sid, "path": "a.txt", "content": "1"})
                    await bob.call_tool("write_file", {"session_id": bob_sid, "path": "b.txt", "content": "2"})
                    # Events of one stream arrive in order: had alice's reached bob, it would come first.
                    seen: list[str] = []
                    async for event in heard:
                        seen.append(repr(event))
                        if bob_uri in seen[-1]:
                            break
            assert not any(alice_uri in line for line in seen), seen
        finally:
            await alice.call_tool("close_session", {"session_id": alice_sid})
            await bob.call_tool("close_session", {"session_id": bob_sid})


async def test_one_client_cannot_take_every_session_slot(server: ServerProcess) -> None:
    async with connect(server, "alice") as alice, connect(server, "bob") as bob:
        mine = [structured(await alice.call_tool("new_session", {}))["session_id"] for _ in range(2)]
        try:
            third = await alice.call_tool("new_session", {})
            assert third.is_error and "your limit of 2 open sessions" in text(third), third
            theirs = await bob.call_tool("new_session", {})
            assert not theirs.is_error, theirs
            await bob.call_tool("close_session", {"session_id": structured(theirs)["session_id"]})
        finally:
            for sid in mine:
                await alice.call_tool("close_session", {"session_id": sid})


async def test_one_client_cannot_take_every_warm_container(server: ServerProcess) -> None:
    async with connect(server, "alice") as alice, connect(server, "bob") as bob:
        long = {"code": "import time; time.sleep(20)", "wait": 0}
        held = [structured(await alice.call_tool("run_python", long))["run_id"] for _ in range(2)]
        try:
            with anyio.fail_after(60):
                over = await alice.call_tool("run_python", long)
            assert over.is_error and "your limit of 2 runs at once" in text(over), over
            with anyio.fail_after(60):  # the pool grows for bob (both warm containers are alice's)
                answered = structured(await bob.call_tool("run_python", {"code": "print('bob')"}))
            assert answered["status"] == "ok" and answered["stdout"] == "bob\n", answered
        finally:
            for run_id in held:
                await alice.call_tool("cancel_run", {"run_id": run_id})


async def test_a_flood_of_unfinished_requests_does_not_lock_other_clients_out(server: ServerProcess) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    log_before = log_size(server)
    flood: list[socket.socket] = []
    try:
        for _ in range(1100):  # each sends half a request and never the rest
            conn = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            conn.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
            flood.append(conn)
        with anyio.fail_after(60):
            async with connect(server, "alice") as alice:
                answered = structured(await alice.call_tool("run_python", {"code": "print('served')"}))
        assert answered["stdout"] == "served\n"
        await wait_until(all_closed(flood), 60)  # the header timeout (3 s here) closed them
    finally:
        for conn in flood:
            conn.close()
    assert log_size(server) - log_before < 20_000, "the flood was logged line by line"


def all_closed(sockets: list[socket.socket]) -> Callable[[], bool]:
    def check() -> bool:
        for conn in sockets:
            conn.settimeout(0.01)
            try:
                if conn.recv(1024, socket.MSG_PEEK) != b"":
                    continue
            except (TimeoutError, BlockingIOError):
                return False
            except OSError:
                continue
        return True

    return check


def log_size(server: ServerProcess) -> int:
    return Path(f"/proc/self/fd/{server.log.fileno()}").stat().st_size
