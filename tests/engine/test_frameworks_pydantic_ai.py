"""pydantic-ai drives the real server (a subprocess over stdio) with a scripted model: ``MCPToolset``
over fastmcp's stdio transport, a ``FunctionModel``. The model is given a plot as an image, a session id
it can read back, tracebacks as ordinary tool returns that do not use up a retry budget, and a long run
it can follow with get_run. pydantic-ai runs with its defaults (retries, tool error behaviour).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from _frameworks import (
    LONG_RUN_S,
    PNG,
    RUN_S,
    Script,
    Seen,
    ServerUnderTest,
    data_url,
    errors_script,
    long_run_script,
    plot_script,
    server_under_test,
    session_script,
)
from fastmcp.client.transports import StdioTransport
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import (
    BinaryContent,
    ImageUrl,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from mcp_code_exec.config.settings import Config

pytestmark = pytest.mark.anyio


@pytest.fixture
def server(config: Config, tmp_path: Path) -> ServerUnderTest:
    """(``config`` builds the sandbox image if it is missing or stale.)"""
    return server_under_test(config, tmp_path)


# -- pydantic-ai ------------------------------------------------------------------------------------
def _pydantic_ai_images(content: Any) -> list[bytes]:
    if isinstance(content, list):
        return [image for item in content for image in _pydantic_ai_images(item)]
    if isinstance(content, BinaryContent) and content.is_image:
        return [content.data]
    if isinstance(content, ImageUrl):
        return [data_url(content.url)]
    return []


def _pydantic_ai_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(_pydantic_ai_text(item) for item in content)
    if isinstance(content, str):
        return content
    if isinstance(content, BinaryContent | ImageUrl):
        return ""
    return json.dumps(content)  # MCPToolset hands over structuredContent (a dict) when every block is text


class PydanticAIScriptedModel:
    """The ``FunctionModel`` function: reads the tool results in the messages it is given, calls the
    script's next tool."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.seen: list[Seen] = []
        self.retry_prompts: list[RetryPromptPart] = []
        self.turns: list[float] = []  # when each model turn began (monotonic)

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.turns.append(time.monotonic())
        self.seen, self.retry_prompts = [], []
        for message in messages:
            if not isinstance(message, ModelRequest):
                continue
            for part in message.parts:
                if isinstance(part, ToolReturnPart):
                    seen = Seen(_pydantic_ai_text(part.content), _pydantic_ai_images(part.content), part.content)
                    self.seen.append(seen)
                elif isinstance(part, RetryPromptPart):
                    self.retry_prompts.append(part)
                elif isinstance(part, UserPromptPart) and self.seen:
                    # (for models that take no images in tool results pydantic-ai moves them here)
                    self.seen[-1].images += _pydantic_ai_images(part.content)
        call = self.script([seen.text for seen in self.seen])
        if call is None:
            return ModelResponse(parts=[TextPart("done")])
        name, args = call
        return ModelResponse(parts=[ToolCallPart(name, args)])


async def run_pydantic_ai(server: ServerUnderTest, script: Script, run_s: float = RUN_S) -> PydanticAIScriptedModel:
    model = PydanticAIScriptedModel(script)
    transport = StdioTransport(
        server.command, server.args, env=dict(os.environ), keep_alive=False, log_file=server.log_path
    )
    toolset = MCPToolset(transport, init_timeout=120, read_timeout=60)
    agent = PydanticAgent(FunctionModel(model), toolsets=[toolset])  # default retries and tool_error_behavior
    with anyio.fail_after(run_s + 60):
        async with toolset:  # one connection for the run, closed (and the server stopped) on leaving
            with anyio.fail_after(run_s):
                result = await agent.run("go")
            await server.record_running()
    await server.assert_gone()
    assert result.output == "done"
    return model


async def test_pydantic_ai_agent_gets_a_plot_as_an_image(server: ServerUnderTest) -> None:
    model = await run_pydantic_ai(server, plot_script)
    [plot] = model.seen
    assert len(plot.images) == 1, plot.raw
    assert plot.images[0].startswith(PNG)
    assert isinstance(plot.raw, list) and any(isinstance(item, BinaryContent) for item in plot.raw)
    assert "status: ok" in plot.text


async def test_pydantic_ai_agent_keeps_variables_in_a_session_it_read_from_new_session(
    server: ServerUnderTest,
) -> None:
    model = await run_pydantic_ai(server, session_script)
    opened, assign, add, closed = model.seen
    session_id = opened.raw["session_id"]
    assert assign.raw["status"] == "ok" and assign.raw["session_id"] == session_id
    assert add.raw["status"] == "ok" and add.raw["result"] == "42" and add.raw["session_id"] == session_id
    assert closed.raw["closed"] is True and not model.retry_prompts


async def test_pydantic_ai_agent_survives_two_python_errors_in_a_row_with_default_retries(
    server: ServerUnderTest,
) -> None:
    model = await run_pydantic_ai(server, errors_script)  # the run ended with "done", not UnexpectedModelBehavior
    first, second, recovered = model.seen
    for failed in (first, second):
        assert failed.raw["status"] == "error" and failed.raw["error"]["type"] == "ZeroDivisionError"
        assert "ZeroDivisionError" in failed.raw["error"]["traceback"]
    assert recovered.raw["status"] == "ok" and "recovered" in recovered.raw["stdout"]
    assert model.retry_prompts == []  # ordinary tool returns: no retry was counted


@pytest.mark.slow
async def test_pydantic_ai_agent_follows_a_long_run_with_get_run_until_it_ends(server: ServerUnderTest) -> None:
    model = await run_pydantic_ai(server, long_run_script, run_s=LONG_RUN_S)
    started, *polls = model.seen
    assert started.raw["status"] == "running" and started.raw["run_id"]
    assert model.turns[1] - model.turns[0] < 30, "run_python answered 'running' after its wait of 5 s"
    assert polls, "the model followed the run with get_run"
    assert all(poll.raw["status"] == "running" for poll in polls[:-1])
    final = polls[-1].raw
    assert final["status"] == "ok", final
    assert final["run_id"] == started.raw["run_id"]
    assert "done" in final["stdout"]
    assert not model.retry_prompts
