"""Code mode's transports to upstream servers, bounded while they read: no message of an upstream's
is ever held past ``cap`` bytes (``code_mode.max_answer_mb``).

- stdio: the SDK's ``stdio_client`` reads a line whole, however long, before anything can judge
  it. This one spawns the server the same way (its own process group; the SDK's default
  environment plus the configured ``env``; the parent's stderr) and splits its stdout into lines
  itself: a line past the cap is skipped as it arrives, keeping only its first and last bytes, and
  the request it answers gets an error instead (its id is read from the line's framing, before or
  after the result, and must be one of the requests still waiting); a line whose request cannot be
  told ends the connection (the upstream is restarted).
- streamable HTTP: a JSON body past the cap fails that request as it is read (the SDK turns the
  error into the request's answer), and the SDK's own bound on one server-sent event is the cap.

A message over the cap is never parsed, so what it costs the server is the cap and the chunk being read.
"""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx2
import mcp_types
from mcp.client.stdio import StdioServerParameters, get_default_environment
from mcp.shared.message import SessionMessage
from mcp.types import ErrorData, JSONRPCError, JSONRPCNotification, JSONRPCRequest, JSONRPCResponse

from ..config.units import MIB
from ..runtime.processes import stop_group

log = logging.getLogger(__name__)
TOO_LARGE = "over code mode's cap on one upstream message"  # in every error for such a message
TOO_LARGE_CODE = -32099  # JSON-RPC's server-error range: the request's answer was too large to read
EDGE = 512  # bytes kept of the start and the end of a line past the cap (where its id is)
STOP_GRACE_S = 2.0  # after stdin closes, then again after SIGTERM


def too_large_text(cap: int) -> str:
    return (
        f"the answer is {TOO_LARGE} ({cap // MIB} MiB, code_mode.max_answer_mb): it was dropped unread; "
        "ask for less (a range, a page, a filter)"
    )


@dataclass
class Oversized:
    """A line past the cap: only its edges, and how long it was."""

    head: bytes
    tail: bytes
    size: int


@dataclass
class LineSplitter:
    """Newline-delimited messages from a byte stream; a line past ``cap`` comes out as ``Oversized``."""

    cap: int
    pending: bytearray = field(default_factory=bytearray)
    skipping: Oversized | None = None

    def feed(self, chunk: bytes) -> list[bytes | Oversized]:
        out: list[bytes | Oversized] = []
        while chunk:
            end = chunk.find(b"\n")
            piece, chunk = (chunk, b"") if end < 0 else (chunk[:end], chunk[end + 1 :])
            self._take(piece)
            if end >= 0:
                out.append(self.skipping if self.skipping is not None else bytes(self.pending))
                self.pending, self.skipping = bytearray(), None
        return out

    def _take(self, piece: bytes) -> None:
        if self.skipping is not None:
            self.skipping.size += len(piece)
            self.skipping.tail = (self.skipping.tail + piece)[-EDGE:]
        elif len(self.pending) + len(piece) > self.cap:
            line = bytes(self.pending) + piece
            self.skipping = Oversized(line[:EDGE], line[-EDGE:], len(line))
            self.pending = bytearray()
        else:
            self.pending += piece


_ID = r'("id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.){0,200}"))'
HEAD_ID = re.compile(rb'^\s*\{\s*"jsonrpc"\s*:\s*"2\.0"\s*,\s*' + _ID.encode() + rb"\s*,")  # Python SDKs' order
TAIL_ID = re.compile(rb",\s*" + _ID.encode() + rb"\s*\}\s*$")  # TypeScript SDKs': result first, id last


def oversized_reply(line: Oversized, waiting: set[Any], cap: int) -> JSONRPCError | None:
    """The error answering the request a line past the cap answered, told by the id in its framing
    (a top-level ``"id"`` right after ``"jsonrpc"`` at its start, or as the last key at its end: the
    result's own bytes cannot be either); None when no waiting request is named."""
    for pattern, edge in ((HEAD_ID, line.head), (TAIL_ID, line.tail)):
        found = pattern.search(edge)
        if found is None:
            continue
        text = found.group(2).decode("utf-8", "replace")
        request_id: Any = int(text) if not text.startswith('"') else _string_id(text)
        if request_id in waiting:
            return JSONRPCError(
                jsonrpc="2.0", id=request_id, error=ErrorData(code=TOO_LARGE_CODE, message=too_large_text(cap))
            )
    return None


