"""A run's events, gathered until its ``done`` and each held to the run's caps.

Everything the agent sends is hostile: a breach is a ``ProtocolViolation``, and the container that
sent it is replaced (``container``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..errors import ProtocolViolation, SandboxLost
from ..models import ErrorInfo, ImageOutput, RunResult, TableRef, Usage
from ..protocol import messages as wire
from ..protocol.frames import image_size
from .channel import AgentChannel, Route
from .tool_calls import ToolCalls

MAX_TABLES = 8  # table references a run may send (the agent sends at most as many)
# Call frames a run without code mode may send (it has no mcp_tools: each is forged) before it is
# only flooding the host; one with code mode, twice its budget more (those in flight when it is
# interrupted are not answered).
MAX_CALLS_WITHOUT_CODE_MODE = 100
OUTPUT_TEXT_MOST = 8192 + 256  # the agent streams 8 KiB at a time, and a marker (its pace: the channel's)


class OutputSink(Protocol):
    """Where a run's output goes as it comes (the run's own ``OutputLog``, ``service/output_log.py``)."""

    def add(self, stream: str, text: str) -> None: ...


@dataclass
class RawRun:
    """A run as the agent told it, decoded from the agent's events once, here: ``result`` is what the
    caller will see, ``files`` and ``file_bytes`` what a stateless run left (collected), ``recycle``
    whether its container may serve again; all filled from the ``done`` event."""

    result: RunResult = field(default_factory=lambda: RunResult(status="crashed"))
    files: list[wire.FileEntry] = field(default_factory=list)
    file_bytes: bytes = b""
    recycle: bool = False
    tool_calls: int = 0  # call frames it sent, answered or not (an interrupted run's too)


async def collect(
    route: Route,
    raw: RawRun,
    options: wire.RunOptions,
    output: OutputSink | None,
    calls: ToolCalls | None = None,
    *,
    refuse_on: AgentChannel | None = None,
) -> None:
    """Gather a run's events until its ``done``, holding each to the run's caps. A tool call goes to
    ``calls``; without them, it is refused over ``refuse_on`` (code mode is off for the run), or
    (after an interrupt, when the cell is ending) left unanswered."""
    while True:
        event, payload = await route.receive()
        if isinstance(event, wire.Done):
            finish(raw, event, payload, options)
            return
        if isinstance(event, wire.Output):
            if len(event.text) > OUTPUT_TEXT_MOST:
                raise ProtocolViolation("output streamed in larger pieces than the agent streams it")
            if output is not None:
                output.add(event.stream, event.text)
        elif isinstance(event, wire.Image):
            raw.result.images.append(checked_image(event, payload, options, len(raw.result.images)))
        elif isinstance(event, wire.Display):
            displays = raw.result.displays
            if len(displays) >= options.max_displays or len(event.text) > 2 * options.max_display_bytes:
                raise ProtocolViolation("more or longer displays than the run's caps allow")
            displays.append(event.text)
        elif isinstance(event, wire.Table):
            if len(raw.result.tables) >= MAX_TABLES or len(event.columns) != len(event.dtypes):
                raise ProtocolViolation("more tables than a run may show, or a malformed one")
            fields = event.model_dump(include={"table", "columns", "dtypes", "rows", "total_rows", "sorted_columns"})
            raw.result.tables.append(TableRef.model_validate(fields))
        elif isinstance(event, wire.ToolCall):
            raw.tool_calls += 1
            if calls is not None:
                calls.start(event, payload)
                continue
            # None is answered: code mode is off, or the cell was interrupted (with calls in flight).
            most = MAX_CALLS_WITHOUT_CODE_MODE + 2 * (options.max_tool_calls or 0)
            if raw.tool_calls > most:
                raise ProtocolViolation(f"the run sent more than {most} tool calls, far past what it may make")
            if refuse_on is not None:
                await refuse_on.send(refused_call(event))
        elif isinstance(event, wire.Failure):
            raise SandboxLost(f"the sandbox refused the run: {event.message[:300]}")
        else:
            raise ProtocolViolation(f"an unexpected {event.ev!r} event during a run")


def refused_call(call: wire.ToolCall) -> bytes:
    """The answer to a call frame from a run without code mode: denied, naming nothing."""
    reply = wire.ToolReply(id=call.id, call=call.call, ok=False, error="denied")
    return reply.frame(b'{"message": "no tool server of that name is available to this caller"}')


def checked_image(event: wire.Image, payload: bytes, options: wire.RunOptions, count: int) -> ImageOutput:
    size = image_size(event.mime, payload)
    if count >= options.max_images or len(payload) > options.max_image_bytes or size is None:
        raise ProtocolViolation("an image over the run's caps, or not an image")
    if size[0] * size[1] > options.max_image_pixels:
        raise ProtocolViolation("an image over the pixel cap")
    return ImageOutput(mime_type=event.mime, data=payload, width=size[0], height=size[1], note=event.note)


def finish(raw: RawRun, event: wire.Done, payload: bytes, options: wire.RunOptions) -> None:
    text_cap = 8 * max(options.max_output_bytes, options.max_result_bytes) + 4096  # escaping and markers
    error = event.error
    texts = (event.stdout, event.stderr, event.result or "", *((error.message, error.traceback) if error else ()))
    if any(len(text) > text_cap for text in texts):
        raise ProtocolViolation("run output over the caps")
    check_collected(event.files, payload, options)
    result = raw.result
    result.status = event.status
    result.stdout, result.stderr, result.result = event.stdout, event.stderr, event.result
    if event.error is not None:
        result.error = ErrorInfo.model_validate(event.error.model_dump())
    result.image_count = len(result.images)
    result.truncated = list(event.truncated)
    result.notes = list(event.notes)
    result.duration_ms = event.duration_ms
    result.session_restarted = event.session_restarted
    if event.usage is not None:  # the server adds its own figures when the run ends (service/accounting)
        result.usage = Usage.model_validate(event.usage.model_dump())
    raw.files = list(event.files)
    raw.file_bytes = payload
    raw.recycle = event.recycle


def check_collected(files: list[wire.FileEntry], payload: bytes, options: wire.RunOptions) -> None:
    """The bytes of the files a stateless run left lie end to end in the payload, each and all within
    the run's caps: the host copies each file's range, so overlapping ranges would make it copy one
    payload thousands of times."""
    end = carried = 0
    for entry in files:
        if entry.offset is None and entry.length is None:
            continue  # listed without its bytes (over the caps, or unreadable)
        if entry.offset != end or entry.length is None or entry.length > options.collect_file_bytes:
            raise ProtocolViolation("a collected file's bytes are not where the files before it end, or over its cap")
        end += entry.length
        carried += 1
    if end != len(payload) or end > options.collect_bytes or carried > options.collect_files:
        raise ProtocolViolation("the collected files' bytes do not fill the payload, or are over the run's caps")
