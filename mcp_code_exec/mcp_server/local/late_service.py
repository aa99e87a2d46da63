"""The local service's ``SandboxService`` while it starts in the background, and the gate that holds
each connection's calls until it has (docs/architecture.md, "A stdio client's first second").

Starting it (the engine connection, the image check, the adoption of durable sessions and the sweep
of what dead servers left) takes most of a second on a busy engine, and a new stdio client is
answered before then. The MCP server is built over a ``LateService``: the configuration from the
start, everything else once the ``SandboxService`` is there. A ``StartGate`` on each connection lets
only the handshake (``initialize``, ``server/discover``, ``ping``, ``notifications/initialized``) and
``tools/list`` through before then; the first other message waits, and every message after it, in
order, until the service has started (bounded), so no handler ever sees a service that is not there.
If the start fails, each waiting request is answered with the reason, and the connection ends.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from ...config.sections import SessionSettings
from ...config.settings import Config
from ...errors import SandboxError

if TYPE_CHECKING:
    from ...protocol.messages import ToolSpec
    from ...service.facade import SandboxService
    from ...service.run_registry import RunWatcher

log = logging.getLogger(__name__)
# What is served before the SandboxService is there: the handshake, and the tools' list (built from
# the configuration alone; a client lists them right after connecting).
SERVED_BEFORE_START = frozenset({"initialize", "server/discover", "ping", "notifications/initialized", "tools/list"})
DRAIN_S = 5.0  # after a failed start: how long the waiting requests have to be told why
INTERNAL_ERROR = -32603


def stdio_scope(sessions: SessionSettings) -> str:
    """Whose stopped sessions a server over stdio serves again: ``sessions.scope``, else the same user's."""
    return sessions.scope or f"stdio:{os.getuid()}"


class LateService:
    """A ``SandboxService`` to come: its configuration now, the rest once ``run`` has started it.

    Used before then (which the gate prevents), any attribute raises a ``SandboxError`` saying the
    service is starting; ``holds_work`` is honestly False (nothing is held yet).
    """

    def __init__(self, config: Config, start_wait_s: float) -> None:
        self.config = config
        self.start_wait_s = start_wait_s
        self.service: SandboxService | None = None
        self.failure: Exception | None = None
        self.settled = anyio.Event()  # started, or failed
        self._watchers: list[RunWatcher] = []  # held until the service starts, which holds them weakly
        self._waiting = 0
        self._drained = anyio.Event()

    def __getattr__(self, name: str) -> Any:
        """The rest of ``ServicePort``: the started service's (``build_server`` takes this object as it)."""
        service = self.__dict__.get("service")
        if service is None:
            raise SandboxError(f"the local service is still starting ({name} is not there yet)")
        return getattr(service, name)

    def watch_runs(self, watcher: RunWatcher) -> None:
        if self.service is not None:
            self.service.watch_runs(watcher)
        else:
            self._watchers.append(watcher)

    def holds_work(self) -> bool:
        return self.service is not None and self.service.holds_work()

    async def tool_catalog(self, owner: str) -> list[ToolSpec]:
        """For ``tools/list``, which is served before the start: with no code-mode servers configured,
        nothing (at once); else the caller's tools once the service has started (bounded), so the
        description a client lists first is already complete."""
        if not self.config.code_mode.servers:
            return []
        if await self.wait_started() is not None:
            return []  # failed or still starting: the description goes without them, the call is told later
        assert self.service is not None
        return await self.service.tool_catalog(owner)

    async def reach_text(self, owner: str) -> str:
        """For ``tools/list`` too: without egress nothing (at once); else once the service has started."""
        if not self.config.egress.enabled or await self.wait_started() is not None:
            return ""
        assert self.service is not None
        return await self.service.reach_text(owner)

    async def run(self, on_ready: Callable[[str], None], stop_serving: anyio.CancelScope) -> None:
        """Start the ``SandboxService`` and hold it until cancelled. A failed start is kept (the
        daemon raises it once it has stopped serving), told to the waiting requests, and stops serving."""
        from ...service.facade import SandboxService

        try:
            scope = stdio_scope(self.config.sessions)  # the stopped sessions it serves again
            async with SandboxService.start(self.config, scope=scope) as service:
                for watcher in self._watchers:
                    service.watch_runs(watcher)
                self.service = service
                self.settled.set()
                log.info("the sandbox service started")
                on_ready("ready")
                await anyio.sleep_forever()
        except Exception as exc:  # noqa: BLE001 - kept, told, and raised by the daemon once it stops
            self.failure = exc
            self.settled.set()
            log.error("the sandbox service could not start: %s", exc)
            with anyio.move_on_after(DRAIN_S):
                if self._waiting:
                    await self._drained.wait()
            stop_serving.cancel()

    @asynccontextmanager
    async def waiting(self) -> AsyncIterator[None]:
        """Held by a call from before it waits for the start until it is served or told why not: a
        failed start lets those calls be told before the connections close."""
        if not self._waiting:
            self._drained = anyio.Event()
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1
            if not self._waiting:
                self._drained.set()

    async def wait_started(self) -> str | None:
        """None once the service has started; else why a call cannot be served (failed, or still
        starting past the bound)."""
        log.info("a call waits for the sandbox service to start")
        with anyio.move_on_after(self.start_wait_s):
            await self.settled.wait()
        if self.failure is not None:
            return f"the local service could not start: {self.failure}"
        if self.service is None:
            return f"the local service is still starting after {self.start_wait_s:.0f} s; see its log"
        return None


class LineWriter(Protocol):
    async def write(self, text: str) -> None: ...


class StartGate:
    """A connection's lines as the MCP server reads them: the handshake at once, anything else once
    the service has started. A request the service cannot serve is answered with why (a failed
    start also ends the connection)."""

    def __init__(self, lines: AsyncIterable[str], late: LateService, writer: LineWriter) -> None:
        self.lines = lines
        self.late = late
        self.writer = writer

    def __aiter__(self) -> AsyncIterator[str]:
        return self._gated()

    async def _gated(self) -> AsyncIterator[str]:
        async for line in self.lines:
            if self.late.service is None and not _served_before_start(line):
                async with self.late.waiting():
                    why = await self.late.wait_started()
                    if why is not None:
                        await self._refuse(line, why)
                if why is not None:
                    if self.late.failure is not None:
                        return  # the service is going away: end this client's stream
                    continue
            yield line

    async def _refuse(self, line: str, why: str) -> None:
        request_id = _request_id(line)
        if request_id is None:
            return  # a notification (or garbage): nothing to answer
        error = {"jsonrpc": "2.0", "id": request_id, "error": {"code": INTERNAL_ERROR, "message": why}}
        await self.writer.write(json.dumps(error) + "\n")


def _message(line: str) -> dict[str, Any] | None:
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _served_before_start(line: str) -> bool:
    message = _message(line)
    return message is not None and message.get("method") in SERVED_BEFORE_START


def _request_id(line: str) -> str | int | None:
    message = _message(line)
    if message is None or "method" not in message:
        return None
    request_id = message.get("id")
    return request_id if isinstance(request_id, str | int) and not isinstance(request_id, bool) else None
