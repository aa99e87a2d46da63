"""``import mcp_tools`` in the sandbox: other MCP servers' tools as Python functions.

The host sends the catalog of the tools this caller may use with each cell (``options["tools"]``);
this module builds from it one namespace per server and one function per tool, with a keyword-only
signature and the tool's description, so ``help()`` and ``inspect`` work. No generated code is
executed: the functions are closures over checked names.

A call writes a ``call`` frame (its JSON arguments as the payload) to the result pipe (fd 3, under
the pipe's one write lock, which display and image frames from other threads take too) and
blocks on the control pipe (fd 4) for the host's answer, which the supervisor passes on. The host
does everything else: policy, approval, budgets, schema checks, the upstream call. ``submit``
sends at once and returns a future; the answers of several calls come back in any order, and
whichever waiting thread reads the pipe hands the others theirs. A future nobody awaited is
settled before its cell ends (``drain``), so its call finishes (never cut off with the cell) and
its ``result()`` still works in a later cell of a session.

Stdlib only: it runs inside the sandbox image.
"""

from __future__ import annotations

import base64
import inspect
import json
import sys
import threading
import types
from typing import Any

from .. import events, protocol

MODULE = "mcp_tools"
RESULT_FD = 3
TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}
SEARCH_LIMIT = 20


class ToolError(Exception):
    """A tool answered with an error (``isError``); the message is its text. Base of the others."""


class ToolDenied(ToolError, PermissionError):
    """The server's policy, or the human asked, did not allow this call."""


class ToolBudgetExceeded(ToolError):
    """The run has used up its tool calls (or the call's result would not fit)."""


class ToolTimeout(ToolError, TimeoutError):
    """The tool did not answer within the per-call time limit."""


class ToolUnavailable(ToolError, ConnectionError):
    """The upstream server is not reachable (it is restarted; a later call may work)."""


class ToolArgumentError(ToolError, TypeError):
    """The arguments do not match the tool's input schema."""


ERRORS: dict[str, type[ToolError]] = {
    "tool": ToolError,
    "denied": ToolDenied,
    "budget": ToolBudgetExceeded,
    "timeout": ToolTimeout,
    "unavailable": ToolUnavailable,
    "argument": ToolArgumentError,
}


class ToolImage:
    """An image a tool returned: ``data`` (bytes) and ``mime``."""

    def __init__(self, data: bytes, mime: str) -> None:
        self.data = data
        self.mime = mime

    def __repr__(self) -> str:
        return f"ToolImage(mime={self.mime!r}, {len(self.data)} bytes)"

    def _repr_mimebundle_(self, **_: Any) -> dict[str, Any]:
        return {self.mime: self.data}


class Channel:
    """The worker's side of tool calls: numbered call frames out, answers in, matched by number."""

    def __init__(self) -> None:
        self.reader: protocol.FrameReader | None = None
        self.next_call = 0
        self.answers: dict[int, tuple[dict[str, Any], bytes]] = {}
        self.queue: list[tuple[dict[str, Any], bytes]] = []  # frames read but not yet handed out
        self.condition = threading.Condition()
        self.reading = False
        self.write_lock = threading.Lock()
        self.futures: dict[int, ToolFuture] = {}  # made with submit, not yet settled
        self.budget: int | None = None  # the calls this cell may make (the host's max_calls)
        self.sent = 0  # calls this cell made

    def send(self, server: str, tool: str, arguments: dict[str, Any], raw: bool) -> int:
        try:
            payload = json.dumps(arguments, ensure_ascii=False, allow_nan=False).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError) as exc:
            raise ToolArgumentError(f"the arguments are not JSON: {exc}") from None
        if len(payload) > protocol.MAX_CALL_PAYLOAD:
            raise ToolArgumentError(f"the arguments are {len(payload)} bytes; at most {protocol.MAX_CALL_PAYLOAD}")
        with self.write_lock:  # the count too: threads of the cell call at once
            # Refused here once the budget is spent: the host would refuse each again, and stops a
            # run that goes on sending far past it.
            if self.budget is not None and self.sent >= self.budget:
                raise ToolBudgetExceeded(f"this run has used its {self.budget} tool calls")
            self.next_call += 1
            self.sent += 1
            call = self.next_call
            protocol.send(RESULT_FD, events.worker_call(call, server, tool, raw), payload)
        return call

    def drain(self) -> None:
        """Settle every future of ``submit`` not awaited yet (at a cell's end): its value or error
        stays in the future."""
        for future in list(self.futures.values()):
            future.settle()

    def wait(self, call: int) -> Any:
        """The answer to ``call``; one waiting thread at a time reads the pipe, for everyone."""
        with self.condition:
            while call not in self.answers:
                if self.reading:
                    self.condition.wait()
                    continue
                self.reading = True
                self.condition.release()
                try:
                    header, payload = self.read_one()
                finally:
                    self.condition.acquire()
                    self.reading = False
                    self.condition.notify_all()
                if isinstance(header.get("call"), int):
                    self.answers[header["call"]] = (header, payload)
            header, payload = self.answers.pop(call)
        return decode(header, payload)

    def listen(self, reader: protocol.FrameReader) -> None:
        """Read the answers from ``reader`` (the worker's control pipe) from now on."""
        self.reader = reader

    def read_one(self) -> tuple[dict[str, Any], bytes]:
        reader = self.reader
        if reader is None:
            raise ToolUnavailable("tool calls are not available here")
        while not self.queue:
            self.queue.extend(reader.frames())
            if self.queue:
                break
            reader.fill()
            if reader.eof:
                raise ToolUnavailable("the sandbox's control channel closed")
        return self.queue.pop(0)


