"""MCP Tasks (``io.modelcontextprotocol/tasks``, SEP-2663, protocol 2026-07-28) for ``run_python``.

A client that declares the extension on its ``tools/call`` gets a task for a run that does not end
within ``QUICK_S`` (a quick one is answered as usual); it then polls ``tasks/get`` and may
``tasks/cancel``. A task is the run itself: its id is the run's, it belongs to the same identity,
and ``get_run``/``cancel_run`` work on it too. Tasks are offered on 2026-07-28 requests only (the
2025 wire has no place for them: those clients get the usual answer, with ``wait``).

Errors as the extension specifies: an unknown (or someone else's) task is -32602; tasks/* from a
request that did not declare the extension is -32021; an ``Mcp-Name`` header that names another
task is refused (a missing one is accepted: some clients do not send it).

A run started as a task and ``tasks/cancel`` each have their audit line, as the tools do (``audit_calls``).
"""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import anyio
from mcp import MCPError
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import require_client_extension
from mcp_types import CallToolRequestParams, CallToolResult, RequestParams, TextContent
from mcp_types.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import AuditUnavailable, RunNotFound, SandboxError
from ..service.port import ServicePort
from ..service.run_registry import Run
from .answers import run_content
from .approval import CANNOT_ASK, can_elicit, form_request, settle
from .audit_calls import audited
from .identity import owner_of
from .sdk import request_headers

TASKS = "io.modelcontextprotocol/tasks"
QUICK_S = 1.0  # a run that ends this soon is answered directly, not as a task
POLL_INTERVAL_MS = 1000
NAME_MISMATCH = -32020
TASK_TOOLS = frozenset({"run_python"})
P = ParamSpec("P")
R = TypeVar("R")


class TaskRunArguments(BaseModel):
    """The ``run_python`` arguments a task takes, held to the tool's own rules and stricter (no
    coercion): anything else is left to the tool, whose validation answers with the usual error."""

    model_config = ConfigDict(extra="forbid", strict=True)
    code: str
    session_id: str | None = None
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)
    wait: float | None = Field(None, ge=0, allow_inf_nan=False)  # ignored: a task is polled instead


class TaskIdParams(RequestParams):
    task_id: str  # taskId on the wire


class TaskUpdateParams(TaskIdParams):
    input_responses: dict[str, Any] = Field(default_factory=dict)


def _iso(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).isoformat().replace("+00:00", "Z")


