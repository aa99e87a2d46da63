"""The tools' published output schemas: optional fields as type lists, valid for exactly what pydantic's were."""

from __future__ import annotations

from typing import Any

import pytest
from _fake_agent import FakeAgent
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from mcp import Client
from test_service_in_memory import running, settings

from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.mcp_server.sdk import type_lists
from mcp_code_exec.models import RunResult

pytestmark = pytest.mark.anyio


def null_pairs(node: Any) -> int:
    """How many ``anyOf`` of a bare type and null ``node`` holds."""
    if isinstance(node, list):
        return sum(null_pairs(item) for item in node)
    if not isinstance(node, dict):
        return 0
    branches = node.get("anyOf")
    bare = (
        isinstance(branches, list)
        and len(branches) == 2
        and {"type": "null"} in branches
        and all(set(branch) == {"type"} for branch in branches)
    )
    return int(bare) + sum(null_pairs(value) for value in node.values())


def test_an_optional_bare_type_becomes_a_type_list_and_keeps_its_other_keywords() -> None:
    field = {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "description": "a line"}
    assert type_lists(field) == {"default": None, "description": "a line", "type": ["integer", "null"]}


@pytest.mark.parametrize(
    "node",
    [
        {"anyOf": [{"$ref": "#/$defs/Usage"}, {"type": "null"}]},  # a model, not a bare type
        {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},  # a type with a keyword of its own
        {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
        {"anyOf": [{"type": "null"}, {"type": "null"}]},
        {"type": "object", "anyOf": [{"type": "string"}, {"type": "null"}]},  # would lose its own type
        {"properties": {"anyOf": {"type": "string"}}},  # a property that happens to be called anyOf
        {"const": {"anyOf": [{"type": "string"}, {"type": "null"}]}},  # a value that looks like a schema
        {"enum": [{"anyOf": [{"type": "string"}, {"type": "null"}]}]},
        {"default": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    ],
)
def test_anything_else_is_left_as_it_was(node: dict[str, Any]) -> None:
    assert type_lists(node) == node


async def test_run_pythons_published_schema_says_yes_and_no_to_the_same_answers_as_the_models() -> None:
    async with running(FakeAgent(), settings()) as (service, _), Client(build_server(service)) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        answer = await client.call_tool("run_python", {"code": "print(1+1)"})
    published = tools["run_python"].output_schema
    assert published is not None and null_pairs(published) == 0
    original = RunResult.model_json_schema()
    assert null_pairs(original) > 5  # what the change is about is there to change
    good = answer.structured_content
    assert good is not None and good["session_id"] is None  # nulls among the fields checked
    answers = [
        good,
        good | {"session_id": "s_abc"},
        good | {"session_id": 3},
        good | {"stdout": None},
        good | {"result": ["not", "text"]},
        good | {"usage": {**good["usage"], "cpu_user_s": "fast"}},
        good | {"usage": {**good["usage"], "cpu_user_s": None}},
        good | {"error": {"type": "E", "message": "m", "line": "7"}},
    ]
    verdicts = [[Draft202012Validator(schema).is_valid(each) for each in answers] for schema in (original, published)]
    assert verdicts[0] == verdicts[1] == [True, True, False, False, False, False, True, False]
