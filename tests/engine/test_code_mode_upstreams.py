"""Code mode on the real engine, more upstreams and edges: a streamable-HTTP upstream whose header
comes from the host's environment, a tool list that changes, a slow tool, the npm
``server-memory``, an approval that outlasts the run's timeout, a session whose container is
replaced, run_python's description per caller, and call frames from runs without code mode.

Upstreams: ``fixtures/tiny_server.py`` (the SDK's MCPServer, over stdio and over streamable HTTP
on loopback) and the npm ``@modelcontextprotocol/server-memory`` (installed by ``.ci/run``).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _support import free_port, wait_until
from mcp import Client
from mcp.client.context import ClientRequestContext
from mcp.server.auth.middleware.auth_context import auth_context_var
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.types import CallToolResult, ElicitRequestParams, ElicitResult

from mcp_code_exec.config.code_mode import CodeModeSettings, UpstreamServer
from mcp_code_exec.config.settings import Config
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
FIXTURES = Path(__file__).parent / "fixtures"
TINY = str(FIXTURES / "tiny_server.py")
MEMORY = FIXTURES / "npm" / "node_modules" / "@modelcontextprotocol" / "server-memory" / "dist" / "index.js"
TOKEN_VARIABLE = "CODE_MODE_TEST_UPSTREAM_TOKEN"
RUN_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def http_upstream() -> Iterator[tuple[str, str]]:
    """The tiny server over streamable HTTP on loopback, wanting a bearer token: (its URL, the token)."""
    token, port = secrets.token_urlsafe(16), free_port()
    process = subprocess.Popen(
        [sys.executable, TINY, "http", str(port)],
        env={**os.environ, "EXPECTED_TOKEN": token},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}/mcp", token
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
async def tiny_service(
    config: Config, http_upstream: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SandboxService]:
    url, token = http_upstream
    port = int(url.split(":")[2].split("/")[0])
    await wait_until(lambda: _listening(port), 30)
    os.environ[TOKEN_VARIABLE] = f"Bearer {token}"  # the host's environment: the header names the variable
    listed = [
        UpstreamServer(name="tiny", command=sys.executable, args=[TINY]),
        UpstreamServer(name="web", url=url, headers={"Authorization": f"${{{TOKEN_VARIABLE}}}"}),
        UpstreamServer(name="alices", command=sys.executable, args=[TINY], principals=["alice"]),
    ]
    if MEMORY.exists():
        memory_file = tmp_path_factory.mktemp("memory") / "memory.jsonl"
        listed.append(
            UpstreamServer(
                name="memory",
                command="node",
                args=[str(MEMORY)],
                env={"MEMORY_FILE_PATH": str(memory_file)},
                allow=["create_entities", "read_graph"],
            )
        )
    settings = CodeModeSettings(servers=listed, call_timeout_s=2, ask_timeout_s=60)
    try:
        async with SandboxService.start(config.model_copy(update={"code_mode": settings})) as svc:
            await svc.wait_ready()
            yield svc
    finally:
        os.environ.pop(TOKEN_VARIABLE, None)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


async def run(client: Client, code: str, **arguments: Any) -> dict[str, Any]:
    result: CallToolResult = await client.call_tool("run_python", {"code": code, **arguments})
    assert result.structured_content is not None, result
    return dict(result.structured_content)


async def test_an_http_upstream_gets_the_header_from_the_host_environment_and_the_sandbox_never_sees_it(
    tiny_service: SandboxService, http_upstream: tuple[str, str]
) -> None:
    url, token = http_upstream
    code = (
        "import mcp_tools, os, json, sys\n"
        "from mcpx_agent.worker import mcp_tools as built\n"
        "print(mcp_tools.web.authorized()['result'])\n"
        "seen = json.dumps(dict(os.environ)) + built._built[0] + repr(sys.argv)\n"
        "for root in ('/proc/self/environ', '/proc/1/environ'):\n"
        "    try:\n"
        "        seen += open(root, 'rb').read().decode('latin-1')\n"
        "    except OSError:\n"
        "        pass\n"
        f"print({token!r} in seen, {url!r} in seen, 'CODE_MODE_TEST' in seen)\n"
    )
    async with Client(build_server(tiny_service)) as client:
        out = await run(client, code)
    assert out["stdout"].splitlines() == ["True", "False False False"], out


async def test_a_changed_tool_list_reaches_the_next_run(tiny_service: SandboxService) -> None:
    async with Client(build_server(tiny_service)) as client:
        out = await run(
            client, "import mcp_tools\nprint(hasattr(mcp_tools.tiny, 'grown'), mcp_tools.tiny.grow()['result'])"
        )
        assert out["stdout"] == "False grew\n", out
        with anyio.fail_after(30):  # the upstream announces the change; the broker reads the list again
            while "grown" not in {spec.tool for spec in await tiny_service.tool_catalog("local")}:  # noqa: ASYNC110
                await anyio.sleep(0.1)  # pacing of the poll; the catalog is the synchronisation
        out = await run(client, "import mcp_tools\nprint(mcp_tools.tiny.grown()['result'])")
    assert out["stdout"] == "grown\n", out


async def test_a_tool_slower_than_the_call_timeout_raises_tool_timeout_and_the_next_call_works(
    tiny_service: SandboxService,
) -> None:
    code = (
        "import mcp_tools\n"
        "try:\n"
        "    mcp_tools.tiny.slow(seconds=30)\n"
        "except mcp_tools.ToolTimeout as exc:\n"
        "    print('timeout', isinstance(exc, TimeoutError), exc)\n"
        "print(mcp_tools.tiny.slow(seconds=0)['result'])\n"
    )
    async with Client(build_server(tiny_service)) as client:
        out = await run(client, code)
    assert out["stdout"].splitlines() == ["timeout True 'slow' did not answer within 2 s", "slept"], out


async def test_an_approval_that_outlasts_the_runs_timeout_still_completes_the_run(
    tiny_service: SandboxService,
) -> None:
    async def slow_human(context: ClientRequestContext, params: ElicitRequestParams) -> ElicitResult:
        await anyio.sleep(RUN_TIMEOUT_S + 3)  # the human takes longer than the run may: not synchronisation
        return ElicitResult(action="accept", content={"allow": True})

    code = "import mcp_tools\nprint(mcp_tools.tiny.note(text='kept')['result'])\nprint('after')\n"
    async with Client(build_server(tiny_service), elicitation_callback=slow_human) as client:
        out = await run(client, code, timeout=RUN_TIMEOUT_S)
    assert out["status"] == "ok" and out["stdout"] == "noted kept\nafter\n", out


async def test_a_session_has_mcp_tools_after_its_container_is_replaced(tiny_service: SandboxService) -> None:
    async with Client(build_server(tiny_service)) as client:
        created = await client.call_tool("new_session", {})
        session_id = str((created.structured_content or {})["session_id"])
        try:
            first = await run(
                client, "import mcp_tools\nmcp_tools.tiny.slow(seconds=0)['result']", session_id=session_id
            )
            assert first["result"] == "'slept'", first
            old = tiny_service.sessions.get(session_id, "local").sandbox
            assert old is not None
            await anyio.run_process(["docker", "kill", old.container_id], check=False)
            with anyio.fail_after(30):
                await old.channel.closed.wait()  # the host noticed: the attach stream ended
            after = await run(
                client, "import mcp_tools\nmcp_tools.tiny.slow(seconds=0)['result']", session_id=session_id
            )
        finally:
            await client.call_tool("close_session", {"session_id": session_id})
    assert after["status"] == "ok" and after["result"] == "'slept'" and after.get("session_restarted"), after


@pytest.mark.skipif(not MEMORY.exists(), reason="npm fixtures not installed (npm ci in tests/engine/fixtures/npm)")
async def test_the_npm_memory_server_keeps_entities_and_its_destructive_tool_is_denied(
    tiny_service: SandboxService,
) -> None:
    code = (
        "import mcp_tools\n"
        "mcp_tools.memory.create_entities(entities=[{'name': 'Ada', 'entityType': 'person', 'observations': ['wrote code']}])\n"
        "graph = mcp_tools.memory.read_graph()\n"
        "print(type(graph).__name__, [(e['name'], e['observations']) for e in graph['entities']])\n"
        "try:\n"
        "    mcp_tools.memory.delete_entities(entityNames=['Ada'])\n"
        "except mcp_tools.ToolDenied:\n"
        "    print('delete denied')\n"
    )
    async with Client(build_server(tiny_service)) as client:
        out = await run(client, code)
    assert out["stdout"].splitlines() == ["dict [('Ada', ['wrote code'])]", "delete denied"], out


async def run_python_description(service: SandboxService, identity: str | None) -> str:
    user = None if identity is None else AuthenticatedUser(AccessToken(token="t", client_id=identity, scopes=[]))
    reset = auth_context_var.set(user)  # whom the in-memory server serves (over HTTP: the bearer token's name)
    try:
        async with Client(build_server(service)) as client:
            tools = (await client.list_tools()).tools
    finally:
        auth_context_var.reset(reset)
    return next(tool.description or "" for tool in tools if tool.name == "run_python")


async def test_run_pythons_description_lists_the_tools_of_the_callers_own_servers(
    tiny_service: SandboxService,
) -> None:
    local = await run_python_description(tiny_service, None)
    alice = await run_python_description(tiny_service, "alice")
    assert "mcp_tools.tiny.slow(seconds)" in local and "mcp_tools.web.authorized()" in local, local
    assert "alices" not in local, local
    assert "mcp_tools.alices.slow(seconds)" in alice and "mcp_tools.tiny.slow(seconds)" in alice, alice


async def test_a_future_nobody_awaited_finishes_with_its_cell_and_keeps_its_result_for_the_next(
    tiny_service: SandboxService,
) -> None:
    async with Client(build_server(tiny_service)) as client:
        created = await client.call_tool("new_session", {})
        session_id = str((created.structured_content or {})["session_id"])
        try:
            first = await run(
                client, "import mcp_tools\nlater = mcp_tools.tiny.slow.submit(seconds=1)\n", session_id=session_id
            )
            second = await run(
                client,
                "print(repr(later).endswith('done>'), later.result()['result'])",
                session_id=session_id,
                timeout=15,
            )
        finally:
            await client.call_tool("close_session", {"session_id": session_id})
    assert first["status"] == "ok", first
    assert second["status"] == "ok" and second["stdout"] == "True slept\n", second  # settled when the first cell ended
