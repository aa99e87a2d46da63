"""Which calls go ahead: per server and tool, ``allow``, ``ask`` or ``deny``.

The server's globs decide first (deny before ask before allow, so a tool named by two lists gets
the stricter); where none matches, the tool's own annotations do: ``readOnlyHint`` → allow,
``destructiveHint`` → deny, anything else → ask. A tool the upstream does not list is denied.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Literal

from mcp.types import Tool

from ..config.code_mode import UpstreamServer

Decision = Literal["allow", "ask", "deny"]


def decide(server: UpstreamServer, tool: Tool | None) -> Decision:
    if tool is None:
        return "deny"
    for decision, globs in (("deny", server.deny), ("ask", server.ask), ("allow", server.allow)):
        if any(fnmatchcase(tool.name, glob) for glob in globs):
            return decision  # type: ignore[return-value]
    hints = tool.annotations
    if hints is not None and hints.read_only_hint:
        return "allow"
    if hints is not None and hints.destructive_hint:
        return "deny"
    return "ask"
