"""Every use of the MCP SDK's internals, in one place, each with the reason it is needed.

SDK 2.3 has no public hook for these; when it grows one, only this module changes:
- per-request tool listing (app-only tools only for clients that declare MCP Apps), hence the
  ``_handle_list_tools`` override;
- per-request resource listing (``resources/list`` must know who asks: ``MCPServer.list_resources``
  gets no context), hence the ``_handle_list_resources`` override; ``tools/list`` likewise
  (``_handle_list_tools``): code mode's tools in ``run_python``'s description are the caller's;
- 2025-era ``resources/subscribe``, which MCPServer does not serve (the SDK's migration notes
  document adding it on ``_lowlevel_server``), and advertising list-changed to those clients;
- whether the caller asked for progress (the dispatch contexts hold the token or callback);
- strict input schemas (``additionalProperties: false``) on the registered tools, and arguments held to
  them (the SDK's argument models ignore an unknown argument); output schemas whose optional fields
  say ``"type": [..., "null"]`` (cheaper for every client that validates an answer against them);
- a legacy connection object, to tell one 2025-era client connection from another, and our state
  kept on it (it has no place for it, and must go away with the connection);
- serving one client on streams of our own with the stdio transport's framing (``run_stdio_async``
  takes only the process's stdin and stdout): the lowlevel server's ``run``.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterable, Awaitable, Callable, Collection, Mapping
from typing import Any, TypeVar

from mcp.server import NotificationOptions
from mcp.server.apps import client_supports_apps
from mcp.server.lowlevel.helper_types import ReadResourceContents
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.stdio import stdio_server
from mcp.types import (
    EmptyResult,
    InputRequiredResult,
    ListResourcesResult,
    ListToolsResult,
    PaginatedRequestParams,
    SubscribeRequestParams,
    UnsubscribeRequestParams,
)
from pydantic import ConfigDict

from ..service.uris import guess_mime

SubscriptionHandler = Callable[[Any, str], Awaitable[None]]
Lister = Callable[[Any], Awaitable[ListResourcesResult]]
DescriptionExtras = Callable[[], Awaitable[dict[str, str]]]
FilesChanged = Callable[[str, list[str]], Awaitable[None]]  # (identity, URIs)
T = TypeVar("T")
STATE = "_mcp_code_exec_state"


class SandboxServer(MCPServer):
    """MCPServer whose ``resources/list`` answers each caller with its own resources, and whose
    ``tools/list`` leaves app-only tools (``_meta.ui.visibility == ["app"]``) out for clients that do
    not declare the MCP Apps extension."""

    def __init__(
        self,
        *args: Any,
        resource_lister: Lister | None = None,
        description_extras: DescriptionExtras | None = None,
        files_changed: FilesChanged | None = None,
        **kwargs: Any,
    ) -> None:
        """``resource_lister``: the caller's own resources; ``description_extras``: per tool, text the
        caller's descriptions end with; ``files_changed``: tells an identity's clients of both eras that
        these files changed. The rest is ``MCPServer``'s."""
        super().__init__(*args, **kwargs)
        self.resource_lister = resource_lister
        self.description_extras = description_extras
        self.files_changed = files_changed

    async def read_resource(self, uri: Any, context: Any = None) -> Any:
        """Each file with its own MIME type (a resource template has only one)."""
        contents = await super().read_resource(uri, context)
        if isinstance(contents, InputRequiredResult) or str(uri).startswith("ui://"):
            return contents  # an MCP Apps view keeps its text/html;profile=mcp-app
        mime = guess_mime(str(uri))
        return [
            ReadResourceContents(c.content, c.mime_type if mime == "application/octet-stream" else mime, c.meta)
            for c in contents
        ]

    async def _handle_list_tools(self, ctx: Any, params: PaginatedRequestParams | None) -> ListToolsResult:
        listed = await super()._handle_list_tools(ctx, params)
        apps = client_supports_apps(ctx)  # the view's app-only tools, for the hosts that render it
        extras = await self.description_extras() if self.description_extras is not None else {}
        return ListToolsResult(
            tools=[
                tool.model_copy(update={"description": (tool.description or "") + extras[tool.name]})
                if tool.name in extras
                else tool
                for tool in listed.tools
                if apps or not app_only(tool.meta)
            ]
        )

    async def _handle_list_resources(self, ctx: Any, params: PaginatedRequestParams | None) -> ListResourcesResult:
        base = ListResourcesResult(resources=list(await super().list_resources()))
        if self.resource_lister is None:
            return base
        mine = await self.resource_lister(ctx)
        return ListResourcesResult(resources=[*base.resources, *mine.resources])


def app_only(meta: Mapping[str, Any] | None) -> bool:
    ui = (meta or {}).get("ui")
    return isinstance(ui, Mapping) and list(ui.get("visibility") or ["model"]) == ["app"]


def serve_legacy_subscriptions(
    server: MCPServer, subscribe: SubscriptionHandler, unsubscribe: SubscriptionHandler
) -> None:
    """Serve 2025-era ``resources/subscribe``/``unsubscribe`` and advertise list-changed events."""
    lowlevel = server._lowlevel_server

    async def on_subscribe(ctx: Any, params: SubscribeRequestParams) -> EmptyResult:
        await subscribe(ctx, str(params.uri))
        return EmptyResult()

    async def on_unsubscribe(ctx: Any, params: UnsubscribeRequestParams) -> EmptyResult:
        await unsubscribe(ctx, str(params.uri))
        return EmptyResult()

    lowlevel.add_request_handler("resources/subscribe", SubscribeRequestParams, on_subscribe)
    lowlevel.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, on_unsubscribe)
    lowlevel.create_initialization_options = functools.partial(  # type: ignore[method-assign]
        lowlevel.create_initialization_options, notification_options=NotificationOptions(resources_changed=True)
    )


