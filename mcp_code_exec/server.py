"""The MCP face of the sandbox service: six tools, files as resources, change notifications.

This is the only module that imports ``mcp``. It turns service results into content blocks and
structured content, and service errors into tool errors (``_tool_errors``), in one place each.
"""

from __future__ import annotations

import base64
import functools
import logging
import re
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, ParamSpec, TypeVar

import anyio
from mcp.server import NotificationOptions
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.lowlevel.helper_types import ReadResourceContents
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp.server.subscriptions import InMemorySubscriptionBus, ResourcesListChanged, ResourceUpdated
from mcp.types import (
    CallToolResult,
    EmbeddedResource,
    EmptyResult,
    ImageContent,
    InputRequiredResult,
    ListResourcesResult,
    PaginatedRequestParams,
    Resource,
    ResourceLink,
    SubscribeRequestParams,
    TextContent,
    TextResourceContents,
    ToolAnnotations,
    UnsubscribeRequestParams,
)
from pydantic import BaseModel, Field

from .errors import SandboxError
from .models import DirEntry, FileInfo, RunResult, SessionInfo
from .service import SandboxService, guess_mime, run_uri, session_uri
from .text import render_run

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

SESSION_URI = re.compile(r"^sandbox://sessions/(?P<sid>[^/]+)/files/(?P<path>.+)$")
RUN_URI = re.compile(r"^sandbox://runs/(?P<rid>[^/]+)/files/(?P<path>.+)$")
TEXT_MIMES = ("text/", "application/json", "application/xml", "application/javascript")
MODERN = "2026-07-28"

INSTRUCTIONS = """\
Runs Python 3 code in isolated, resource-limited Docker sandboxes.
- Preinstalled: numpy, pandas, matplotlib, scipy, sympy, pillow, IPython. There is no network
  access by default, so `pip install` will not work.
- `run_python` without `session_id` is stateless: a fresh interpreter and empty filesystem each
  call. Use `new_session` for state (variables, imports, files) that persists across calls.
- Files live under /mnt/data (the working directory). Files a run creates come back as resources.
- The last expression's value is returned (like a notebook cell); matplotlib figures come back as
  images; exceptions come back with a traceback.
"""


class ClosedSession(BaseModel):
    session_id: str
    closed: bool = True


class FileListing(BaseModel):
    session_id: str
    path: str
    entries: list[DirEntry]
    truncated: bool = Field(False, description="more entries exist than were listed")


class _Subscribers:
    """Legacy (2025-era) resources/subscribe bookkeeping.

    Subscriptions live on the client's connection object, so they go away with it; a weak set
    of connections lets us find them without keeping any connection alive.
    """

    ATTRIBUTE = "_mcp_code_exec_subscriptions"

    def __init__(self) -> None:
        self.connections: weakref.WeakSet[Any] = weakref.WeakSet()

    def add(self, uri: str, session: Any) -> None:
        connection = getattr(session, "_connection", session)
        subscriptions = connection.__dict__.setdefault(self.ATTRIBUTE, {})
        subscriptions[uri] = session
        self.connections.add(connection)

    def remove(self, uri: str, session: Any) -> None:
        connection = getattr(session, "_connection", session)
        connection.__dict__.get(self.ATTRIBUTE, {}).pop(uri, None)

    def sessions(self, uri: str) -> list[Any]:
        found = []
        for connection in list(self.connections):
            session = connection.__dict__.get(self.ATTRIBUTE, {}).get(uri)
            if session is not None:
                found.append(session)
        return found


_connection_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_connection_counter = 0


def owner_of(request_context: Any) -> str:
    """Who owns sessions made in this request: the bearer identity, plus the connection if any.

    2025-era clients hold a connection (stdio, SSE, in-memory, HTTP with Mcp-Session-Id), and
    their sessions are bound to it. The 2026-07-28 protocol is sessionless: every request is
    its own connection, so there the bearer identity alone owns a session (over stdio the
    process serves exactly one client; over HTTP each token is an identity).
    """
    global _connection_counter
    token = get_access_token()
    identity = f"token:{token.client_id}" if token is not None else "local"
    if request_context.protocol_version == MODERN:
        return identity
    connection = getattr(request_context.session, "_connection", request_context.session)
    if connection not in _connection_ids:
        _connection_counter += 1
        _connection_ids[connection] = f"c{_connection_counter}"
    return f"{identity}/{_connection_ids[connection]}"


