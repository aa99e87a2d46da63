"""A run's tool calls on the host's side of the channel: each ``tool_call`` event is handed to the
run's handler (the broker, above this layer) in a task of its own, so the run's other events keep
flowing, and its answer goes back as a ``tool_result`` request. Calls still going when the run
ends are cancelled with it.

The run's clock: while a call waits for a human's approval, the handler pauses it (``RunClock``),
which stops the agent's deadline (a ``tool_pause`` request) and moves the host's own deadline by
the time paused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol

import anyio
from anyio.abc import TaskGroup

from ..errors import ProtocolViolation, SandboxError
from ..protocol import messages as wire
from .channel import AgentChannel

log = logging.getLogger(__name__)


class RunClock:
    """Pauses a run's deadlines (the agent's and the host's) while a human is asked."""

    def __init__(self, channel: AgentChannel, request_id: int, scope: anyio.CancelScope | None) -> None:
        self.channel = channel
        self.request_id = request_id
        self.scope = scope
        self.pauses = 0
        self.paused_at = 0.0
        self.saved_deadline = math.inf

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        self.pauses += 1
        if self.pauses == 1:
            self.paused_at = time.monotonic()
            if self.scope is not None:
                self.saved_deadline, self.scope.deadline = self.scope.deadline, math.inf
        try:
            await self.channel.send(wire.ToolPause(id=self.request_id, paused=True).frame())
            yield
        finally:
            self.pauses -= 1
            if self.pauses == 0 and self.scope is not None:
                self.scope.deadline = self.saved_deadline + (time.monotonic() - self.paused_at)
            with anyio.CancelScope(shield=True), contextlib.suppress(SandboxError):
                await self.channel.send(wire.ToolPause(id=self.request_id, paused=False).frame())


class ToolHandler(Protocol):
    """What answers a run's tool calls: (the reply, its JSON payload)."""

    most_calls: int  # call frames a run may send; one more ends the run (its container is replaced)

    def __call__(
        self, call: wire.ToolCall, arguments: bytes, clock: RunClock
    ) -> Awaitable[tuple[wire.ToolReply, bytes]]:
        """Decide, call and answer one tool call; never raises for anything the sandbox sent."""


class ToolCalls:
    """The tool calls of one run, each in its own task until it is answered or the run ends."""

    def __init__(self, handler: ToolHandler, channel: AgentChannel, task_group: TaskGroup, clock: RunClock) -> None:
        self.handler = handler
        self.channel = channel
        self.task_group = task_group
        self.clock = clock
        self.received = 0

    def start(self, call: wire.ToolCall, arguments: bytes) -> None:
        # Even a refusal costs the host a task, an answer and an audit line: past the most a run
        # may send, the sandbox is only flooding the host.
        self.received += 1
        if self.received > self.handler.most_calls:
            raise ProtocolViolation(
                f"the run sent more than {self.handler.most_calls} tool calls, far past its budget: it was stopped"
            )
        self.task_group.start_soon(self._answer, call, arguments)

    async def _answer(self, call: wire.ToolCall, arguments: bytes) -> None:
        try:
            reply, payload = await self.handler(call, arguments, self.clock)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception:  # a bug of ours: the sandbox's call fails, the run goes on
            log.warning("tool call %s.%s failed in the broker", call.server[:40], call.tool[:40], exc_info=True)
            reply = wire.ToolReply(id=call.id, call=call.call, ok=False, error="unavailable")
            payload = json.dumps({"message": "the call failed on the server"}).encode()
        with contextlib.suppress(SandboxError):  # the run ended meanwhile: nobody waits for the answer
            await self.channel.send(reply.frame(payload))
