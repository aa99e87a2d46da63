"""One upstream MCP server: started at first use, kept up for the service's life, restarted with
backoff when it goes away, its ``tools/list`` cached and refreshed when it says the list changed.

A stdio child gets the SDK's default environment (``HOME``, ``PATH``, ``USER``...) plus its
configured ``env``, never the server's own (its token included), and starts in its configured
``cwd`` or else in a private empty directory of its own (the server's working directory may be one
a sandbox writes to, and ``python3 -m NAME`` imports ``NAME.py`` from its working directory first).
An HTTP server gets its configured headers, their ``${NAME}`` values read from the host's
environment. Nothing of this (addresses, headers, environment) ever reaches a sandbox. What is read
of an upstream's messages is bounded while it is read (``transport``): an answer past
``max_answer_mb`` fails its call with ``TooLarge`` and is never held whole.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.abc import TaskGroup
from mcp import Client, MCPError, StdioServerParameters
from mcp.types import CallToolResult, Tool, ToolListChangedNotification
from mcp_types import CONNECTION_CLOSED

from ..config.code_mode import UpstreamServer
from .transport import TOO_LARGE, TOO_LARGE_CODE, bounded_http_client, bounded_stdio, too_large_text

log = logging.getLogger(__name__)
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Unavailable(Exception):
    """The upstream cannot be reached now (not started, gone, restarting)."""


class TooLarge(Exception):
    """The upstream's answer was over the cap on one message, and dropped unread."""