def connection_of(session: Any) -> Any:
    """The object that lives as long as a 2025-era client's connection (its session, else itself)."""
    return getattr(session, "_connection", session)


def kept_on(connection: Any, make: Callable[[], T]) -> T:
    """Our state kept on a ``connection_of`` object (made by ``make`` the first time), so that it goes
    away with the connection."""
    state: T = connection.__dict__.setdefault(STATE, make())
    return state


async def serve_streams(server: MCPServer, stdin: AsyncIterable[str], stdout: Any = None) -> None:
    """Serve one client whose lines are read from ``stdin`` and written to ``stdout`` (an object with
    ``async write(text)`` and ``flush()``; default: this process's standard output), until its lines end."""
    lowlevel = server._lowlevel_server
    async with stdio_server(stdin=stdin, stdout=stdout) as (read_stream, write_stream):  # type: ignore[arg-type]
        await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())


def progress_requested(ctx: Context) -> bool:
    """Did the caller ask for progress? True when unsure (progress is then sent and dropped if unwanted).

    The token is in the request's ``_meta`` on JSON-RPC transports; the 2026 HTTP and in-memory
    dispatchers hold it (or a callback) on their dispatch contexts.
    """
    meta = ctx.request_context.meta
    if isinstance(meta, Mapping) and meta.get("progressToken") is not None:
        return True
    if meta is not None and getattr(meta, "progress_token", None) is not None:
        return True
    outbound: Any = getattr(ctx.request_context.session, "_request_outbound", None)
    for _ in range(6):  # the SDK wraps dispatch contexts in one another
        for attribute in ("progress_token", "_progress_token", "_on_progress"):
            if hasattr(outbound, attribute):
                return getattr(outbound, attribute) is not None
        outbound = getattr(outbound, "_inner", None)
        if outbound is None:
            break
    return True


def make_input_schemas_strict(server: MCPServer) -> None:
    """``additionalProperties: false`` on every tool's input schema (OpenAI's strict mode wants it),
    and an unknown argument refused as the schema says: a misspelt ``session_id`` would otherwise be
    dropped quietly, and the code run without the session the caller meant."""
    for tool in server._tool_manager.list_tools():
        tool.parameters.setdefault("additionalProperties", False)
        tool.parameters.setdefault("properties", {})
        loose = tool.fn_metadata.arg_model

        class Closed(loose):  # type: ignore[valid-type,misc]  # a model made at run time
            model_config = ConfigDict(**{**loose.model_config, "extra": "forbid"})

        Closed.__name__ = loose.__name__
        tool.fn_metadata.arg_model = Closed


def nullable_as_type_lists(server: MCPServer) -> None:
    """Each optional field of the tools' output schemas as ``"type": ["string", "null"]`` rather than
    pydantic's ``anyOf`` of two bare types: the same values are valid, and a client's jsonschema
    validator (the SDK's client validates every answer's ``structuredContent``) descends once where it
    descended three times: about 30% of that validation, which is most of what a client spends on
    ``run_python``'s answer beyond the floor's."""
    for tool in server._tool_manager.list_tools():
        if tool.fn_metadata.output_schema is not None:
            tool.fn_metadata.output_schema = type_lists(tool.fn_metadata.output_schema)


def type_lists(node: Any) -> Any:
    """``node`` (a JSON schema, or part of one) with every ``anyOf`` of a bare type and null as a type list."""
    if isinstance(node, list):
        return [type_lists(item) for item in node]
    if not isinstance(node, dict):
        return node
    branches = node.get("anyOf")
    if "type" not in node and isinstance(branches, list) and len(branches) == 2 and NULL in branches:
        other = branches[1] if branches[0] == NULL else branches[0]
        if isinstance(other, dict) and list(other) == ["type"] and isinstance(other["type"], str) and other != NULL:
            node = {key: value for key, value in node.items() if key != "anyOf"} | {"type": [other["type"], "null"]}
    return {key: value if key in DATA_KEYWORDS else type_lists(value) for key, value in node.items()}


NULL = {"type": "null"}
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: left as they are


def skip_output_validation(server: MCPServer, names: Collection[str]) -> None:
    """The named tools' results are not validated again against their output schema, which they
    still publish: each builds its ``structuredContent`` by dumping the model the schema is of
    (``answers.run_content``), so the SDK's validation of every answer re-checked what pydantic had
    just made, a stdout of a MiB included. The SDK reads the field at each call, and skips the
    validation of a schema published without a model."""
    for name in names:
        tool = server._tool_manager.get_tool(name)
        if tool is not None and tool.fn_metadata.output_schema is not None:
            tool.fn_metadata.output_model = None


def request_headers(ctx: Any) -> Mapping[str, str] | None:
    """The HTTP request's headers (None on stdio and in memory)."""
    headers = getattr(getattr(ctx, "request", None), "headers", None)
    return headers if isinstance(headers, Mapping) else None
