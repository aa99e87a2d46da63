"""The tools: thin adapters from MCP calls to the service, with one error mapping and one log line each.

Optional arguments are ``X | None = None`` and every input schema is closed
(``additionalProperties: false``), so OpenAI's strict mode takes them as they are.
"""

from __future__ import annotations

import base64
import functools
import logging
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Literal, ParamSpec, Protocol, TypeVar, cast

import anyio
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ToolAnnotations
from pydantic import BaseModel, Field

from ..config.units import MIB
from ..errors import SandboxError
from ..models import DirEntry, FileInfo, ForkedSessions, RunResult, SessionInfo, VariableListing, WrittenFile
from ..models import UsageReport as Usage
from ..observability import metrics
from ..observability.tracing import span
from ..protocol import paths
from ..service.port import ServicePort
from ..service.run_registry import Run
from ..service.uris import guess_mime, run_file_uri, session_file_uri
from .answers import file_content, run_content
from .approval import follow_asking, resume
from .audit_calls import audited_tool
from .descriptions import code_mode_text, tool_descriptions
from .identity import owner_of
from .notebook_view import FOR_MODEL
from .notify import Notifier
from .sdk import SandboxServer, skip_output_validation

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

MUTATING = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False)
READING = ToolAnnotations(read_only_hint=True, open_world_hint=False)
DESTRUCTIVE = ToolAnnotations(destructive_hint=True, idempotent_hint=False, open_world_hint=False)

SessionId = Annotated[str | None, Field(description="A session from new_session; omit for a fresh, stateless run")]
RunId = Annotated[str, Field(description="The run_id a run_python answer gave")]
UsageOf = Annotated[str | None, Field(description="A session whose runs to add up")]
Hosts = Annotated[list[str] | None, Field(description="Host patterns to keep, of those you may reach ([]: none)")]
Wait = Annotated[
    float | None, Field(ge=0, allow_inf_nan=False, description="Seconds this call waits for the run (capped)")
]


class ClosedSession(BaseModel):
    session_id: str
    closed: bool = True


class FileUrl(BaseModel):
    url: str = Field(description="GET it (download) or PUT/POST the raw bytes to it (upload); no auth header")
    method: Literal["GET", "PUT"]
    direction: Literal["upload", "download"]
    session_id: str
    path: str
    expires_in_s: float
    single_use: bool = Field(description="an upload URL works for one request")
    size: int | None = Field(None, description="the file's size in bytes (downloads)")
    max_bytes: int | None = Field(None, description="the largest upload this URL takes (the quota applies too)")
    example: str


class FileUrls(Protocol):
    """File URLs as the file_url tool hands them out (the HTTP host's ``http.file_routes.FileLinks``)."""

    @property
    def max_upload_bytes(self) -> int: ...
    @property
    def ttl_s(self) -> float: ...
    def issue(self, identity: str, session_id: str, path: str, direction: Literal["upload", "download"]) -> str: ...
    def url(self, token: str, headers: Mapping[str, str] | None) -> str: ...


class FileListing(BaseModel):
    session_id: str | None = None
    run_id: str | None = None
    path: str
    entries: list[DirEntry]
    truncated: bool = Field(False, description="more entries exist than were listed")


