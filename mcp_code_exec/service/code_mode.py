"""Code mode in a run: the catalog of tools the run's caller may use goes with the cell (the agent
builds ``mcp_tools`` from it), and the cell's tool calls go to the broker under the run's budget.
A session's run gets it the same way as a stateless one, so a replaced container has the module
again at its next run."""

from __future__ import annotations

from ..broker.approvals import RunApprovals
from ..broker.broker import Broker, RunBudget
from ..protocol import messages as wire
from ..sandbox.tool_calls import RunClock, ToolHandler
from .run_registry import Run


class CodeMode:
    def __init__(self, broker: Broker | None) -> None:
        self.broker = broker if broker is not None and broker.enabled else None

    def new_budget(self) -> RunBudget | None:
        """A new run's budget, made when it is admitted (None: code mode is off)."""
        return self.broker.new_budget() if self.broker is not None else None

    @staticmethod
    def approvals(run: Run) -> RunApprovals | None:
        """The approvals waiting in the run's budget: the MCP layer's to ask."""
        return run.tool_budget.approvals if run.tool_budget is not None else None

    async def catalog(self, identity: str) -> list[wire.ToolSpec]:
        if self.broker is None:
            return []
        return await self.broker.catalog(identity) or []

    async def prepare(self, run: Run, options: wire.RunOptions) -> tuple[wire.RunOptions, ToolHandler | None]:
        broker, budget = self.broker, run.tool_budget
        if broker is None or budget is None:
            return options, None
        catalog = await broker.catalog(run.owner)
        if catalog is None:
            return options, None

        update = {"tools": catalog, "max_tool_calls": budget.max_calls}
        return options.model_copy(update=update), BrokerAnswers(broker, run.owner, budget)


class BrokerAnswers:
    """A run's tool calls, answered by the broker under the run's budget."""

    def __init__(self, broker: Broker, owner: str, budget: RunBudget) -> None:
        self.broker = broker
        self.owner = owner
        self.budget = budget
        self.most_calls = broker.most_calls

    async def __call__(self, call: wire.ToolCall, arguments: bytes, clock: RunClock) -> tuple[wire.ToolReply, bytes]:
        return await self.broker.answer(self.owner, self.budget, call, arguments, clock)