def _tool_errors(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Our errors become tool errors with their sentence; nothing else leaks detail.

    Also the one log line per call: tool, outcome, duration (never arguments or user code).
    """

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        started = time.perf_counter()
        outcome = "ok"
        try:
            result = await fn(*args, **kwargs)
            if isinstance(result, CallToolResult) and result.is_error:
                status = (result.structured_content or {}).get("status", "error")
                outcome = f"result {status}"
            return result
        except SandboxError as exc:
            outcome = f"error {type(exc).__name__}"
            raise ToolError(str(exc)) from exc
        except BaseException as exc:
            outcome = f"failed {type(exc).__name__}"
            raise
        finally:
            log.info("tool %s: %s in %.1f ms", fn.__name__, outcome, (time.perf_counter() - started) * 1000)

    return wrapper


class SandboxServer(MCPServer):
    """MCPServer with per-client dynamic resource listing and per-file mime types."""

    service: SandboxService

    async def _handle_list_resources(self, ctx: Any, params: PaginatedRequestParams | None) -> ListResourcesResult:
        owner = owner_of(ctx)
        resources: list[Resource] = list(await super().list_resources())
        resources += [
            Resource(uri=info.uri, name=info.path, mime_type=info.mime_type, size=info.size)
            for info in await self.service.session_files(owner)
            if info.uri is not None
        ]
        for run_id, path, size in self.service.run_files.listing(owner):
            resources.append(Resource(uri=run_uri(run_id, path), name=path, mime_type=guess_mime(path), size=size))
        return ListResourcesResult(resources=resources)

    async def read_resource(self, uri: Any, context: Any = None) -> Any:
        contents = await super().read_resource(uri, context)
        if isinstance(contents, InputRequiredResult):
            return contents
        mime = guess_mime(str(uri))
        return [ReadResourceContents(c.content, mime, c.meta) for c in contents]


def build_server(service: SandboxService, *, auth: dict[str, Any] | None = None) -> SandboxServer:
    """The MCP server over an already running service (created once per process)."""

    @asynccontextmanager
    async def lifespan(_: MCPServer) -> AsyncIterator[SandboxService]:
        yield service  # per connection on SSE, once on stdio: the service itself outlives them

    bus = InMemorySubscriptionBus()
    from . import __version__

    server = SandboxServer(
        "mcp-code-exec",
        version=__version__,
        instructions=INSTRUCTIONS,
        lifespan=lifespan,
        subscriptions=bus,
        **(auth or {}),
    )
    server.service = service
    subscribers = _Subscribers()
    _register_legacy_subscriptions(server, subscribers)

    async def publish_changes(ctx: Context, session_id: str | None, changed: list[str]) -> None:
        """Tell clients of both protocol eras what changed (the SDK has a pipe for each)."""
        with anyio.move_on_after(2):
            await bus.publish(ResourcesListChanged())
            try:
                await ctx.session.send_resource_list_changed()
            except Exception as exc:  # noqa: BLE001 - a gone client must not fail the call
                log.debug("list_changed not delivered: %s", exc)
            if session_id is None:
                return  # a stateless run's files: the list changed, no session file was updated
            for path in changed:
                uri = session_uri(session_id, path)
                await bus.publish(ResourceUpdated(uri=uri))
                for subscriber in subscribers.sessions(uri):
                    try:
                        await subscriber.send_resource_updated(uri)
                    except Exception as exc:  # noqa: BLE001 - a gone client must not fail the call
                        log.debug("resource update not delivered: %s", exc)

    _register_tools(server, service, publish_changes)
    _register_resources(server, service)

    @server.custom_route("/healthz", methods=["GET"])  # type: ignore[untyped-decorator]
    async def healthz(_request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"ok": True, "idle": service.stateless.idle, "sessions": len(service.sessions)})

    return server


def _register_legacy_subscriptions(server: SandboxServer, subscribers: _Subscribers) -> None:
    # The SDK serves no resources/subscribe for 2025-era clients; these private hooks are the
    # documented workaround (see the SDK's migration notes).
    lowlevel = server._lowlevel_server

    async def on_subscribe(ctx: Any, params: SubscribeRequestParams) -> EmptyResult:
        subscribers.add(str(params.uri), ctx.session)
        return EmptyResult()

    async def on_unsubscribe(ctx: Any, params: UnsubscribeRequestParams) -> EmptyResult:
        subscribers.remove(str(params.uri), ctx.session)
        return EmptyResult()

    lowlevel.add_request_handler("resources/subscribe", SubscribeRequestParams, on_subscribe)
    lowlevel.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, on_unsubscribe)
    lowlevel.create_initialization_options = functools.partial(  # type: ignore[method-assign]
        lowlevel.create_initialization_options, notification_options=NotificationOptions(resources_changed=True)
    )


EMBED_TEXT_MAX = 4096


def _run_content(result: RunResult, embedded: dict[str, str] | None = None) -> CallToolResult:
    """Text first, then one image block per image, then a link (or, for small text, the file itself)."""
    content: list[Any] = [TextContent(text=render_run(result))]
    for image in result.images:
        content.append(ImageContent(data=base64.b64encode(image.data).decode(), mime_type=image.mime_type))
    for info in result.files:
        if info.uri is None:
            continue
        if embedded and info.uri in embedded:
            resource = TextResourceContents(uri=info.uri, mime_type=info.mime_type, text=embedded[info.uri])
            content.append(EmbeddedResource(resource=resource))
        content.append(ResourceLink(uri=info.uri, name=info.path, mime_type=info.mime_type, size=info.size))
    return CallToolResult(
        content=content,
        structured_content=result.model_dump(mode="json"),
        is_error=result.status != "ok",
    )


Publisher = Callable[[Context, str | None, list[str]], Awaitable[None]]


def _register_tools(server: SandboxServer, service: SandboxService, publish: Publisher) -> None:
    mutating = ToolAnnotations(
        read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False
    )

    @server.tool(title="Run Python", annotations=mutating)
    @_tool_errors
    async def run_python(
        code: Annotated[
            str, Field(description="Python source, run like a notebook cell: the last expression's value is returned")
        ],
        ctx: Context,
        session_id: Annotated[
            str | None, Field(description="Run inside this session (from new_session); omit for a fresh, stateless run")
        ] = None,
        timeout: Annotated[  # noqa: ASYNC109 - the tool's contract; deadlines are applied with anyio inside
            float | None, Field(gt=0, description="Wall-clock seconds before the run is stopped (capped by the server)")
        ] = None,
    ) -> Annotated[CallToolResult, RunResult]:
        """Run Python 3 code in an isolated sandbox and return its output.

        Returns stdout, stderr, the value of the last expression, matplotlib figures and
        displayed images (as images), a traceback on error, and files written to /mnt/data (as
        resources). numpy, pandas, matplotlib, scipy, sympy and pillow are installed; there is no
        network. Without session_id every call starts from scratch; with one, variables and
        files persist. IPython magics and `!cmd` work.
        """
        owner = owner_of(ctx.request_context)
        on_output = _progress_reporter(ctx)
        result = await service.run(owner, code, session_id=session_id, timeout=timeout, on_output=on_output)
        if result.files:
            await publish(ctx, session_id, [f.path for f in result.files])
        return _run_content(result, _small_text_files(service, owner, result))

    @server.tool(title="New session", annotations=mutating)
    @_tool_errors
    async def new_session(ctx: Context) -> SessionInfo:
        """Start a persistent Python session: variables, imports and files under /mnt/data survive
        between run_python calls that pass its session_id. Close it with close_session when done;
        idle sessions are closed automatically."""
        return await service.new_session(owner_of(ctx.request_context))

    @server.tool(
        title="Close session",
        annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=False, open_world_hint=False),
    )
    @_tool_errors
    async def close_session(
        session_id: Annotated[str, Field(description="The session to close")], ctx: Context
    ) -> ClosedSession:
        """Close a session: its interpreter, container and files are deleted."""
        await service.close_session(owner_of(ctx.request_context), session_id)
        return ClosedSession(session_id=session_id)

    @server.tool(title="List files", annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    @_tool_errors
    async def list_files(
        session_id: Annotated[str, Field(description="The session whose files to list")],
        ctx: Context,
        path: Annotated[str, Field(description="Directory relative to /mnt/data")] = ".",
    ) -> FileListing:
        """List files under /mnt/data of a session (recursively, capped), with sizes and resource URIs."""
        entries, truncated = await service.list_files(owner_of(ctx.request_context), session_id, path)
        return FileListing(session_id=session_id, path=path, entries=entries, truncated=truncated)

    @server.tool(title="Read file", annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    @_tool_errors
    async def read_file(
        session_id: Annotated[str, Field(description="The session to read from")],
        path: Annotated[str, Field(description="File path relative to /mnt/data (or absolute under /mnt/data/)")],
        ctx: Context,
    ) -> CallToolResult:
        """Read a file from a session's /mnt/data: text comes back as text, images as images,
        anything else as a binary resource. Size-capped."""
        found = await service.read_file(owner_of(ctx.request_context), session_id, path)
        uri = session_uri(session_id, found.path)
        mime = guess_mime(found.path)
        if mime.startswith("image/") and mime in ("image/png", "image/jpeg", "image/gif", "image/webp"):
            block: Any = ImageContent(data=base64.b64encode(found.data).decode(), mime_type=mime)
        else:
            text = _as_text(found.data, mime)
            if text is not None:
                block = TextContent(text=text)
            else:
                from mcp.types import BlobResourceContents

                block = EmbeddedResource(
                    resource=BlobResourceContents(uri=uri, mime_type=mime, blob=base64.b64encode(found.data).decode())
                )
        return CallToolResult(content=[block, ResourceLink(uri=uri, name=found.path, mime_type=mime, size=found.size)])

    @server.tool(title="Write file", annotations=mutating)
    @_tool_errors
    async def write_file(
        session_id: Annotated[str, Field(description="The session to write into")],
        path: Annotated[str, Field(description="File path relative to /mnt/data; parent directories are created")],
        content: Annotated[str, Field(description="The file's content (text, or base64 with encoding='base64')")],
        ctx: Context,
        encoding: Annotated[Literal["utf-8", "base64"], Field(description="How content is encoded")] = "utf-8",
    ) -> FileInfo:
        """Write a file into a session's /mnt/data (replacing it atomically if it exists)."""
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except ValueError:
                raise ToolError("content is not valid base64; nothing was written") from None
        else:
            data = content.encode("utf-8", "surrogatepass")
        info = await service.write_file(owner_of(ctx.request_context), session_id, path, data)
        await publish(ctx, session_id, [info.path])
        return info


def _small_text_files(service: SandboxService, owner: str, result: RunResult) -> dict[str, str]:
    """Text files of a stateless run small enough to hand to the model inline."""
    embedded: dict[str, str] = {}
    for info in result.files:
        match = RUN_URI.match(info.uri or "")
        if match is None or info.size > EMBED_TEXT_MAX or not (info.mime_type or "").startswith(TEXT_MIMES):
            continue
        try:
            data, _ = service.read_run_file(owner, match["rid"], match["path"])
        except SandboxError:
            continue
        text = _as_text(data, info.mime_type or "text/plain")
        if text is not None:
            embedded[str(info.uri)] = text
    return embedded


def _progress_wanted(ctx: Context) -> bool:
    """Did the caller ask for progress? JSON-RPC carries a token, the in-memory dispatcher a callback."""
    outbound: Any = getattr(ctx.request_context.session, "_request_outbound", None)
    for _ in range(4):  # the SDK wraps dispatch contexts (e.g. _NoServerRequestsDispatchContext)
        if not hasattr(outbound, "_inner"):
            break
        outbound = outbound._inner
    for attribute in ("_progress_token", "_on_progress"):
        if hasattr(outbound, attribute):
            return getattr(outbound, attribute) is not None
    meta = ctx.request_context.meta
    return meta is None or getattr(meta, "progress_token", None) is not None


def _progress_reporter(ctx: Context) -> Callable[[str, str], Awaitable[None]] | None:
    if not _progress_wanted(ctx):
        return None  # the client did not ask: the sandbox need not stream at all
    count = 0

    async def report(stream: str, text: str) -> None:
        nonlocal count
        count += 1
        prefix = "" if stream == "stdout" else "[stderr] "
        await ctx.report_progress(count, None, prefix + text[-4000:])

    return report


def _as_text(data: bytes, mime: str) -> str | None:
    if not (mime.startswith(TEXT_MIMES) or mime == "application/octet-stream"):
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if "\x00" not in text else None


def _register_resources(server: SandboxServer, service: SandboxService) -> None:
    @server.resource(
        "sandbox://sessions/{session_id}/files/{+path}", name="session_file", mime_type="application/octet-stream"
    )
    async def session_file(session_id: str, path: str, ctx: Context) -> str | bytes:
        """A file under a session's /mnt/data."""
        try:
            found = await service.read_file(owner_of(ctx.request_context), session_id, path)
        except SandboxError as exc:
            raise ResourceError(str(exc)) from exc
        return _as_text(found.data, guess_mime(path)) or found.data

    @server.resource("sandbox://runs/{run_id}/files/{+path}", name="run_file", mime_type="application/octet-stream")
    async def run_file(run_id: str, path: str, ctx: Context) -> str | bytes:
        """A file a stateless run left in /mnt/data (kept for a limited time)."""
        try:
            data, _ = service.read_run_file(owner_of(ctx.request_context), run_id, path)
        except SandboxError as exc:
            raise ResourceError(str(exc)) from exc
        return _as_text(data, guess_mime(path)) or data


__all__ = ["RUN_URI", "SESSION_URI", "build_server", "owner_of"]
