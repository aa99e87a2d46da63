"""Warnings from the HTTP layer, rate-limited: a flood of bad connections cannot fill the log."""

from __future__ import annotations

import logging
import time
from typing import Any

OBSERVE_LOGGER = "mcp_code_exec.mcp_server.http.observe"  # its refusal lines share the rate limit
# so do these
OAUTH_LOGGERS = ("mcp_code_exec.mcp_server.http.oauth_verifier", "mcp_code_exec.mcp_server.http.oauth_keys")


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
    """One rate limit shared by these loggers (by default the HTTP layer's); a logger that has one
    already (a second listener of the same server) keeps it."""
    limit = RateLimit()
    defaults = (
        *("uvicorn.error", "uvicorn", "mcp.server.sse", "mcp.server.streamable_http", "mcp.server.auth"),
        *(__name__, OBSERVE_LOGGER, OAUTH_LOGGERS[0], OAUTH_LOGGERS[1]),
    )
    for name in loggers or defaults:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, RateLimit) for existing in logger.filters):
            logger.addFilter(limit)
