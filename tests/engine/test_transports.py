"""The real server over stdio, SSE and streamable HTTP, as a subprocess each; auth and Origin checks."""

from __future__ import annotations

import os
import sys

import anyio
import httpx2
import pytest
from _support import ServerProcess
from mcp import Client, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client

pytestmark = pytest.mark.anyio
TOKEN = "test-token-0123456789"


async def test_stdio_server_runs_print_6_times_7() -> None:
    params = StdioServerParameters(command=sys.executable, args=["-m", "mcp_code_exec", "serve"], env=dict(os.environ))
    with anyio.fail_after(120):
        async with Client(params) as client:
            result = await client.call_tool("run_python", {"code": "print(6*7)"})
    assert result.structured_content is not None
    assert result.structured_content["stdout"] == "42\n"


async def test_streamable_http_server_runs_print_6_times_7_with_a_token() -> None:
    async with ServerProcess("streamable-http", env={"MCP_CODE_EXEC_TOKEN": TOKEN}) as server:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        with anyio.fail_after(120):
            async with Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as client:
                result = await client.call_tool("run_python", {"code": "print(6*7)"})
        assert result.structured_content is not None and result.structured_content["stdout"] == "42\n"


async def test_sse_server_runs_print_6_times_7_with_a_token() -> None:
    async with ServerProcess("sse", env={"MCP_CODE_EXEC_TOKEN": TOKEN}) as server:
        with anyio.fail_after(120):
            async with Client(sse_client(f"{server.url}/sse", headers={"Authorization": f"Bearer {TOKEN}"})) as client:
                result = await client.call_tool("run_python", {"code": "print(6*7)"})
        assert result.structured_content is not None and result.structured_content["stdout"] == "42\n"


async def test_http_rejects_a_missing_token_a_wrong_token_a_bad_origin_and_a_bad_host() -> None:
    async with ServerProcess("streamable-http", env={"MCP_CODE_EXEC_TOKEN": TOKEN}) as server:
        body = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "0"},
            },
        }
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx2.AsyncClient(timeout=30) as http:
            url = f"{server.url}/mcp"
            assert (await http.post(url, json=body, headers=headers)).status_code == 401
            wrong = {**headers, "Authorization": "Bearer nope"}
            assert (await http.post(url, json=body, headers=wrong)).status_code == 401
            evil = {**headers, **auth, "Origin": "http://evil.example"}
            assert (await http.post(url, json=body, headers=evil)).status_code == 403
            rebind = {**headers, **auth, "Host": "evil.example"}
            assert (await http.post(url, json=body, headers=rebind)).status_code == 421
            good = {**headers, **auth, "Origin": f"http://127.0.0.1:{server.port}"}
            assert (await http.post(url, json=body, headers=good)).status_code == 200


CHATTY = "import time\nfor i in range(6):\n    print('tick', i, flush=True)\n    time.sleep(0.3)\n'done'"


async def progress_of(client: Client) -> list[str]:
    """The progress messages a run that prints for about two seconds sends this client."""
    messages: list[str] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")

    with anyio.fail_after(120):
        result = await client.call_tool("run_python", {"code": CHATTY}, progress_callback=on_progress)
    assert result.structured_content is not None and result.structured_content["result"] == "'done'"
    return messages


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_progress_reaches_clients_on_every_transport_in_both_eras(mode: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    params = StdioServerParameters(command=sys.executable, args=["-m", "mcp_code_exec", "serve"], env=dict(os.environ))
    async with Client(params, mode=mode) as client:
        assert any("tick" in message for message in await progress_of(client)), "stdio"
    async with ServerProcess("streamable-http", env={"MCP_CODE_EXEC_TOKEN": TOKEN}) as server:
        http = httpx2.AsyncClient(headers=headers, timeout=60)
        async with http, Client(streamable_http_client(f"{server.url}/mcp", http_client=http), mode=mode) as client:
            assert any("tick" in message for message in await progress_of(client)), "streamable HTTP"
    async with (
        ServerProcess("sse", env={"MCP_CODE_EXEC_TOKEN": TOKEN}) as sse,
        Client(sse_client(f"{sse.url}/sse", headers=headers), mode=mode) as client,
    ):
        assert any("tick" in message for message in await progress_of(client)), "SSE"


async def test_http_without_a_configured_token_makes_one_and_refuses_clients_without_it() -> None:
    async with ServerProcess("streamable-http", env={"MCP_CODE_EXEC_TOKEN": ""}) as server:
        async with httpx2.AsyncClient(timeout=30) as http:
            refused = await http.post(f"{server.url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert refused.status_code == 401
        server.log.seek(0)
        logged = server.log.read().decode()
        token = logged.split("'Authorization: Bearer ", 1)[1].split("'", 1)[0]
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60)
        async with http, Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as client:
            result = await client.call_tool("run_python", {"code": "print(6*7)"})
        assert result.structured_content is not None and result.structured_content["stdout"] == "42\n"
