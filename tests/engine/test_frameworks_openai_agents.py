"""The OpenAI Agents SDK drives the real server (a subprocess over stdio) with a scripted model:
``MCPServerStdio``, a scripted ``Model``. The model is given a plot as an input image, a session id it
can read back, and tracebacks as ordinary results rather than the SDK's "An error occurred". The SDK
runs with its defaults (tool error handling) except its 5 s MCP request timeout, which cannot work for
a sandbox at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
from _frameworks import (
    PNG,
    RUN_S,
    Script,
    Seen,
    ServerUnderTest,
    data_url,
    errors_script,
    plot_script,
    server_under_test,
    session_script,
)
from agents import Agent as OpenAIAgent
from agents import RunConfig, Runner
from agents.items import ModelResponse as OpenAIModelResponse
from agents.mcp import MCPServerStdio, MCPServerStdioParams
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from mcp_code_exec.config.settings import Config

pytestmark = pytest.mark.anyio


@pytest.fixture
def server(config: Config, tmp_path: Path) -> ServerUnderTest:
    """(``config`` builds the sandbox image if it is missing or stale.)"""
    return server_under_test(config, tmp_path)


# -- OpenAI Agents SDK ------------------------------------------------------------------------------
def _as_dict(item: Any) -> dict[str, Any]:
    return item if isinstance(item, dict) else dict(item.model_dump(exclude_none=True))


def _openai_results(model_input: str | list[Any]) -> list[Seen]:
    """The function_call_output items in the input the model is given: text and image parts."""
    results = []
    for item in model_input if isinstance(model_input, list) else []:
        item = _as_dict(item)
        if item.get("type") != "function_call_output":
            continue
        output = item["output"]
        parts = [output] if isinstance(output, str | dict) else list(output)
        texts, images = [], []
        for part in parts:
            if isinstance(part, str):
                texts.append(part)
                continue
            part = _as_dict(part)
            if part.get("type") == "input_text":
                texts.append(part["text"])
            elif part.get("type") == "input_image":
                images.append(data_url(part["image_url"]))
        results.append(Seen("\n".join(texts), images, output))
    return results


class OpenAIScriptedModel(Model):
    """A Model that reads the tool outputs in the input it is given and calls the script's next tool."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.seen: list[Seen] = []
        self.turns = 0

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[Any],
        model_settings: Any,
        tools: list[Any],
        output_schema: Any,
        handoffs: list[Any],
        tracing: Any,
        **kwargs: Any,
    ) -> OpenAIModelResponse:
        self.turns += 1
        self.seen = _openai_results(input)
        call = self.script([seen.text for seen in self.seen])
        output: list[Any]
        if call is None:
            text = ResponseOutputText(type="output_text", text="done", annotations=[])
            output = [
                ResponseOutputMessage(id="msg", type="message", role="assistant", status="completed", content=[text])
            ]
        else:
            name, args = call
            output = [
                ResponseFunctionToolCall(
                    type="function_call",
                    id=f"fc_{self.turns}",
                    call_id=f"call_{self.turns}",
                    name=name,
                    arguments=json.dumps(args),
                )
            ]
        return OpenAIModelResponse(output=output, usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("Runner.run (not run_streamed) asks for whole responses")


async def run_openai_agents(server: ServerUnderTest, script: Script, run_s: float = RUN_S) -> OpenAIScriptedModel:
    model = OpenAIScriptedModel(script)
    params: MCPServerStdioParams = {"command": server.command, "args": server.args, "env": dict(os.environ)}
    with anyio.fail_after(run_s + 60):
        # client_session_timeout_seconds bounds every MCP request. The SDK's default of 5 s is too short
        # for a sandbox: a run_python call may wait up to wait_s for its run (5 s here, 45 s by default),
        # plus a container start on a busy machine; past it the model only sees "An error occurred".
        async with MCPServerStdio(params=params, client_session_timeout_seconds=60, cache_tools_list=True) as mcp:
            agent = OpenAIAgent(name="coder", model=model, mcp_servers=[mcp])  # default tool error handling
            with anyio.fail_after(run_s):
                result = await Runner.run(agent, "go", run_config=RunConfig(tracing_disabled=True))
            await server.record_running()
    await server.assert_gone()
    assert result.final_output == "done"
    return model


async def test_openai_agents_agent_gets_a_plot_as_an_input_image(server: ServerUnderTest) -> None:
    model = await run_openai_agents(server, plot_script)
    [plot] = model.seen
    assert len(plot.images) == 1, plot.raw
    assert plot.images[0].startswith(PNG)
    assert any(_as_dict(part).get("image_url", "").startswith("data:image/png;base64,") for part in plot.raw)
    assert "status: ok" in plot.text


async def test_openai_agents_agent_keeps_variables_in_a_session_it_read_from_new_session(
    server: ServerUnderTest,
) -> None:
    model = await run_openai_agents(server, session_script)
    opened, assign, add, closed = model.seen
    session_id = json.loads(opened.text)["session_id"]
    assert assign.text.startswith("status: ok")
    assert add.text.startswith("status: ok") and "--- result ---\n42" in add.text
    assert json.loads(closed.text) == {"session_id": session_id, "closed": True}


async def test_openai_agents_agent_survives_two_python_errors_in_a_row(server: ServerUnderTest) -> None:
    model = await run_openai_agents(server, errors_script)
    first, second, recovered = model.seen
    for failed in (first, second):
        assert failed.text.startswith("status: error")
        assert "ZeroDivisionError" in failed.text and "Traceback" in failed.text
    assert recovered.text.startswith("status: ok") and "recovered" in recovered.text
    assert not any("An error occurred while running the tool" in seen.text for seen in model.seen)