class Upstream:
    def __init__(
        self, config: UpstreamServer, task_group: TaskGroup, start_timeout_s: float, max_answer_bytes: int = 4 << 20
    ) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.max_answer_bytes = max_answer_bytes
        self._tg = task_group
        self._client: Client | None = None
        self._up = anyio.Event()  # set while connected
        self._lost = anyio.Event()  # set to make the keeper reconnect
        self._stop = anyio.Event()
        self._started = False
        self.tools: dict[str, Tool] = {}
        self._stale = False
        self.failures = 0
        self.last_error = ""

    async def client(self) -> Client:
        """The connected client, starting the server at first use (bounded by the start timeout)."""
        if not self._started:
            self._started = True
            self._tg.start_soon(self._keep_up)
        if self._client is None:  # starting, or restarting (a server that keeps failing is not waited for)
            with anyio.move_on_after(self.start_timeout_s if self.failures < 3 else 0):
                await self._up.wait()
        if self._client is None:
            raise Unavailable(f"the server {self.config.name!r} is not available ({self.last_error or 'starting'})")
        return self._client

    async def list_tools(self) -> dict[str, Tool]:
        client = await self.client()
        if self._stale:
            self._stale = False
            with contextlib.suppress(Exception):
                self.tools = await _all_tools(client)
        return self.tools

    async def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> CallToolResult:
        """Call a tool; ``TimeoutError`` past ``timeout_s``, ``Unavailable`` if the connection is gone
        (the keeper then reconnects), ``MCPError`` for the upstream's own protocol errors."""
        client = await self.client()
        try:
            with anyio.fail_after(timeout_s):
                return await client.call_tool(name, arguments)
        except MCPError as exc:
            if too_large(exc):
                raise TooLarge(too_large_text(self.max_answer_bytes)) from None
            if exc.error.code == CONNECTION_CLOSED:
                self.lose(f"the connection closed ({exc.error.message[:100]})")
                raise Unavailable(f"the server {self.config.name!r} went away during the call") from None
            raise
        except TimeoutError:
            raise  # the call's own time limit (an OSError too, but the connection is fine)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError) as exc:
            self.lose(type(exc).__name__)
            raise Unavailable(f"the server {self.config.name!r} went away during the call") from None

    def lose(self, why: str) -> None:
        self.last_error = why
        self._client = None
        if self._up.is_set():
            self._up = anyio.Event()  # the next callers wait for the reconnection
        self._lost.set()

    async def aclose(self) -> None:
        self._stop.set()
        self._lost.set()

    async def _keep_up(self) -> None:
        """Connect, and reconnect with backoff whenever the connection is lost, until stopped; a
        stdio server without ``cwd`` works in a private empty directory, removed at the end."""
        private = self.config.command is not None and self.config.cwd is None
        workdir = tempfile.mkdtemp(prefix="mcp-code-exec-upstream-") if private else None  # mode 0700
        try:
            await self._reconnecting(workdir)
        finally:
            if workdir is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(shutil.rmtree, workdir, True)

    async def _reconnecting(self, workdir: str | None) -> None:
        while not self._stop.is_set():
            self._lost = anyio.Event()
            was_up = False
            try:
                async with self._connect(workdir) as client:
                    with anyio.fail_after(self.start_timeout_s):
                        self.tools = await _all_tools(client)
                    self._client, self.failures, self.last_error = client, 0, ""
                    self._up.set()
                    was_up = True
                    log.info("code mode: upstream %s is up (%d tools)", self.config.name, len(self.tools))
                    async with anyio.create_task_group() as listening:
                        listening.start_soon(self._listen, client)
                        await self._lost.wait()
                        listening.cancel_scope.cancel()
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:  # noqa: BLE001 - an upstream's failure never reaches the service
                self.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
                log.warning("code mode: upstream %s failed: %s", self.config.name, self.last_error)
            self._client = None
            if self._up.is_set():
                self._up = anyio.Event()
            if self._stop.is_set():
                return
            delay = BACKOFF_S[min(self.failures, len(BACKOFF_S) - 1)]
            self.failures += 0 if was_up else 1  # a server that was up starts again at the shortest wait
            with anyio.move_on_after(delay):
                await self._stop.wait()

    @contextlib.asynccontextmanager
    async def _connect(self, workdir: str | None) -> AsyncIterator[Client]:
        config, cap = self.config, self.max_answer_bytes
        handler = self._on_message
        if config.command is not None:
            params = StdioServerParameters(
                command=config.command, args=config.args, env=config.env or None, cwd=config.cwd or workdir
            )
            async with Client(bounded_stdio(params, cap, config.name), message_handler=handler) as client:
                yield client
            return
        from mcp.client.streamable_http import streamable_http_client

        assert config.url is not None
        async with (
            bounded_http_client(config.header_values(), cap) as http,
            Client(
                streamable_http_client(config.url, http_client=http, max_sse_event_size=cap), message_handler=handler
            ) as client,
        ):
            yield client

    async def _listen(self, client: Client) -> None:
        """A 2026-07-28 upstream announces a changed tool list on a ``subscriptions/listen`` stream (a
        2025-era one as a notification: ``_on_message``); either way the list is read again at the
        next run's catalog. An upstream that serves no stream only loses the refresh."""
        try:
            async with client.listen(tools_list_changed=True) as events:
                async for _ in events:
                    self._stale = True
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # noqa: BLE001 - legacy era, no listen support, or the stream dropped
            log.debug("code mode: upstream %s: no list-changed stream (%s)", self.config.name, type(exc).__name__)

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, ToolListChangedNotification):
            self._stale = True  # read again at the next run's catalog


async def _all_tools(client: Client) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    cursor: str | None = None
    for _ in range(50):  # pages; an upstream that pages forever is cut off
        listed = await client.list_tools(cursor=cursor, cache_mode="refresh")
        tools.update({tool.name: tool for tool in listed.tools})
        cursor = listed.next_cursor
        if not cursor:
            break
    return tools


def too_large(exc: MCPError) -> bool:
    """An answer over the cap: the stdio transport's own error, the capped JSON body's (the SDK
    reports it as unparsable), or a server-sent event past the SDK's bound."""
    message = exc.error.message
    return exc.error.code == TOO_LARGE_CODE or TOO_LARGE in message or "Server-sent event exceeded" in message
