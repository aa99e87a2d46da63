"""Upstream tools as sandbox code names them, and the catalog a run's ``mcp_tools`` is built from.

One rule makes a tool's name an identifier: every character that cannot be in one becomes ``_``,
a leading digit gets a ``_`` before it, a Python keyword gets a trailing ``_``, and a name taken
already gets ``_2``, ``_3``... (``my-tool`` → ``my_tool``, ``3d`` → ``_3d``, ``import`` →
``import_``). Arguments keep the tool's own names (``entityNames`` stays ``entityNames``).
"""

from __future__ import annotations

import keyword
import re
from typing import Any

from mcp.types import Tool

from ..protocol.messages import ToolParam, ToolSpec

DESCRIPTION_MAX = 4000
PARAMS_MAX = 256
NOT_IDENTIFIER = re.compile(r"\W", re.ASCII)


def identifier(name: str) -> str:
    text = NOT_IDENTIFIER.sub("_", name) or "_"
    if text[0].isdigit():
        text = "_" + text
    return text + "_" if keyword.iskeyword(text) or keyword.issoftkeyword(text) else text


def tool_specs(server: str, tools: list[Tool]) -> list[ToolSpec]:
    taken: set[str] = set()
    specs = []
    for tool in tools:
        name = base = identifier(tool.name)
        suffix = 2
        while name in taken:
            name, suffix = f"{base}_{suffix}", suffix + 1
        taken.add(name)
        specs.append(
            ToolSpec(
                server=server,
                name=name,
                tool=tool.name,
                description=(tool.description or "")[:DESCRIPTION_MAX],
                params=parameters(tool.input_schema),
                structured=tool.output_schema is not None,
                open=tool.input_schema.get("additionalProperties", True) is not False,
            )
        )
    return specs


def parameters(schema: dict[str, Any]) -> list[ToolParam]:
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = schema.get("required")
    required = required if isinstance(required, list) else []
    params = []
    for name, spec in list(properties.items())[:PARAMS_MAX]:
        kind = spec.get("type") if isinstance(spec, dict) else None
        params.append(
            ToolParam(name=str(name), required=name in required, type=kind if isinstance(kind, str) else None)
        )
    return params
