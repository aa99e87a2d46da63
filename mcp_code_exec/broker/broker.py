"""The broker: every tool call from sandbox code is judged, made and answered here.

A call, in order: it counts against the run's call budget, whatever follows; the server must be one
this run's caller may use (an unknown server and another identity's are refused alike, naming
neither); the run's call budget, spent; the arguments (JSON, bounded
nesting, an object, valid against the tool's input schema); the policy (allow, ask, deny); a slot
among the run's calls in flight; the upstream call under the per-call timeout; the result, capped.
With ``audit.required``, a call the audit log cannot record is refused before its upstream is asked
anything (and again after a human's approval).
Each call ends with one audit log line: identity, server, tool, decision, duration, outcome, never
argument values. Nothing the sandbox or an upstream sends can raise out of ``answer``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import jsonschema  # type: ignore[import-untyped]
from anyio.abc import TaskGroup
from mcp import MCPError
from mcp.types import CallToolResult, ImageContent, TextContent, Tool

from ..config.code_mode import CodeModeSettings, UpstreamServer
from ..errors import AuditUnavailable
from ..ledger import audit_logger
from ..observability import metrics
from ..protocol import messages as wire
from ..protocol.frames import MAX_DEPTH, nesting_within
from ..sandbox.tool_calls import RunClock
from .approvals import Approval, RunApprovals
from .names import tool_specs
from .policy import decide
from .upstream import TooLarge, Unavailable, Upstream

audit = logging.getLogger("mcp_code_exec.audit")
CATALOG_MAX_BYTES = 512 << 10  # of the run's options header (at most 1 MiB in all)
MESSAGE_MAX = 4000
# The audit line's decisions as the metric's closed set of labels (anything else is "other").
METRIC_DECISIONS = {
    "allow": "allow",
    "deny": "deny",
    "no-server": "deny",
    "ask:approved": "ask_accepted",
    "ask:declined": "ask_declined",
    "ask:timeout": "ask_timeout",
}


class Refused(Exception):
    """A call that ends before (or instead of) reaching the upstream: ``kind`` is the sandbox's exception."""

    def __init__(self, kind: str, message: str, decision: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.decision = decision


@dataclass(eq=False)
class RunBudget:
    """One run's tool calls: how many so far, how many at once (the highest is kept for tests)."""

    max_calls: int
    limiter: anyio.CapacityLimiter
    calls: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    approvals: RunApprovals = field(default_factory=RunApprovals)


class Broker:
    def __init__(self, settings: CodeModeSettings, task_group: TaskGroup) -> None:
        self.settings = settings
        self.upstreams = {
            server.name: Upstream(server, task_group, settings.start_timeout_s, settings.max_answer_bytes)
            for server in settings.servers
        }

    @property
    def enabled(self) -> bool:
        return bool(self.upstreams)

    def servers_for(self, identity: str) -> list[UpstreamServer]:
        return self.settings.servers_for(identity)

    @property
    def most_calls(self) -> int:
        """Call frames a run may send: its budget, then as many refused (a cell may catch the budget's
        error and go on); the host ends a run that sends more (``sandbox.tool_calls``)."""
        return 2 * self.settings.max_calls

    def new_budget(self) -> RunBudget:
        settings = self.settings
        return RunBudget(max_calls=settings.max_calls, limiter=anyio.CapacityLimiter(settings.max_in_flight))

    async def catalog(self, identity: str) -> list[wire.ToolSpec] | None:
        """The tools ``identity`` may see, for its run's ``mcp_tools`` (None: no module at all). An
        upstream that cannot be reached now is left out of this run's (its calls would fail)."""
        servers = self.servers_for(identity)
        if not servers:
            return None
        specs: list[wire.ToolSpec] = []
        for server in servers:
            try:
                tools = await self.upstreams[server.name].list_tools()
            except Unavailable:
                continue
            specs += tool_specs(server.name, list(tools.values()))
        return fit(specs)

    async def close(self) -> None:
        for upstream in self.upstreams.values():
            await upstream.aclose()

    async def answer(
        self, identity: str, budget: RunBudget, call: wire.ToolCall, arguments: bytes, clock: RunClock
    ) -> tuple[wire.ToolReply, bytes]:
        started = time.perf_counter()
        decided = ["-"]  # the decision so far, for the audit line of a call cancelled midway
        reply = wire.ToolReply(id=call.id, call=call.call, ok=True)
        outcome = "ok"
        try:
            body, decision = await self._call(identity, budget, call, arguments, clock, decided)
        except Refused as exc:
            decision = exc.decision or decided[0]
            outcome = exc.kind
            reply = reply.model_copy(update={"ok": False, "error": exc.kind})
            body = {"message": str(exc)[:MESSAGE_MAX]}
        except anyio.get_cancelled_exc_class():  # the run ended (or was cancelled) during the call
            self._audit(identity, call, decided[0], started, "cancelled")
            raise
        self._audit(identity, call, decision, started, outcome)
        return reply, json.dumps(body, ensure_ascii=False, default=str).encode("utf-8", "replace")

    def _audit(self, identity: str, call: wire.ToolCall, decision: str, started: float, outcome: str) -> None:
        """The call's one audit line (never argument values) and its count in the metrics."""
        metrics.code_mode_call(call.server, METRIC_DECISIONS.get(decision, "other"), self.upstreams)
        fields = {
            "event": "code_mode",  # the audit log's line too (see ledger/audit)
            "identity": identity,
            "server": call.server[:64],
            "tool": call.tool[:64],
            "call": call.call,
            "decision": decision,
            "duration_ms": round((time.perf_counter() - started) * 1000, 1),
            "outcome": outcome,
        }
        audit.info(
            "code_mode identity=%s server=%s tool=%s call=%d decision=%s duration_ms=%.1f outcome=%s",
            identity, json.dumps(fields["server"]), json.dumps(fields["tool"]), call.call, decision,
            fields["duration_ms"], outcome, extra={"fields": fields},
        )  # fmt: skip

    async def _call(
        self,
        identity: str,
        budget: RunBudget,
        call: wire.ToolCall,
        arguments: bytes,
        clock: RunClock,
        decided: list[str],
    ) -> tuple[dict[str, Any], str]:
        budget.calls += 1  # every call counts, a refused one too: each costs the host work and an audit line
        server = next((s for s in self.servers_for(identity) if s.name == call.server), None)
        if server is None:
            raise Refused("denied", "no tool server of that name is available to this caller", "no-server")
        if budget.calls > budget.max_calls:
            raise Refused("budget", f"this run has used its {budget.max_calls} tool calls", "budget")
        recordable()
        values = parse_arguments(arguments)
        upstream = self.upstreams[server.name]
        try:
            tool = (await upstream.list_tools()).get(call.tool)
        except Unavailable as exc:
            raise Refused("unavailable", str(exc)) from None
        decision: str = decide(server, tool)
        decided[0] = decision
        if tool is None:
            raise Refused("denied", f"the server {server.name!r} has no tool {call.tool[:100]!r}", decision)
        check_schema(tool, values)
        if decision == "deny":
            raise Refused("denied", f"the server's policy denies {tool.name!r} (ask the user to allow it)", decision)
        if decision == "ask":
            decision = "ask:cancelled"  # the run ended while the human was asked
            try:
                decision = await self._ask(budget, Approval(call.call, server.name, tool.name, values), clock)
            except Refused as exc:
                decision = exc.decision
                raise
            finally:
                decided[0] = decision
                answered(identity, call, decision)
            recordable()  # the log may have failed while the human was asked
        async with budget.limiter:
            budget.in_flight += 1
            budget.peak_in_flight = max(budget.peak_in_flight, budget.in_flight)
            try:
                result = await self._upstream_call(upstream, tool, values)
            finally:
                budget.in_flight -= 1
        return result_body(result, tool, raw=call.raw, cap=self.settings.max_result_kb << 10), decision

    async def _ask(self, budget: RunBudget, approval: Approval, clock: RunClock) -> str:
        """Wait for a human's answer (the run's clock stopped meanwhile); the decision, or ``Refused``."""
        budget.approvals.add(approval)
        try:
            async with clock.paused():
                with anyio.move_on_after(self.settings.ask_timeout_s):
                    await approval.answered.wait()
        finally:
            budget.approvals.remove(approval)
        timed_out = approval.answer(False, f"nobody answered within {self.settings.ask_timeout_s:g} s")
        if not approval.allowed:
            decision = "ask:timeout" if timed_out else "ask:declined"
            raise Refused("denied", f"the call needs a human's approval: {approval.reason}", decision)
        return "ask:approved"

    async def _upstream_call(self, upstream: Upstream, tool: Tool, values: dict[str, Any]) -> CallToolResult:
        try:
            return await upstream.call(tool.name, values, self.settings.call_timeout_s)
        except TimeoutError:
            raise Refused(
                "timeout", f"{tool.name!r} did not answer within {self.settings.call_timeout_s:g} s"
            ) from None
        except Unavailable as exc:
            raise Refused("unavailable", str(exc)) from None
        except TooLarge as exc:
            raise Refused("budget", f"{tool.name!r}: {exc}") from None
        except MCPError as exc:
            raise Refused("tool", f"the server answered with an error: {exc.error.message[:1000]}") from None
        except Exception as exc:  # noqa: BLE001 - whatever an upstream does stays its own failure
            upstream.lose(type(exc).__name__)
            raise Refused("unavailable", f"the call to {tool.name!r} failed ({type(exc).__name__})") from None


def answered(identity: str, call: wire.ToolCall, decision: str) -> None:
    """An approval's audit line: who ran the code, which call, how the human answered (or did not)."""
    fields = {"event": "approval", "identity": identity, "server": call.server[:64], "tool": call.tool[:64],
              "call": call.call, "outcome": decision.removeprefix("ask:")}  # fmt: skip
    audit.info(
        "approval identity=%s call=%d outcome=%s", identity, call.call, fields["outcome"], extra={"fields": fields}
    )


def recordable() -> None:
    """With ``audit.required``, a call the audit log cannot record is refused before it reaches its
    upstream (or a human is asked): it acts on another server as ``run_python`` acts here."""
    try:
        audit_logger.require()
    except AuditUnavailable as exc:
        raise Refused("unavailable", str(exc)) from None


def parse_arguments(arguments: bytes) -> dict[str, Any]:
    try:
        text = arguments.decode("utf-8", "surrogatepass")  # not UTF-16 or -32, which json.loads would read
    except UnicodeDecodeError:
        raise Refused("argument", "the arguments are not UTF-8") from None
    if not nesting_within(arguments, MAX_DEPTH):
        raise Refused("argument", f"the arguments nest deeper than {MAX_DEPTH} levels")
    try:
        values = json.loads(text) if text else {}
    except (ValueError, RecursionError):
        raise Refused("argument", "the arguments are not JSON") from None
    if not isinstance(values, dict):
        raise Refused("argument", "the arguments are not an object of names and values")
    return values


def check_schema(tool: Tool, values: dict[str, Any]) -> None:
    try:
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(tool.input_schema).iter_errors(values))
    except (jsonschema.exceptions.SchemaError, RecursionError, TypeError, ValueError):
        return  # the upstream's schema is broken: the upstream judges its arguments itself
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path)
        raise Refused("argument", f"{tool.name}(): {where + ': ' if where else ''}{error.message[:500]}")


