"""Code mode's broker without an engine: the policy, the naming rule, approvals used once, results
capped, the audit line and its metric, and the config's one-line errors. Upstreams are played by
a stand-in with the ``Upstream`` methods the broker calls."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.types import CallToolResult, TextContent, Tool, ToolAnnotations

from mcp_code_exec.broker.approvals import Approval, RunApprovals
from mcp_code_exec.broker.broker import Broker, Refused, result_body
from mcp_code_exec.broker.names import identifier, tool_specs
from mcp_code_exec.broker.policy import decide
from mcp_code_exec.config.code_mode import CodeModeSettings, UpstreamServer
from mcp_code_exec.config.settings import load_config
from mcp_code_exec.errors import ConfigError, ProtocolViolation
from mcp_code_exec.mcp_server.descriptions import TOOLS_INLINE, code_mode_text
from mcp_code_exec.observability import metrics
from mcp_code_exec.observability.logs import JsonFormatter
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.sandbox.tool_calls import ToolCalls

pytestmark = pytest.mark.anyio
SECRET_VALUE = "do-not-log-this-value-7f3a"


def tool(name: str, *, read_only: bool | None = None, destructive: bool | None = None) -> Tool:
    hints = ToolAnnotations(read_only_hint=read_only, destructive_hint=destructive)
    return Tool(
        name=name, input_schema={"type": "object", "properties": {"text": {"type": "string"}}}, annotations=hints
    )


def server(**fields: Any) -> UpstreamServer:
    return UpstreamServer(**{"name": "up", "command": "python3", **fields})


# -- policy ---------------------------------------------------------------------------------------
def test_globs_decide_first_and_the_stricter_list_wins() -> None:
    up = server(allow=["git_*"], ask=["git_commit"], deny=["git_re*"])
    assert decide(up, tool("git_log")) == "allow"
    assert decide(up, tool("git_commit", read_only=True)) == "ask"  # a glob beats the annotation
    assert decide(up, tool("git_reset", read_only=True)) == "deny"
    assert decide(up, None) == "deny"  # a tool the upstream does not list


def test_without_a_matching_glob_the_annotations_decide() -> None:
    up = server()
    assert decide(up, tool("look", read_only=True)) == "allow"
    assert decide(up, tool("wipe", destructive=True)) == "deny"
    assert decide(up, tool("write")) == "ask"
    assert decide(up, Tool(name="bare", input_schema={"type": "object"})) == "ask"


# -- names ----------------------------------------------------------------------------------------
def test_principals_name_token_clients_every_stdio_client_or_one_stdio_identity() -> None:
    """docs/code-mode.md: a token name, "local" (every stdio client of this server: its OS user's
    ``user:NAME`` and configured ``local:NAME`` identities), or one identity with its kind."""
    settings = CodeModeSettings(
        servers=[
            server(name="tokens", principals=["alice"]),
            server(name="stdio", principals=["local"]),
            server(name="one", principals=["local:ci", "user:bob"]),
            server(name="everyone"),
        ]
    )
    seen = {
        identity: sorted(s.name for s in settings.servers_for(identity))
        for identity in ("token:alice", "token:local", "user:bob", "local:ci", "local:other", "local", "token:bob")
    }
    assert seen == {
        "token:alice": ["everyone", "tokens"],
        "token:local": ["everyone"],  # a token named "local" is not a stdio client
        "user:bob": ["everyone", "one", "stdio"],
        "local:ci": ["everyone", "one", "stdio"],
        "local:other": ["everyone", "stdio"],
        "local": ["everyone", "stdio"],  # a server built in memory
        "token:bob": ["everyone"],  # "user:bob" names the OS user bob over stdio, not the token bob
    }
    broker = Broker(settings, task_group=None)  # type: ignore[arg-type]  # nothing is started
    assert [s.name for s in broker.servers_for("user:bob")] == ["stdio", "one", "everyone"]


def test_tool_names_become_identifiers_by_one_rule_and_arguments_keep_theirs() -> None:
    assert identifier("my-tool") == "my_tool"
    assert identifier("import") == "import_"
    assert identifier("match") == "match_"  # a soft keyword too
    assert identifier("3d-render") == "_3d_render"
    assert identifier("a.b c") == "a_b_c"
    camel = Tool(name="get-thing", input_schema={"type": "object", "properties": {"entityNames": {"type": "array"}}})
    specs = tool_specs("s", [camel, Tool(name="get_thing", input_schema={"type": "object"})])
    assert [spec.name for spec in specs] == ["get_thing", "get_thing_2"]
    assert [spec.tool for spec in specs] == ["get-thing", "get_thing"]
    assert specs[0].params[0].name == "entityNames"


# -- approvals ------------------------------------------------------------------------------------
def test_an_approval_is_answered_once_and_taken_once() -> None:
    approvals = RunApprovals()
    approval = Approval(1, "git", "git_commit", {"message": "m"})
    approvals.add(approval)
    assert approvals.take(approval.key) is approval
    assert approvals.take(approval.key) is None  # a replayed answer finds nothing
    assert approval.answer(True, "approved") is True
    assert approval.answer(False, "too late") is False  # the first answer stands
    assert approval.allowed and approval.reason == "approved"


# -- results --------------------------------------------------------------------------------------
def test_a_long_text_result_keeps_its_head_and_tail_and_says_so() -> None:
    text = "HEAD" + "x" * 100_000 + "TAIL"
    result = CallToolResult(content=[TextContent(text=text)])
    body = result_body(result, tool("t"), raw=False, cap=4096)
    value = body["value"]
    assert value.startswith("HEAD") and value.endswith("TAIL")
    assert "characters of the tool's result cut" in value and len(value) < 4096


def test_a_structured_result_over_the_cap_is_refused_as_over_budget() -> None:
    big = Tool(name="t", input_schema={"type": "object"}, output_schema={"type": "object"})
    result = CallToolResult(content=[TextContent(text="{}")], structured_content={"rows": ["x" * 100] * 100})
    with pytest.raises(Refused) as caught:
        result_body(result, big, raw=False, cap=1024)
    assert caught.value.kind == "budget" and "max_result_kb" in str(caught.value)


# -- the broker's call: audit line and metric -----------------------------------------------------
class StandInUpstream:
    def __init__(self, tools: list[Tool]) -> None:
        self.tools = {item.name: item for item in tools}
        self.called: list[dict[str, Any]] = []

    async def list_tools(self) -> dict[str, Tool]:
        return self.tools

    async def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> CallToolResult:
        self.called.append(arguments)
        return CallToolResult(content=[TextContent(text="done")])

    async def aclose(self) -> None:
        return None


class StandInClock:
    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        yield


@contextlib.asynccontextmanager
async def broker_with(up: UpstreamServer, tools: list[Tool], **settings: Any) -> AsyncIterator[Broker]:
    async with anyio.create_task_group() as group:
        broker = Broker(CodeModeSettings(servers=[up], **settings), group)
        broker.upstreams[up.name] = StandInUpstream(tools)  # type: ignore[assignment]
        yield broker
        group.cancel_scope.cancel()


def call(tool_name: str, number: int = 1) -> wire.ToolCall:
    return wire.ToolCall(ev="tool_call", id=7, call=number, server="up", tool=tool_name)


def decisions(server_name: str, decision: str) -> float:
    return (
        metrics.REGISTRY.get_sample_value("mcpx_code_mode_calls_total", {"server": server_name, "decision": decision})
        or 0.0
    )


async def test_every_call_has_one_audit_line_without_argument_values_and_a_metric(
    caplog: pytest.LogCaptureFixture,
) -> None:
    up = server(deny=["wipe"])
    arguments = json.dumps({"text": SECRET_VALUE}).encode()
    before = decisions("up", "allow"), decisions("up", "deny")
    async with broker_with(up, [tool("look", read_only=True), tool("wipe")]) as broker:
        budget = broker.new_budget()
        with caplog.at_level(logging.INFO, logger="mcp_code_exec.audit"):
            allowed, _ = await broker.answer("local", budget, call("look", 1), arguments, StandInClock())  # type: ignore[arg-type]
            denied, _ = await broker.answer("local", budget, call("wipe", 2), arguments, StandInClock())  # type: ignore[arg-type]
    assert allowed.ok and not denied.ok and denied.error == "denied"
    lines = [record for record in caplog.records if record.name == "mcp_code_exec.audit"]
    assert len(lines) == 2
    assert all(SECRET_VALUE not in record.getMessage() for record in lines)
    assert "decision=allow" in lines[0].getMessage() and "decision=deny" in lines[1].getMessage()
    as_json = json.loads(JsonFormatter().format(lines[1]))
    assert as_json["logger"] == "mcp_code_exec.audit" and SECRET_VALUE not in json.dumps(as_json)
    assert (as_json["identity"], as_json["server"], as_json["tool"], as_json["decision"], as_json["outcome"]) == (
        "local", "up", "wipe", "deny", "denied",
    )  # fmt: skip
    assert (decisions("up", "allow"), decisions("up", "deny")) == (before[0] + 1, before[1] + 1)


async def test_an_approval_nobody_answers_denies_when_ask_timeout_s_passes() -> None:
    before = decisions("up", "ask_timeout")
    async with broker_with(server(), [tool("write")], ask_timeout_s=0.05) as broker:
        budget = broker.new_budget()
        reply, payload = await broker.answer("local", budget, call("write"), b"{}", StandInClock())  # type: ignore[arg-type]
        upstream: Any = broker.upstreams["up"]
    assert not reply.ok and reply.error == "denied" and "nobody answered" in json.loads(payload)["message"]
    assert upstream.called == [] and budget.approvals.waiting() == []
    assert decisions("up", "ask_timeout") == before + 1


# -- config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("table", "said"),
    [
        ('name = "up"\ncommand = "python3"\ncolour = "red"', "colour"),
        ('name = "up"\ncommand = "no-such-program-4242"', "does not exist"),
        ('name = "my-server"\ncommand = "python3"', "is not a Python identifier"),
        (
            'name = "up"\nurl = "https://example.invalid/mcp"\nheaders = {Authorization = "${UNSET_TOKEN_4242}"}',
            "not set",
        ),
    ],
)
def test_a_bad_server_entry_is_one_clear_line_at_start(tmp_path: Path, table: str, said: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"[[code_mode.servers]]\n{table}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    message = str(caught.value)
    assert said in message and "\n" not in message.strip(), message


# -- run_python's description ---------------------------------------------------------------------
def test_the_description_lists_a_line_per_tool_then_a_count_and_search_past_a_few_dozen() -> None:
    few = tool_specs("up", [tool(f"t{index}") for index in range(3)])
    text = code_mode_text(few)
    assert "mcp_tools.up.t0(text=None)" in text and "mcp_tools.up.t2(text=None)" in text
    many = tool_specs("up", [tool(f"t{index}") for index in range(TOOLS_INLINE + 1)])
    text = code_mode_text(many)
    assert f"{TOOLS_INLINE + 1} tools" in text and "mcp_tools.search(" in text and "mcp_tools.up.t0(" not in text
    assert code_mode_text([]) == ""


async def test_a_call_cancelled_with_its_run_still_has_its_audit_line(caplog: pytest.LogCaptureFixture) -> None:
    started = anyio.Event()

    class Hanging(StandInUpstream):
        async def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> CallToolResult:
            started.set()
            await anyio.Event().wait()  # never answers: the run ends first
            raise AssertionError("unreachable")

    async with broker_with(server(), []) as broker:
        broker.upstreams["up"] = Hanging([tool("look", read_only=True)])  # type: ignore[assignment]
        budget = broker.new_budget()
        with caplog.at_level(logging.INFO, logger="mcp_code_exec.audit"):
            async with anyio.create_task_group() as run:
                clock: Any = StandInClock()
                run.start_soon(broker.answer, "local", budget, call("look"), b"{}", clock)
                with anyio.fail_after(10):
                    await started.wait()
                run.cancel_scope.cancel()
    lines = [record.getMessage() for record in caplog.records if record.name == "mcp_code_exec.audit"]
    assert len(lines) == 1 and "decision=allow" in lines[0] and "outcome=cancelled" in lines[0], lines


async def test_a_call_to_a_server_that_does_not_exist_still_spends_the_runs_budget() -> None:
    async with broker_with(server(), [tool("look", read_only=True)], max_calls=2) as broker:
        budget = broker.new_budget()
        clock: Any = StandInClock()
        for number in (1, 2):
            forged = wire.ToolCall(ev="tool_call", id=7, call=number, server="nope", tool="look")
            refused, _ = await broker.answer("local", budget, forged, b"{}", clock)
            assert refused.error == "denied"
        past, _ = await broker.answer("local", budget, call("look", 3), b"{}", clock)
    assert past.error == "budget" and budget.calls == 3


async def test_a_run_that_sends_more_calls_than_it_may_is_ended_before_the_host_answers_them() -> None:
    answered: list[int] = []

    class Answers:
        most_calls = 3

        async def __call__(self, call: wire.ToolCall, arguments: bytes, clock: Any) -> tuple[wire.ToolReply, bytes]:
            answered.append(call.call)
            return wire.ToolReply(id=call.id, call=call.call, ok=False, error="budget"), b"{}"

    class Channel:
        async def send(self, frame: bytes) -> None:
            return None

    async with anyio.create_task_group() as group:
        calls = ToolCalls(Answers(), Channel(), group, StandInClock())  # type: ignore[arg-type]
        for number in (1, 2, 3):
            calls.start(call("look", number), b"{}")
        with pytest.raises(ProtocolViolation, match="more than 3 tool calls"):
            calls.start(call("look", 4), b"{}")
    assert answered == [1, 2, 3]