def tool_errors(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Our errors become tool errors with their sentence; nothing else leaks detail. One log line a
    call: tool, outcome, duration (never arguments or user code)."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        started, outcome = time.perf_counter(), "ok"
        try:
            result = await fn(*args, **kwargs)
            if isinstance(result, CallToolResult):
                status = (result.structured_content or {}).get("status")
                if result.is_error or status not in (None, "ok"):
                    outcome = f"result {status or 'error'}"
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


async def code_mode_descriptions(service: ServicePort) -> dict[str, str]:
    """run_python's description names the other servers' tools and the hosts this caller's code may reach."""
    text = code_mode_text(await service.tool_catalog(owner_of())) + await service.reach_text(owner_of())
    return {"run_python": text} if text else {}


class Tools:
    def __init__(
        self, server: SandboxServer, service: ServicePort, notifier: Notifier, links: FileUrls | None = None
    ) -> None:
        self.server = server
        self.service = service
        self.notifier = notifier
        self.links = links
        self.config = service.config
        self.resource_links = service.config.runs.resource_links

    def wait_s(self, wait: float | None) -> float:
        limits = self.config.limits
        return limits.wait_s if wait is None else min(max(0.0, wait), limits.wait_s)

    async def answer(self, run: Run, ctx: Context, wait: float | None, *, cancel_on_abandon: bool) -> CallToolResult:
        """Wait for a run as long as the caller may; answer its result, or 'running' with its output so
        far, or (code mode, a 2026 client) the question a tool call of the run waits on."""
        try:
            asked = await follow_asking(run, ctx, self.wait_s(wait), self.service.tool_approvals(run))
        except anyio.get_cancelled_exc_class():
            if cancel_on_abandon:  # the client cancelled the call that started the run: stop it
                await self.service.cancel_and_wait(run)
            raise
        if asked is not None:
            return cast(CallToolResult, asked)  # the SDK passes an InputRequiredResult through as it is
        ended = run.done
        result = self.service.deliver(run) if ended else run.progress()
        with span("mcpx.result.delivery", status=result.status):
            return run_content(result, links=self.resource_links)

    def register(self) -> None:
        texts = tool_descriptions(self.config, urls=self.links is not None)
        for name, fn, title, hints in (
            ("run_python", self.run_python, "Run Python", MUTATING),
            ("get_run", self.get_run, "Get a run's result", READING),
            ("cancel_run", self.cancel_run, "Cancel a run", DESTRUCTIVE),
            ("new_session", self.new_session, "New session", MUTATING),
            ("close_session", self.close_session, "Close session", DESTRUCTIVE),
            ("fork_session", self.fork_session, "Fork session", MUTATING),
            ("restrict_egress", self.restrict_egress, "Restrict egress", MUTATING),  # with [egress] only
            ("list_variables", self.list_variables, "List variables", READING),
            ("export_notebook", self.export_notebook, "Export notebook", MUTATING),
            ("list_files", self.list_files, "List files", READING),
            ("read_file", self.read_file, "Read file", READING),
            ("write_file", self.write_file, "Write file", MUTATING),
            ("file_url", self.file_url, "File URL (upload or download)", MUTATING),
            ("get_usage", self.get_usage, "Usage and quotas", READING),
        ):
            if not texts[name]:
                continue
            # Model-only: a host refuses the notebook view (see notebook_view) any call of these.
            tool = self.server.tool(name=name, title=title, description=texts[name], annotations=hints, meta=FOR_MODEL)
            tool(tool_errors(audited_tool(name, fn, self.config.audit, lambda: self.service.accounting.audit)))
        skip_output_validation(self.server, ("run_python", "get_run", "cancel_run"))  # run_content's own dumps

    # -- the tools ------------------------------------------------------------------------------------
    async def run_python(
        self,
        code: Annotated[str, Field(description="Python source, run like a notebook cell")],
        ctx: Context,
        session_id: SessionId = None,
        timeout: Annotated[  # noqa: ASYNC109 - the run's deadline inside the sandbox, not ours
            float | None,
            Field(gt=0, allow_inf_nan=False, description="Seconds the run may take (capped by the server)"),
        ] = None,
        wait: Wait = None,
        packages: Annotated[
            list[str] | None,
            Field(description="Packages to pip install (offline, from the server's index) before the code runs"),
        ] = None,
    ) -> Annotated[CallToolResult, RunResult]:
        self.notifier.seen(ctx.request_context)
        owner = owner_of(ctx)
        resumed = resume(self.service, owner, ctx)  # the retry of a call that asked for approval
        if resumed is not None:
            return await self.answer(resumed, ctx, wait, cancel_on_abandon=True)
        run = await self.service.start_run(owner, code, session_id=session_id, timeout=timeout, packages=packages or ())
        return await self.answer(run, ctx, wait, cancel_on_abandon=True)

    async def get_run(self, run_id: RunId, ctx: Context, wait: Wait = None) -> Annotated[CallToolResult, RunResult]:
        run = resume(self.service, owner_of(ctx), ctx) or self.service.get_run(owner_of(ctx), run_id)
        return await self.answer(run, ctx, wait, cancel_on_abandon=False)

    async def cancel_run(self, run_id: RunId, ctx: Context) -> Annotated[CallToolResult, RunResult]:
        run = self.service.get_run(owner_of(ctx), run_id)
        if not run.done:
            await self.service.cancel_and_wait(run)
        return await self.answer(run, ctx, 0, cancel_on_abandon=False)

    async def new_session(self, ctx: Context, egress: Hosts = None) -> SessionInfo:
        return await self.service.new_session(owner_of(ctx), egress)

    async def restrict_egress(self, session_id: str, allow: Hosts, ctx: Context) -> SessionInfo:
        return await self.service.restrict_egress(owner_of(ctx), session_id, allow or [])

    async def close_session(
        self, session_id: Annotated[str, Field(description="The session to close")], ctx: Context
    ) -> ClosedSession:
        await self.service.close_session(owner_of(ctx), session_id)
        return ClosedSession(session_id=session_id)

    async def fork_session(
        self,
        session_id: Annotated[str, Field(description="The session to copy")],
        ctx: Context,
        count: Annotated[int | None, Field(ge=1, le=8, description="How many copies (default 1, at most 8)")] = None,
    ) -> ForkedSessions:
        forks = await self.service.fork_session(owner_of(ctx), session_id, count or 1)
        return ForkedSessions(session_id=session_id, forks=forks)

    async def list_variables(
        self, session_id: Annotated[str, Field(description="The session whose variables to list")], ctx: Context
    ) -> VariableListing:
        return await self.service.list_variables(owner_of(ctx), session_id)

    async def export_notebook(
        self,
        session_id: Annotated[str, Field(description="The session whose history to export")],
        ctx: Context,
        path: Annotated[str | None, Field(description="Where in /mnt/data to write it (default session.ipynb)")] = None,
    ) -> WrittenFile:
        owner = owner_of(ctx)
        written = await self.service.export_notebook(owner, session_id, path or "session.ipynb")
        await self.notifier.changed(owner, [written.uri])
        return written

    async def list_files(
        self,
        ctx: Context,
        session_id: Annotated[str | None, Field(description="The session whose files to list")] = None,
        run_id: Annotated[str | None, Field(description="Or: the stateless run whose files to list")] = None,
        path: Annotated[str | None, Field(description="Directory relative to /mnt/data (default: all)")] = None,
    ) -> FileListing:
        owner = owner_of(ctx)
        if (session_id is None) == (run_id is None):
            raise ToolError("give either session_id (a session's files) or run_id (a stateless run's files)")
        if run_id is not None:
            entries = self.service.list_run_files(owner, run_id)
            return FileListing(run_id=run_id, path=".", entries=entries)
        assert session_id is not None
        listed, truncated = await self.service.list_files(owner, session_id, path or ".")
        return FileListing(session_id=session_id, path=path or ".", entries=listed, truncated=truncated)

    async def read_file(
        self,
        path: Annotated[str, Field(description="File path relative to /mnt/data (or absolute under /mnt/data/)")],
        ctx: Context,
        session_id: Annotated[str | None, Field(description="The session to read from")] = None,
        run_id: Annotated[str | None, Field(description="Or: the stateless run whose file to read")] = None,
    ) -> CallToolResult:
        owner = owner_of(ctx)
        if (session_id is None) == (run_id is None):
            raise ToolError("give either session_id (a session's file) or run_id (a stateless run's file)")
        if run_id is not None:
            found = self.service.read_run_file(owner, run_id, path)
            uri = run_file_uri(run_id, found.path)
        else:
            assert session_id is not None
            found = await self.service.read_file(owner, session_id, path)
            uri = session_file_uri(session_id, found.path)
        metrics.file_bytes("out", "tool", len(found.data))
        return file_content(found, uri=uri, mime=guess_mime(found.path), links=self.resource_links)

    async def write_file(
        self,
        session_id: Annotated[str, Field(description="The session to write into")],
        path: Annotated[str, Field(description="File path relative to /mnt/data; parent directories are created")],
        content: Annotated[str, Field(description="The file's content (text, or base64 with encoding='base64')")],
        ctx: Context,
        encoding: Annotated[
            Literal["utf-8", "base64"] | None, Field(description="How content is encoded (default utf-8)")
        ] = None,
    ) -> FileInfo:
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except ValueError:
                raise ToolError("content is not valid base64; nothing was written") from None
        else:
            data = content.encode("utf-8", "surrogatepass")
        owner = owner_of(ctx)
        info = await self.service.write_file(owner, session_id, path, data)
        metrics.file_bytes("in", "tool", len(data))
        if info.uri is not None:
            await self.notifier.changed(owner, [info.uri])
        return info

    async def get_usage(self, ctx: Context, session_id: UsageOf = None) -> Usage:
        return await self.service.usage(owner_of(ctx), session_id)

    async def file_url(
        self,
        session_id: Annotated[str, Field(description="The session whose /mnt/data the file is in (or goes to)")],
        path: Annotated[str, Field(description="File path relative to /mnt/data (or absolute under /mnt/data/)")],
        direction: Annotated[
            Literal["upload", "download"], Field(description="download: GET the file; upload: PUT a file to path")
        ],
        ctx: Context,
    ) -> FileUrl:
        if self.links is None:
            raise ToolError(
                "file URLs need the HTTP transport; this server runs over stdio (start it with "
                "`mcp-code-exec serve --transport streamable-http`). Over stdio, use read_file and write_file "
                f"(up to {self.config.limits.read_max_bytes // MIB} MiB)."
            )
        owner = owner_of(ctx)
        relative = paths.normalize(path)
        size = max_bytes = None
        if direction == "download":
            size = (await self.service.stat_file(owner, session_id, relative)).size
        else:
            self.service.check_session(owner, session_id)  # the caller's own session, or "no such session"
            max_bytes = self.links.max_upload_bytes
        token = self.links.issue(owner, session_id, relative, direction)
        url = self.links.url(token, ctx.headers)
        name = relative.rsplit("/", 1)[-1]
        example = (
            f"curl -fo {shlex.quote(name)} {url}" if direction == "download" else f"curl -fT {shlex.quote(name)} {url}"
        )
        return FileUrl(
            url=url,
            method="GET" if direction == "download" else "PUT",
            direction=direction,
            session_id=session_id,
            path=relative,
            expires_in_s=self.links.ttl_s,
            single_use=direction == "upload",
            size=size,
            max_bytes=max_bytes,
            example=example,
        )
