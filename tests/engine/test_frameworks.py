"""Two agent frameworks drive the real server (a subprocess over stdio) with scripted models: no LLM,
no network. pydantic-ai: ``MCPToolset`` over fastmcp's stdio transport, a ``FunctionModel``. The OpenAI
Agents SDK: ``MCPServerStdio``, a scripted ``Model``. Every tool result reaches the scripted model through
the framework's own conversion, so the tests show what a real model would be given: a plot as an image,
a session id it can read back, tracebacks as ordinary results that do not use up a retry budget, and a
long run it can follow with get_run. Both frameworks run with their defaults (retries, error handling)
except where a default cannot work for a sandbox at all (the Agents SDK's 5 s MCP request timeout).
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import docker
import pytest
from agents import Agent as OpenAIAgent
from agents import RunConfig, Runner
from agents.items import ModelResponse as OpenAIModelResponse
from agents.mcp import MCPServerStdio, MCPServerStdioParams
from agents.models.interface import Model
from agents.usage import Usage
from fastmcp.client.transports import StdioTransport
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
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

from mcp_code_exec.config import Config
from mcp_code_exec.runtime.base import LABEL_OWNER

pytestmark = pytest.mark.anyio

RUN_S = 120  # one agent run (the machine has 2 cores, shared with other test runs)
LONG_RUN_S = 200
PNG = b"\x89PNG\r\n\x1a\n"
PLOT = "import matplotlib.pyplot as plt; plt.plot([1,2,3]); plt.show()"
# default_timeout_s is 20 s: the sleeper asks for more, within max_run_s.
LONG = "import time; time.sleep(90); print('done')"
MAX_POLLS = 40  # get_run calls the long-run model makes at most (each waits up to wait_s = 5 s)

Call = tuple[str, dict[str, Any]]
Script = Callable[[list[str]], Call | None]  # tool results seen so far (as text) -> next call, or None: "done"


# -- what the scripted models do ------------------------------------------------------------------
def field_of(text: str, name: str) -> str:
    """A field of a tool result as a model reads it: ``"name": "value"`` in JSON, ``name: value`` or
    ``name='value'`` in the server's text."""
    found = re.search(rf"""\b{name}["']?\s*[:=]\s*["']?([\w.-]+)""", text)
    assert found is not None, f"no {name} in the tool result the model saw: {text[:500]!r}"
    return found.group(1)


def plot_script(results: list[str]) -> Call | None:
    return ("run_python", {"code": PLOT}) if not results else None


def session_script(results: list[str]) -> Call | None:
    if not results:
        return ("new_session", {})
    session_id = field_of(results[0], "session_id")  # read back from new_session's answer
    steps: list[Call] = [
        ("run_python", {"code": "x = 41", "session_id": session_id}),
        ("run_python", {"code": "x + 1", "session_id": session_id}),
        ("close_session", {"session_id": session_id}),
    ]
    done = len(results) - 1
    return steps[done] if done < len(steps) else None


def errors_script(results: list[str]) -> Call | None:
    codes = ["1/0", "1/0", "print('recovered')"]
    return ("run_python", {"code": codes[len(results)]}) if len(results) < len(codes) else None


def long_run_script(results: list[str]) -> Call | None:
    if not results:
        return ("run_python", {"code": LONG, "wait": 5, "timeout": 150})
    if field_of(results[-1], "status") == "running" and len(results) <= MAX_POLLS:
        return ("get_run", {"run_id": field_of(results[0], "run_id")})
    return None


@dataclass
class Seen:
    """One tool result as the framework handed it to the model."""

    text: str
    images: list[bytes]
    raw: Any


def _data_url(url: str) -> bytes:
    assert url.startswith("data:") and ";base64," in url, url[:100]
    return base64.b64decode(url.split(";base64,", 1)[1])


# -- the server subprocess and what it owns ---------------------------------------------------------
SERVER_CONFIG = """\
image = {image}
log_level = "warning"

[limits]
memory_mb = 256
default_timeout_s = 20
max_run_s = 200
wait_s = 5

[pool]
size = 2

[sessions]
max_sessions = 8
"""


def owned_by(pid: int) -> tuple[list[str], list[str]]:
    """This project's containers and volumes whose owner label (host:pid:start) names this process."""
    host = socket.gethostname()

    def ours(labels: dict[str, str] | None) -> bool:
        parts = (labels or {}).get(LABEL_OWNER, "").rsplit(":", 2)
        return len(parts) == 3 and parts[0] == host and parts[1] == str(pid)

    client = docker.from_env()
    try:
        containers = [
            c["Id"] for c in client.api.containers(all=True, filters={"label": LABEL_OWNER}) if ours(c["Labels"])
        ]
        listed = client.api.volumes(filters={"label": LABEL_OWNER}).get("Volumes") or []
        return containers, [v["Name"] for v in listed if ours(v.get("Labels"))]
    finally:
        client.close()


@dataclass
class ServerUnderTest:
    """``python -m mcp_code_exec serve --config <file>``, started by a framework's stdio client."""

    config_path: Path
    log_path: Path
    pid: int | None = None

    @property
    def command(self) -> str:
        return sys.executable

    @property
    def args(self) -> list[str]:
        return ["-m", "mcp_code_exec", "serve", "--config", str(self.config_path)]

    def pids(self) -> list[int]:
        """Processes running this server (its config file is unique to the test)."""
        wanted = str(self.config_path).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    argv = (entry / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if wanted in argv and b"mcp_code_exec" in argv:
                    found.append(int(entry.name))
        return found

    async def record_running(self) -> None:
        """While the framework's connection is open: the one server process and its sandboxes."""
        pids = await anyio.to_thread.run_sync(self.pids)
        assert len(pids) == 1, pids
        self.pid = pids[0]
        containers, _ = await anyio.to_thread.run_sync(owned_by, self.pid)
        assert containers, "the server's warm containers carry its owner label (else the check after is void)"

    async def assert_gone(self) -> None:
        """After the framework's context manager closed stdio: the process ended and left nothing behind."""
        assert self.pid is not None
        assert await anyio.to_thread.run_sync(self.pids) == [], "the server outlived the framework's connection"
        left = await anyio.to_thread.run_sync(owned_by, self.pid)
        assert left == ([], []), f"left behind: {left}; server log: {self.log_tail()}"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else "(none)"


@pytest.fixture
def server(config: Config, tmp_path: Path) -> ServerUnderTest:
    """(``config`` builds the sandbox image if it is missing or stale.)"""
    path = tmp_path / "config.toml"
    path.write_text(SERVER_CONFIG.format(image=json.dumps(config.image)))
    return ServerUnderTest(config_path=path, log_path=tmp_path / "server.log")


# -- pydantic-ai ------------------------------------------------------------------------------------
def _pydantic_ai_images(content: Any) -> list[bytes]:
    if isinstance(content, list):
        return [image for item in content for image in _pydantic_ai_images(item)]
    if isinstance(content, BinaryContent) and content.is_image:
        return [content.data]
    if isinstance(content, ImageUrl):
        return [_data_url(content.url)]
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
                images.append(_data_url(part["image_url"]))
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