def result_body(result: CallToolResult, tool: Tool, *, raw: bool, cap: int) -> dict[str, Any]:
    """What the sandbox gets: the structured content, the text, or (``raw``) the whole result."""
    text = "\n".join(block.text for block in result.content if isinstance(block, TextContent))
    if result.is_error:
        raise Refused("tool", text[:MESSAGE_MAX] or "the tool reported an error")
    images = [
        {"data": block.data, "mime": block.mime_type} for block in result.content if isinstance(block, ImageContent)
    ]
    if raw:
        body: dict[str, Any] = {
            "kind": "raw",
            "value": result.model_dump(mode="json", by_alias=True, exclude_none=True),
        }
    elif tool.output_schema is not None and result.structured_content is not None:
        body = {"kind": "structured", "value": result.structured_content, "images": images}
    else:
        body = {"kind": "text", "value": text, "images": images}
    size = len(json.dumps(body, default=str))
    if size <= cap:
        return body
    if body["kind"] == "text":
        head = tail = max(0, cap // 2 - 200)
        note = f"\n[... {len(text) - head - tail} characters of the tool's result cut: over {cap >> 10} KiB ...]\n"
        fitted = text[:head] + note + text[len(text) - tail :] if len(text) > head + tail else text
        return {"kind": "text", "value": fitted, "images": []}
    raise Refused("budget", f"the result is {size} bytes, over the cap of {cap} (code_mode.max_result_kb)")


def fit(specs: list[wire.ToolSpec]) -> list[wire.ToolSpec]:
    """The catalog within its share of the run's header: long descriptions shortened, then tools dropped."""

    def size(items: list[wire.ToolSpec]) -> int:
        return sum(len(spec.model_dump_json()) for spec in items)

    if size(specs) > CATALOG_MAX_BYTES:
        specs = [spec.model_copy(update={"description": spec.description[:300]}) for spec in specs]
    while specs and size(specs) > CATALOG_MAX_BYTES:
        specs = specs[: len(specs) * 3 // 4]
    return specs