class TasksExtension(Extension):
    identifier = TASKS

    def __init__(self, service: ServicePort) -> None:
        self.service = service
        config = service.config
        self.ttl_ms = int((config.limits.max_run_s + config.runs.keep_s) * 1000)

    def methods(self) -> list[MethodBinding]:
        modern = frozenset(MODERN_PROTOCOL_VERSIONS)
        return [
            MethodBinding("tasks/get", TaskIdParams, self._get, protocol_versions=modern),
            MethodBinding("tasks/cancel", TaskIdParams, self._cancel, protocol_versions=modern),
            MethodBinding("tasks/update", TaskUpdateParams, self._update, protocol_versions=modern),
        ]

    async def intercept_tool_call(
        self, params: CallToolRequestParams, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        capabilities = ctx.session.client_capabilities
        declared = capabilities is not None and TASKS in (capabilities.extensions or {})
        if params.name not in TASK_TOOLS or ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS or not declared:
            return await call_next(ctx)
        try:
            arguments = TaskRunArguments.model_validate(params.arguments or {})
        except ValidationError:
            return await call_next(ctx)  # the tool's own validation answers with the usual error
        try:
            return await self._audited("run_python", self._begin)(
                ctx, code=arguments.code, session_id=arguments.session_id, timeout=arguments.timeout
            )
        except SandboxError as exc:  # a quota, a required audit log that cannot record, a session's state
            return CallToolResult(content=[TextContent(text=str(exc))], is_error=True)

    async def _begin(
        self,
        ctx: ServerRequestContext[Any, Any],
        *,
        code: str,
        session_id: str | None,
        timeout: float | None,  # noqa: ASYNC109 - the run's deadline inside the sandbox, not ours
    ) -> HandlerResult:
        run = await self.service.start_run(owner_of(ctx), code, session_id=session_id, timeout=timeout)
        with anyio.move_on_after(QUICK_S):
            await run.finished.wait()
        if run.done:
            return self._result(run)
        return {"resultType": "task", **self._task(run, ctx.session.client_capabilities)}

    def _audited(self, name: str, fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        """``fn`` with its audit line, as the tools have theirs (``audit_calls``)."""
        if self.service.config.audit.file is None:
            return fn
        return audited(name, fn, lambda: self.service.accounting.audit)

    def _result(self, run: Run) -> CallToolResult:
        return run_content(self.service.deliver(run), links=self.service.config.runs.resource_links)

    def _task(self, run: Run, capabilities: Any = None) -> dict[str, Any]:
        approvals = self.service.tool_approvals(run)
        waiting = approvals.waiting() if approvals is not None and not run.done else []
        if waiting and not can_elicit(capabilities):
            for approval in waiting:  # code mode: a tool call that needs approval, and nobody to ask
                approval.answer(False, CANNOT_ASK)
            waiting = []
        if waiting:
            status, message = "input_required", "a tool call of the code waits for the user's approval"
        elif not run.done:
            status, message = "working", "the code is running"
        elif run.cancelled:
            status, message = "cancelled", "cancelled by tasks/cancel"
        else:
            status, message = "completed", f"the run ended: {run.result.status if run.result else '?'}"
        updated = run.started_at + ((run.finished_at or 0) - run.started if run.done else 0)
        task: dict[str, Any] = {
            "taskId": run.id,
            "status": status,
            "statusMessage": message,
            "createdAt": _iso(run.started_at),
            "lastUpdatedAt": _iso(max(updated, run.started_at)),
            "ttlMs": self.ttl_ms,
            "pollIntervalMs": POLL_INTERVAL_MS,
        }
        if waiting:
            task["inputRequests"] = {
                approval.key: form_request(approval).model_dump(by_alias=True, mode="json", exclude_none=True)
                for approval in waiting
            }
        if status == "completed":
            task["result"] = self._result(run).model_dump(by_alias=True, mode="json", exclude_none=True)
        return task

    def _lookup(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> Run:
        require_client_extension(ctx, TASKS)
        headers = request_headers(ctx)
        named = headers.get("mcp-name") if headers is not None else None
        if named is not None and named != params.task_id:
            raise MCPError(code=NAME_MISMATCH, message="the Mcp-Name header does not match params.taskId")
        try:
            return self.service.get_run(owner_of(ctx), params.task_id)
        except RunNotFound:
            raise MCPError(code=INVALID_PARAMS, message="Failed to retrieve task: Task not found") from None

    async def _get(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> dict[str, Any]:
        return self._task(self._lookup(ctx, params), ctx.session.client_capabilities)

    async def _cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams) -> dict[str, Any]:
        try:  # a cancel changes a run's state: its line as cancel_run has its own
            return await self._audited("tasks/cancel", self._cancel_run)(ctx, params, run_id=params.task_id)
        except AuditUnavailable as exc:
            raise MCPError(code=INTERNAL_ERROR, message=str(exc)) from None

    async def _cancel_run(
        self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams, *, run_id: str
    ) -> dict[str, Any]:
        run = self._lookup(ctx, params)
        if not run.done:
            await self.service.cancel_and_wait(run)
        return {}

    async def _update(self, ctx: ServerRequestContext[Any, Any], params: TaskUpdateParams) -> dict[str, Any]:
        run = self._lookup(ctx, params)
        approvals = self.service.tool_approvals(run)
        for key, response in params.input_responses.items():  # code mode's approvals, each answered once
            approval = approvals.take(key) if approvals is not None else None
            if approval is not None:
                try:
                    settle(approval, response)
                except ValidationError:
                    approval.answer(False, "the answer was not an elicitation result")
        return {}