def _string_id(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_line(line: bytes) -> SessionMessage | Exception:
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return exc


@asynccontextmanager
async def bounded_stdio(params: StdioServerParameters, cap: int, name: str) -> AsyncIterator[tuple[Any, Any]]:
    """The SDK's stdio transport, reading no message past ``cap`` bytes (``name``: the upstream's, for the log)."""
    process = await anyio.open_process(
        [params.command, *params.args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None,  # the server's own stderr, as the SDK does
        cwd=params.cwd,
        env=get_default_environment() | (params.env or {}),
        start_new_session=True,
    )
    read_send, read_receive = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_send, write_receive = anyio.create_memory_object_stream[SessionMessage](0)
    waiting: set[Any] = set()  # ids of requests sent and not answered yet

    async def reader() -> None:
        assert process.stdout is not None
        splitter = LineSplitter(cap)
        async with read_send:
            with suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError):
                async for chunk in process.stdout:
                    for line in splitter.feed(chunk):
                        if not await _deliver(line, read_send, waiting, cap, name):
                            return  # the read stream closes: the session sees the connection end

    async def writer() -> None:
        assert process.stdin is not None
        async with write_receive:
            with suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                async for outgoing in write_receive:
                    message = outgoing.message
                    if isinstance(message, JSONRPCRequest):
                        waiting.add(message.id)
                    elif isinstance(message, JSONRPCNotification) and message.method == "notifications/cancelled":
                        waiting.discard((message.params or {}).get("requestId"))  # no answer will come
                    data = message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    await process.stdin.send(data.encode())
        await read_send.aclose()  # the server stopped reading: the session must not wait for answers

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        tg.start_soon(writer)
        try:
            yield read_receive, write_send
        finally:
            with anyio.CancelScope(shield=True):
                await write_send.aclose()
                await stop_group(process, grace_s=STOP_GRACE_S, close_stdin=True)
                with suppress(Exception):
                    await process.aclose()
            tg.cancel_scope.cancel()


async def _deliver(line: bytes | Oversized, send: Any, waiting: set[Any], cap: int, name: str) -> bool:
    """Hand one line to the session; False when the connection must end (a line past the cap that
    answers no request still waiting)."""
    if isinstance(line, Oversized):
        reply = oversized_reply(line, waiting, cap)
        if reply is None:
            log.warning(
                "code mode: upstream %s sent %d bytes in one message, over the cap: restarting it",
                name,
                line.size,
            )
            return False
        waiting.discard(reply.id)
        log.warning("code mode: upstream %s answered with %d bytes, over the cap: the call fails", name, line.size)
        await send.send(SessionMessage(reply))
        return True
    if not line.strip():
        return True
    message = parse_line(line)
    if isinstance(message, SessionMessage) and isinstance(message.message, JSONRPCResponse | JSONRPCError):
        waiting.discard(message.message.id)
    await send.send(message)
    return True


class CappedBody(httpx2.AsyncByteStream):
    """A response body that fails once it passes ``cap`` bytes (``httpx2.StreamError``: the SDK
    answers the request with it)."""

    def __init__(self, inner: httpx2.AsyncByteStream, cap: int) -> None:
        self.inner = inner
        self.cap = cap

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = 0
        async for chunk in self.inner:
            read += len(chunk)
            if read > self.cap:
                raise httpx2.StreamError(too_large_text(self.cap))
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class CappedTransport(httpx2.AsyncBaseTransport):
    """Every body but a server-sent event stream (bounded per event by the SDK) capped at ``cap``."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, cap: int) -> None:
        self.inner = inner
        self.cap = cap

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        if response.headers.get("content-type", "").lower().startswith("text/event-stream"):
            return response
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        response.stream = CappedBody(response.stream, self.cap)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def bounded_http_client(headers: dict[str, str], cap: int) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(
        headers=headers, timeout=math.inf, transport=CappedTransport(httpx2.AsyncHTTPTransport(), cap)
    )
