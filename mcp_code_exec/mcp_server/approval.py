"""Asking a human to approve a tool call ("ask" in code mode's policy), the way the client can.

A call that needs approval waits in its run (the run's clock stopped); whoever follows the run for
the client asks:
- a 2026-07-28 client that declared elicitation: the waiting ``run_python`` or ``get_run`` answers
  ``InputRequiredResult`` with a form (``allow: boolean``); its retry carries the answer and the
  sealed ``requestState`` naming the run, and goes on following the same run;
- a Tasks client: the task is ``input_required`` and ``tasks/update`` answers (``tasks.py``);
- a 2025-era client that declared elicitation: ``elicitation/create`` inside the open call;
- a client that cannot be asked: the call is denied, and the message says why.
Only a human's form answers: no argument of any tool (the model's) can approve a call.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import anyio
from mcp.server.mcpserver import Context
from mcp.types import ElicitRequest, ElicitRequestFormParams, ElicitResult, InputRequiredResult
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel, Field

from ..broker.approvals import Approval, RunApprovals
from ..service.port import ServicePort
from ..service.run_registry import Run
from .progress import follow

ClientKind = Literal["modern", "legacy", "tasks", "none"]
CANNOT_ASK = "this client cannot ask a human (it declared no elicitation support), so the call is denied"
FORM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"allow": {"type": "boolean", "title": "Allow this call", "default": False}},
    "required": ["allow"],
}


class Allow(BaseModel):
    allow: bool = Field(False, description="Allow this call")


def can_elicit(capabilities: Any) -> bool:
    return capabilities is not None and getattr(capabilities, "elicitation", None) is not None


def client_kind(ctx: Context) -> ClientKind:
    if not can_elicit(ctx.client_capabilities):
        return "none"
    return "modern" if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS else "legacy"


def form_request(approval: Approval) -> ElicitRequest:
    return ElicitRequest(params=ElicitRequestFormParams(message=approval.message(), requested_schema=FORM_SCHEMA))


def settle(approval: Approval, response: Any) -> None:
    """Answer an approval from a client's elicitation result (anything but an accepted allow=true denies)."""
    if isinstance(response, ElicitResult):
        accepted = response.action == "accept" and (response.content or {}).get("allow") is True
        approval.answer(accepted, "approved" if accepted else f"the user answered {response.action} (not allowed)")
    elif isinstance(response, dict):
        settle(approval, ElicitResult.model_validate(response))
    else:
        approval.answer(False, "the client's answer was not an elicitation result")


def resume(service: ServicePort, owner: str, ctx: Context) -> Run | None:
    """On a retry after ``InputRequiredResult``: the run it continues, its approvals answered (each once)."""
    state = ctx.request_state
    if not state:
        return None
    try:
        run_id = json.loads(state)["run"]
    except (ValueError, KeyError, TypeError):
        return None
    run = service.get_run(owner, str(run_id))  # the caller's own run, or "no such run"
    approvals = service.tool_approvals(run)
    for key, response in (ctx.input_responses or {}).items():
        approval = approvals.take(key) if approvals is not None else None
        if approval is not None:
            settle(approval, response)
    return run


async def follow_asking(
    run: Run, ctx: Context, wait_s: float, approvals: RunApprovals | None
) -> InputRequiredResult | None:
    """Follow the run (as ``progress.follow``) for up to ``wait_s``; approvals that come meanwhile
    are asked the client's way. An ``InputRequiredResult`` is the answer to send (2026 clients)."""
    if approvals is None:
        await follow(run, ctx, wait_s)
        return None
    deadline = anyio.current_time() + wait_s
    while not run.done:
        waiting = approvals.waiting()
        if waiting:
            asked = await ask(run, ctx, waiting)
            if asked is not None:
                return asked
            continue
        remaining = deadline - anyio.current_time()
        if remaining <= 0:
            return None
        changed = approvals.renew()
        if approvals.waiting():
            continue
        async with anyio.create_task_group() as group:
            group.start_soon(cancel_when, changed, group.cancel_scope)
            await follow(run, ctx, remaining)
            group.cancel_scope.cancel()
    return None


async def cancel_when(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def ask(run: Run, ctx: Context, waiting: list[Approval]) -> InputRequiredResult | None:
    kind = client_kind(ctx)
    if kind == "modern":
        requests = {approval.key: form_request(approval) for approval in waiting}
        return InputRequiredResult(input_requests=requests, request_state=json.dumps({"run": run.id}))
    for approval in waiting:
        if kind == "none":
            approval.answer(False, CANNOT_ASK)
            continue
        try:
            result = await ctx.elicit(approval.message(), Allow)
        except Exception as exc:  # noqa: BLE001 - a client that fails to answer has not approved
            approval.answer(False, f"asking the user failed ({type(exc).__name__})")
            continue
        accepted = result.action == "accept" and bool(getattr(result, "data", None) and result.data.allow)
        approval.answer(accepted, "approved" if accepted else f"the user answered {result.action} (not allowed)")
    return None
