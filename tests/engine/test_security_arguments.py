"""Every tool argument is checked on every path: a ``run_python`` call a Tasks-declaring client
makes (which bypasses the tool's schema) gets the same clear tool error as a plain ``tools/call``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from _tasks_client import TASKS, TasksClient
from mcp import Client
from mcp_types import CallToolRequestParams
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from mcp_code_exec.errors import SandboxError
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.mcp_server.tasks import TasksExtension
from mcp_code_exec.service import SandboxService

pytestmark = pytest.mark.anyio

# What a client's JSON can carry to the server (an SDK client sends NaN and infinities as null;
# those are checked below, where the Tasks path takes its arguments).
BAD_TIMEOUTS: list[Any] = [-1, 0, -1e300, "ten", [5], {}]
NOT_FINITE = [float("nan"), float("inf"), float("-inf"), float("1e400")]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
async def test_a_bad_timeout_gets_a_clear_tool_error_with_or_without_tasks(service: SandboxService, bad: Any) -> None:
    answers = []
    for extensions in ([], [TasksClient()]):
        async with Client(build_server(service), extensions=extensions) as client:
            answer = await client.call_tool("run_python", {"code": "print('ran')", "timeout": bad})
        text = " ".join(getattr(block, "text", "") for block in answer.content)
        assert answer.is_error, text
        assert "timeout" in text and "ran" not in text, text
        answers.append(text)
    assert answers[0] == answers[1]  # the same error, whichever path it came by


@pytest.mark.parametrize(
    "arguments",
    [{"code": 42}, {"code": "1", "session_id": 7}, {"code": "1", "wait": -1}],
    ids=["code", "session_id", "wait"],
)
async def test_other_bad_arguments_get_the_same_tool_error_through_tasks(
    service: SandboxService, arguments: dict[str, Any]
) -> None:
    answers = []
    for extensions in ([], [TasksClient()]):
        async with Client(build_server(service), extensions=extensions) as client:
            answer = await client.call_tool("run_python", arguments)
        assert answer.is_error, answer
        answers.append(" ".join(getattr(block, "text", "") for block in answer.content))
    assert answers[0] == answers[1]


async def test_a_huge_finite_timeout_is_capped_at_max_run_s(service: SandboxService) -> None:
    for extensions in ([], [TasksClient()]):
        async with Client(build_server(service), extensions=extensions) as client:
            answer = await client.call_tool("run_python", {"code": "print('ran')", "timeout": 1e300})
        assert not answer.is_error and (answer.structured_content or {}).get("stdout") == "ran\n", answer


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0, True, "5"], ids=repr)
async def test_the_service_itself_refuses_a_timeout_that_is_not_a_positive_finite_number(
    service: SandboxService, bad: Any
) -> None:
    with pytest.raises(SandboxError, match="timeout must be a positive, finite number"):
        await service.run("me", "print('ran')", timeout=bad)


@pytest.mark.parametrize("bad", [*NOT_FINITE, *BAD_TIMEOUTS], ids=repr)
async def test_the_tasks_path_starts_no_run_for_a_bad_timeout_and_leaves_the_answer_to_the_tool(
    service: SandboxService, bad: Any
) -> None:
    """NaN and infinities reach the server only from a hand-made client (JSON has no such
    numbers; Python's parser takes them): the Tasks path hands them to the tool, never to a run."""
    ctx = SimpleNamespace(
        session=SimpleNamespace(client_capabilities=SimpleNamespace(extensions={TASKS: {}})),
        protocol_version=sorted(MODERN_PROTOCOL_VERSIONS)[-1],
    )
    handed_on = []
    answered = {"answered_by": "the tool's own validation"}

    async def tool(_: Any) -> dict[str, Any]:
        handed_on.append(True)
        return answered

    params = CallToolRequestParams(name="run_python", arguments={"code": "print('ran')", "timeout": bad})
    running = len(service.run_registry.running())
    answer = await TasksExtension(service).intercept_tool_call(params, ctx, tool)  # type: ignore[arg-type]
    assert answer is answered and handed_on
    assert len(service.run_registry.running()) == running


@pytest.mark.parametrize("bad", NOT_FINITE, ids=repr)
async def test_the_tools_schema_refuses_a_timeout_or_wait_that_is_not_finite(
    service: SandboxService, bad: float
) -> None:
    server = build_server(service)
    tool = server._tool_manager.get_tool("run_python")
    assert tool is not None
    for name in ("timeout", "wait"):
        with pytest.raises(ValueError, match="finite number"):
            tool.fn_metadata.arg_model.model_validate({"code": "1", "ctx": None, name: bad})
