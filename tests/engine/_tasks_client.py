"""A client side of the Tasks extension (SEP-2663) for tests, on the SDK's client extension API.

``Client(target, extensions=[TasksClient()])`` declares the extension on every request; a
``tools/call`` answered with a task is then polled through ``tasks/get`` until it ends. A task that
is ``input_required`` has its ``inputRequests`` answered by the client's ``answer`` (a human's
elicitation form: the request's params in, an ``ElicitResult`` out) through ``tasks/update``. The
raw requests (``tasks_get``, ``tasks_cancel``, ``tasks_update``) send ``Mcp-Name`` as the
extension requires.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
from mcp import MCPError
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.types import ElicitRequestFormParams, ElicitRequestParams, ElicitResult
from mcp_types import CallToolResult, Request, RequestParams, Result

TASKS = "io.modelcontextprotocol/tasks"


class TaskIdParams(RequestParams):
    task_id: str


class GetTaskRequest(Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: TaskIdParams
    name_param = "taskId"  # the Mcp-Name header


class CancelTaskRequest(Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: TaskIdParams
    name_param = "taskId"


class TaskUpdateParams(TaskIdParams):
    input_responses: dict[str, Any]


class UpdateTaskRequest(Request[TaskUpdateParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    params: TaskUpdateParams
    name_param = "taskId"


class TaskFields(Result):
    task_id: str
    status: Literal["working", "input_required", "completed", "failed", "cancelled"]
    status_message: str | None = None
    created_at: str
    last_updated_at: str
    ttl_ms: int | None
    poll_interval_ms: int | None = None


class CreateTaskResult(TaskFields):
    result_type: Literal["task"] = "task"


class GetTaskResult(TaskFields):
    result_type: str = "complete"
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    input_requests: dict[str, Any] | None = None


class Ack(Result):
    result_type: str | None = None


created: list[CreateTaskResult] = []  # every task the server created, for the tests to look at


async def tasks_get(session: Any, task_id: str) -> GetTaskResult:
    result: GetTaskResult = await session.send_request(
        GetTaskRequest(params=TaskIdParams(task_id=task_id)), GetTaskResult
    )
    return result


async def tasks_cancel(session: Any, task_id: str) -> None:
    await session.send_request(CancelTaskRequest(params=TaskIdParams(task_id=task_id)), Ack)


async def tasks_update(session: Any, task_id: str, responses: dict[str, Any]) -> None:
    params = TaskUpdateParams(task_id=task_id, input_responses=responses)
    await session.send_request(UpdateTaskRequest(params=params), Ack)


Answer = Callable[[ElicitRequestParams], Awaitable[ElicitResult]]
answered: list[str] = []  # every input request key the client answered, for the tests to look at


async def _resolve(task: CreateTaskResult, context: ClaimContext, answer: Answer | None = None) -> CallToolResult:
    created.append(task)
    interval = (task.poll_interval_ms or 500) / 1000
    while True:
        await anyio.sleep(interval)  # the server's poll interval: pacing, not synchronisation
        state = await tasks_get(context.session, task.task_id)
        if state.status == "input_required" and answer is not None:
            responses = {}
            for key, request in (state.input_requests or {}).items():
                if key not in answered:  # each asked once; a poll before the update lands asks again
                    answered.append(key)
                    params = ElicitRequestFormParams.model_validate(request["params"])
                    responses[key] = (await answer(params)).model_dump(by_alias=True, exclude_none=True)
            if responses:
                await tasks_update(context.session, task.task_id, responses)
            continue
        if state.status == "completed" and state.result is not None:
            return CallToolResult.model_validate(state.result)
        if state.status == "failed":
            error = state.error or {}
            raise MCPError(code=int(error.get("code", -32603)), message=str(error.get("message", "failed")))
        if state.status == "cancelled":
            return CallToolResult(content=[{"type": "text", "text": "task cancelled"}], is_error=True)
        interval = (state.poll_interval_ms or 500) / 1000


class TasksClient(ClientExtension):
    identifier = TASKS

    def __init__(self, answer: Answer | None = None) -> None:
        self.answer = answer

    def claims(self) -> list[ResultClaim[Any]]:
        async def resolve(task: CreateTaskResult, context: ClaimContext) -> CallToolResult:
            return await _resolve(task, context, self.answer)

        return [ResultClaim(result_type="task", model=CreateTaskResult, resolve=resolve)]
