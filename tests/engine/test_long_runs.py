"""Runs that outlive the call that started them: wait, get_run, cancel_run, and MCP Tasks."""

from __future__ import annotations

from typing import Any

import anyio
import httpx2
import pytest
from _support import ServerProcess, make_test_config
from _tasks_client import TASKS, TasksClient, created, tasks_cancel, tasks_get
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
SLOW = "import time\nprint('started', flush=True)\ntime.sleep({seconds})\nprint('ended')\n42"


def structured(result: Any) -> dict[str, Any]:
    assert result.structured_content is not None, result
    return dict(result.structured_content)


async def test_a_run_longer_than_the_wait_answers_running_then_get_run_returns_its_result(client: Client) -> None:
    with anyio.fail_after(60):
        answer = await client.call_tool("run_python", {"code": SLOW.format(seconds=6), "wait": 1.5})
    first = structured(answer)
    assert first["status"] == "running" and not answer.is_error, first
    run_id = first["run_id"]
    assert f"get_run(run_id='{run_id}')" in answer.content[0].text  # type: ignore[union-attr]
    outcome = first
    with anyio.fail_after(60):
        while outcome["status"] == "running":
            outcome = structured(await client.call_tool("get_run", {"run_id": run_id, "wait": 2}))
    assert outcome["status"] == "ok", outcome
    assert outcome["result"] == "42" and outcome["stdout"] == "started\nended\n"
    again = structured(await client.call_tool("get_run", {"run_id": run_id}))
    assert again["status"] == "ok" and again["result"] == "42"  # a finished run stays available


async def test_while_a_session_runs_its_other_calls_get_a_busy_answer_naming_the_run(client: Client) -> None:
    sid = structured(await client.call_tool("new_session", {}))["session_id"]
    try:
        await client.call_tool("run_python", {"code": "kept = 7", "session_id": sid})
        first = structured(
            await client.call_tool("run_python", {"code": SLOW.format(seconds=8), "session_id": sid, "wait": 1})
        )
        assert first["status"] == "running"
        run_id = first["run_id"]
        for tool, arguments in (
            ("run_python", {"code": "1", "session_id": sid}),
            ("list_files", {"session_id": sid}),
            ("read_file", {"session_id": sid, "path": "a"}),
            ("write_file", {"session_id": sid, "path": "a", "content": "x"}),
        ):
            busy = await client.call_tool(tool, arguments)
            assert busy.is_error, (tool, busy)
            text = busy.content[0].text  # type: ignore[union-attr]
            assert f"busy with run '{run_id}'" in text and "get_run" in text, text
        cancelled = structured(await client.call_tool("cancel_run", {"run_id": run_id}))
        assert cancelled["status"] == "cancelled", cancelled
        assert "started" in cancelled["stdout"]
        kept = structured(await client.call_tool("run_python", {"code": "kept", "session_id": sid}))
        assert kept["result"] == "7" and not kept["session_restarted"], kept  # the interrupt kept its state
    finally:
        await client.call_tool("close_session", {"session_id": sid})


async def test_an_unknown_run_gets_no_such_run_not_no_such_session(client: Client) -> None:
    for tool in ("get_run", "cancel_run"):
        result = await client.call_tool(tool, {"run_id": "r_madeup"})
        assert result.is_error
        text = result.content[0].text  # type: ignore[union-attr]
        assert "no such run: 'r_madeup'" in text and "session" not in text


async def test_a_run_is_stopped_at_max_run_s_whatever_timeout_it_asks_for(config: object) -> None:
    settings = make_test_config(pool={"size": 1, "session_spares": 0}, limits={"max_run_s": 3})
    async with SandboxService.start(settings) as service:
        with anyio.fail_after(60):
            result = await service.run("me", "import time; time.sleep(60)", timeout=1000)
        assert result.status == "timeout", result
        assert result.duration_ms < 30_000


async def test_a_running_runs_output_is_readable_as_a_resource(service: SandboxService) -> None:
    async with Client(build_server(service)) as client:
        first = structured(await client.call_tool("run_python", {"code": SLOW.format(seconds=5), "wait": 2}))
        assert first["status"] == "running"
        uri = f"sandbox://runs/{first['run_id']}/output"
        listed = [str(r.uri) for r in (await client.list_resources()).resources]
        assert uri in listed
        read = await client.read_resource(uri)
        text = read.contents[0].text  # type: ignore[union-attr]
        assert "running" in text and "started" in text
        with anyio.fail_after(60):
            done = structured(await client.call_tool("get_run", {"run_id": first["run_id"], "wait": 30}))
        assert done["status"] == "ok"


# -- MCP Tasks (2026-07-28) ----------------------------------------------------------------------------
async def test_a_tasks_declaring_client_gets_a_long_run_as_a_task_that_completes(service: SandboxService) -> None:
    async with Client(build_server(service), extensions=[TasksClient()]) as client:
        before = len(created)
        quick = await client.call_tool("run_python", {"code": "6*7"})
        assert structured(quick)["result"] == "42" and len(created) == before  # quick runs answer directly
        with anyio.fail_after(60):
            slow = await client.call_tool("run_python", {"code": SLOW.format(seconds=4)})
        assert len(created) == before + 1 and created[-1].status == "working"
        assert structured(slow)["status"] == "ok" and structured(slow)["result"] == "42"


async def test_tasks_can_be_cancelled_and_unknown_tasks_are_refused(service: SandboxService) -> None:
    async with Client(build_server(service), extensions=[TasksClient()]) as client:
        session = client.session
        raw = await session.call_tool("run_python", {"code": SLOW.format(seconds=60)}, allow_claimed=True)
        task_id = raw.task_id  # type: ignore[union-attr]
        assert (await tasks_get(session, task_id)).status == "working"
        await tasks_cancel(session, task_id)
        with anyio.fail_after(30):
            while (state := await tasks_get(session, task_id)).status == "working":  # noqa: ASYNC110
                await anyio.sleep(0.2)  # the Tasks protocol is polled by design: this paces the polls
        assert state.status == "cancelled"
        with pytest.raises(MCPError) as refused:
            await tasks_get(session, "r_not-a-task")
        assert refused.value.error.code == -32602
    async with Client(build_server(service)) as plain:  # no extension declared: no task, no tasks/*
        assert structured(await plain.call_tool("run_python", {"code": "1+1"}))["result"] == "2"
        with pytest.raises(MCPError) as undeclared:
            await tasks_get(plain.session, task_id)
        assert undeclared.value.error.code == -32021


@pytest.mark.slow
async def test_a_ninety_second_run_completes_as_a_task_over_streamable_http(config: object) -> None:
    token = "tasks-token"
    async with ServerProcess("streamable-http", env={"MCP_CODE_EXEC_TOKEN": token}) as server:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120)
        transport = streamable_http_client(f"{server.url}/mcp", http_client=http)
        async with http, Client(transport, extensions=[TasksClient()]) as client:
            capabilities = client.server_capabilities
            assert capabilities is not None and TASKS in (capabilities.extensions or {})
            before = len(created)
            with anyio.fail_after(200):
                result = await client.call_tool("run_python", {"code": SLOW.format(seconds=90), "timeout": 150})
            assert len(created) == before + 1
            outcome = structured(result)
            assert outcome["status"] == "ok" and outcome["stdout"] == "started\nended\n", outcome
