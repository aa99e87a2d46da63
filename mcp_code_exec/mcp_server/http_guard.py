"""What keeps the HTTP listener answering under a flood of connections that never finish.

- A connection must send a request's headers within ``header_timeout_s`` (uvicorn has no such
  limit: a connection that never finishes its headers is held forever, and about a thousand of
  them exhaust the process's descriptors).
- Connections past ``max_connections`` are closed at once.
- The process's descriptor limit is raised to its hard limit.
- Warnings from the HTTP layer are rate-limited, so a flood cannot fill the log.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()
                return
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers must come in time too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


def raise_descriptor_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.debug("could not raise the descriptor limit: %s", exc)


class RateLimit(logging.Filter):
    """At most ``per_minute`` records a minute through this filter; then one line saying how many were dropped."""

    def __init__(self, per_minute: int = 20) -> None:
        super().__init__()
        self.per_minute = per_minute
        self.window = 0.0
        self.count = 0
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self.window >= 60:
            if self.dropped:
                record.msg = f"{record.msg} ({self.dropped} similar messages dropped in the last minute)"
            self.window, self.count, self.dropped = now, 0, 0
        self.count += 1
        if self.count > self.per_minute:
            self.dropped += 1
            return False
        return True


def quiet_http_logs(*loggers: Any) -> None:
    limit = RateLimit()
    for name in loggers or ("uvicorn.error", "uvicorn", "mcp.server.sse", "mcp.server.streamable_http"):
        logging.getLogger(name).addFilter(limit)
