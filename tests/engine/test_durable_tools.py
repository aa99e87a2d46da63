"""The tools of durable sessions over MCP (fork_session, list_variables, export_notebook): clear
answers on an image whose agent predates snapshots, owner checks, closed schemas; and read_file
given a run id as its session id says where that id goes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from _durable import agent_restores, durable_service
from mcp import Client

from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.mcp_server.identity import LOCAL
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
REBUILD = "rebuild the image with `mcp-code-exec image build`"


@pytest.fixture(scope="module")
async def service() -> AsyncIterator[SandboxService]:
    async with durable_service() as running:
        yield running


@pytest.fixture
async def client(service: SandboxService, mode: str) -> AsyncIterator[Client]:
    async with Client(build_server(service), mode=mode) as connected:
        yield connected


def text(result: Any) -> str:
    return str(getattr(result.content[0], "text", ""))


async def new_session(client: Client) -> str:
    result = await client.call_tool("new_session", {})
    assert result.structured_content is not None, result
    return str(result.structured_content["session_id"])


async def test_fork_session_answers_new_sessions_that_hold_the_sources_files(client: Client) -> None:
    source = await new_session(client)
    await client.call_tool("write_file", {"session_id": source, "path": "a.txt", "content": "from the source"})
    result = await client.call_tool("fork_session", {"session_id": source, "count": 2})
    assert not result.is_error and result.structured_content is not None, result
    forks = result.structured_content["forks"]
    try:
        assert result.structured_content["session_id"] == source and len(set(forks)) == 2
        for fork in forks:
            read = await client.call_tool("read_file", {"session_id": fork, "path": "a.txt"})
            assert text(read) == "from the source", read
    finally:
        for session_id in [source, *forks]:
            await client.call_tool("close_session", {"session_id": session_id})


async def test_list_variables_and_export_notebook_say_to_rebuild_an_image_whose_agent_predates_them(
    client: Client, service: SandboxService
) -> None:
    if await agent_restores(service):
        pytest.skip("the image's agent keeps snapshots: these tools answer (see the variable tests)")
    session_id = await new_session(client)
    try:
        for tool, said in [("list_variables", "cannot list variables yet"), ("export_notebook", "cannot export")]:
            result = await client.call_tool(tool, {"session_id": session_id})
            assert result.is_error and said in text(result) and REBUILD in text(result), (tool, result)
        # and the session goes on
        run = await client.call_tool("run_python", {"code": "6 * 7", "session_id": session_id})
        assert run.structured_content is not None and run.structured_content["result"] == "42", run
    finally:
        await client.call_tool("close_session", {"session_id": session_id})


async def test_another_identitys_session_is_no_such_session_to_every_durable_tool(
    client: Client, service: SandboxService
) -> None:
    theirs = (await service.new_session("token:someone-else")).session_id
    assert LOCAL != "token:someone-else"
    try:
        for tool in ("fork_session", "list_variables", "export_notebook"):
            result = await client.call_tool(tool, {"session_id": theirs})
            assert result.is_error and f"no such session: '{theirs}'" in text(result), (tool, result)
        assert len(service.sessions.owned_by("token:someone-else")) == 1  # nothing was forked for anyone
        assert service.sessions.owned_by(LOCAL) == []
    finally:
        await service.close_session("token:someone-else", theirs)


async def test_the_tools_refuse_an_argument_they_do_not_know(client: Client) -> None:
    session_id = await new_session(client)
    try:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        for tool in ("fork_session", "list_variables", "export_notebook"):
            assert tools[tool].input_schema.get("additionalProperties") is False, tool
            result = await client.call_tool(tool, {"session_id": session_id, "sesion": "typo"})
            assert result.is_error and "sesion" in text(result), (tool, result)
        misspelt = await client.call_tool("run_python", {"code": "1", "sesion_id": session_id})
        assert misspelt.is_error and "sesion_id" in text(misspelt), misspelt  # not run without its session
        result = await client.call_tool("fork_session", {"session_id": session_id, "count": 9})
        assert result.is_error and "count" in text(result), result
    finally:
        await client.call_tool("close_session", {"session_id": session_id})


async def test_read_file_given_a_run_id_as_its_session_id_says_to_pass_it_as_run_id(client: Client) -> None:
    made = await client.call_tool("run_python", {"code": "open('/mnt/data/out.txt', 'w').write('x')"})
    assert made.structured_content is not None, made
    run_id = made.structured_content["run_id"]
    result = await client.call_tool("read_file", {"session_id": run_id, "path": "out.txt"})
    assert result.is_error and "pass it as run_id" in text(result), result
    assert "new_session" not in text(result), result