CHANNEL = Channel()


def decode(header: dict[str, Any], payload: bytes) -> Any:
    body = json.loads(payload) if payload else {}
    if not header.get("ok"):
        error = ERRORS.get(str(header.get("error")), ToolError)
        raise error(str(body.get("message", "the call failed")))
    images = [ToolImage(base64.b64decode(item["data"]), str(item["mime"])) for item in body.get("images", [])]
    value = body.get("value")
    if images and body.get("kind") != "raw":
        return images[0] if value in (None, "") and len(images) == 1 else {"text": value, "images": images}
    return value


class ToolFuture:
    """A call made with ``submit``: ``result()`` blocks until its answer (and raises its error)."""

    def __init__(self, call: int, error: ToolError | None = None) -> None:
        self.call = call
        self._done = error is not None  # refused before it was sent: settled already
        self._value: Any = None
        self._error: BaseException | None = error
        self._lock = threading.Lock()  # one thread waits for the answer; the others for that one
        if error is None:
            CHANNEL.futures[call] = self

    def settle(self) -> None:
        with self._lock:
            if self._done:
                return
            try:
                self._value = CHANNEL.wait(self.call)
            except ToolError as exc:
                self._error = exc
            self._done = True
            CHANNEL.futures.pop(self.call, None)

    def result(self) -> Any:
        self.settle()
        if self._error is not None:
            raise self._error
        return self._value

    def __repr__(self) -> str:
        return f"<ToolFuture call {self.call} {'done' if self._done else 'pending'}>"


def make_tool(server: str, spec: dict[str, Any]) -> Any:
    tool_name = str(spec["tool"])
    names = {str(param["name"]) for param in spec.get("params", [])}

    def check(arguments: dict[str, Any]) -> None:
        unknown = sorted(set(arguments) - names)
        if unknown and not spec.get("open"):
            raise ToolArgumentError(f"{spec['name']}() got unexpected arguments: {', '.join(unknown)}")

    def call(raw: bool = False, **arguments: Any) -> Any:
        check(arguments)
        return CHANNEL.wait(CHANNEL.send(server, tool_name, arguments, raw))

    def submit(raw: bool = False, **arguments: Any) -> ToolFuture:
        check(arguments)
        try:
            return ToolFuture(CHANNEL.send(server, tool_name, arguments, raw))
        except ToolBudgetExceeded as exc:  # as the host's refusal would be: from the future's result()
            return ToolFuture(0, exc)

    parameters = []
    for param in spec.get("params", []):
        annotation = TYPES.get(str(param.get("type")), inspect.Parameter.empty)
        default = inspect.Parameter.empty if param.get("required") else None
        try:
            parameters.append(
                inspect.Parameter(
                    str(param["name"]), inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
                )
            )
        except ValueError:  # a name that is no identifier: still passable as **{"name": ...}
            continue
    parameters.sort(key=lambda parameter: parameter.default is not inspect.Parameter.empty)
    parameters.append(inspect.Parameter("raw", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool))
    call.__name__ = call.__qualname__ = str(spec["name"])
    call.__module__ = f"{MODULE}.{server}"
    call.__doc__ = (
        f"{spec.get('description') or '(no description)'}\n\nCalls {tool_name!r} on the server {server!r}; returns its "
        + ("structured content (a dict)" if spec.get("structured") else "text")
        + ". raw=True returns the whole result. .submit(**arguments) returns a future (calls in parallel)."
    )
    call.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    call.submit = submit  # type: ignore[attr-defined]
    call.tool_name = tool_name  # type: ignore[attr-defined]
    return call


def build(catalog: list[dict[str, Any]]) -> types.ModuleType:
    module = types.ModuleType(MODULE, "Other MCP servers' tools: mcp_tools.<server>.<tool>(**arguments).")
    servers: dict[str, types.SimpleNamespace] = {}
    for spec in catalog:
        server = str(spec["server"])
        namespace = servers.setdefault(server, types.SimpleNamespace())
        setattr(namespace, str(spec["name"]), make_tool(server, spec))
    for name, namespace in servers.items():
        setattr(module, name, namespace)
    for error in (ToolError, ToolDenied, ToolBudgetExceeded, ToolTimeout, ToolUnavailable, ToolArgumentError):
        setattr(module, error.__name__, error)
    module.ToolImage = ToolImage  # type: ignore[attr-defined]
    module.servers = lambda: sorted(servers)  # type: ignore[attr-defined]

    def search(text: str = "") -> list[str]:
        """Tools whose name or description contains ``text``, as "server.tool: first line"."""
        needle = text.lower()
        found = []
        for spec in catalog:
            description = str(spec.get("description") or "")
            if needle in f"{spec['name']} {description}".lower():
                first = description.splitlines()[0][:120] if description else ""
                found.append(f"{spec['server']}.{spec['name']}: {first}")
        return found[:SEARCH_LIMIT]

    module.search = search  # type: ignore[attr-defined]
    return module


_built: tuple[str, types.ModuleType] | None = None


def before_cell(catalog: Any, budget: Any = None) -> None:
    """Make ``mcp_tools`` importable with this caller's catalog (or not at all, without one), for a
    cell that may make ``budget`` calls (no bound of its own when the host sets none)."""
    global _built
    CHANNEL.budget = budget if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 else None
    CHANNEL.sent = 0
    if not isinstance(catalog, list) or not catalog:
        sys.modules.pop(MODULE, None)
        return
    key = json.dumps(catalog, sort_keys=True)
    if _built is None or _built[0] != key:
        _built = (key, build(catalog))
    sys.modules[MODULE] = _built[1]
