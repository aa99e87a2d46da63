"""A run's tool calls (code mode), as the supervisor sees them after the call went to the host.

The host answers each call, and the answer waits here for the worker's control pipe (the worker
reads it when the cell waits for it); while a human is asked to approve a call, the host stops the
run's clock and starts it again (approval waits do not count against the run's timeout).
"""

from __future__ import annotations

import os
import time
from typing import Any

from .. import events, protocol

PAUSED_WAKE_S = 60.0  # while a call waits for approval the deadline is held; the host bounds the wait


class ToolCalls:
    """The answers on their way to the worker, and the pauses of the run's clock."""

    def __init__(self, control: int) -> None:
        self.control = control  # the worker's control pipe
        self.out = bytearray()  # answers to tool calls not yet written to the control pipe
        self.pauses = 0  # tool calls waiting for a human's approval (the run's clock stands still meanwhile)
        self.paused_at: float | None = None

    def take(self, messages: list[tuple[dict[str, Any], bytes]]) -> float:
        """Queue the host's answers for the worker and count its pauses; the seconds the run's clock
        stood still in the pauses that ended (they are added to its deadline)."""
        stood = 0.0
        for request, payload in messages:
            stood += self.take_one(request, payload)
        return stood

    def take_one(self, request: dict[str, Any], payload: bytes) -> float:
        if request.get("op") == "tool_pause":
            now = time.monotonic()
            if request.get("paused") is True:
                self.pauses += 1
                self.paused_at = now if self.paused_at is None else self.paused_at
            elif self.pauses > 0:
                self.pauses -= 1
                if self.pauses == 0 and self.paused_at is not None:
                    stood, self.paused_at = now - self.paused_at, None
                    return stood
            return 0.0
        reply = events.tool_reply(request.get("call"), request.get("ok") is True, request.get("error"))
        self.out += protocol.encode(reply, payload)
        self.flush()
        return 0.0

    def held_deadline(self, at: float, *, interrupted: bool) -> float:
        """While a call waits for a human's approval the run's time stands still (the host bounds the wait)."""
        return time.monotonic() + PAUSED_WAKE_S if self.paused_at is not None and not interrupted else at

    def flush(self) -> None:
        """Write what the control pipe takes now (the worker reads it when it waits for the answer)."""
        os.set_blocking(self.control, False)
        while self.out:
            try:
                written = os.write(self.control, self.out[: 1 << 16])
            except BlockingIOError:
                return
            except OSError:
                self.out.clear()  # the worker is gone; its end is reported as usual
                return
            del self.out[:written]
