"""A worker as the processes that hold it see it: its pid and its four pipes, and a frame sent down
its control pipe (``send_to_worker``: a run's cell, a session's requests, a snapshot order).

The zygote makes one when it forks a worker (``worker.spawn``) and hands the pipe ends to the
supervisor, which makes its own from what arrives (``zygote.Zygote.receive``); neither side owns
the other's module, so the handle lives here, beside them both.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from typing import Any

from . import protocol


class WorkerHandle:
    """The supervisor's view of a worker: its pid and its four pipes."""

    __slots__ = ("control", "pid", "results", "stderr", "stdout")

    def __init__(self, pid: int, stdout: int, stderr: int, results: int, control: int) -> None:
        self.pid, self.stdout, self.stderr, self.results, self.control = pid, stdout, stderr, results, control

    def close(self) -> None:
        """Close the supervisor's ends of the worker's pipes (the worker itself is not touched)."""
        for fd in (self.stdout, self.stderr, self.results, self.control):
            with contextlib.suppress(OSError):
                os.close(fd)


def send_to_worker(handle: WorkerHandle, header: dict[str, Any], payload: bytes, deadline: float) -> bool:
    """Write a frame to the worker's control pipe; False if it is gone or stops reading."""
    data = memoryview(protocol.encode(header, payload))
    os.set_blocking(handle.control, False)
    while data:
        try:
            data = data[os.write(handle.control, data) :]
            continue
        except BlockingIOError:
            pass
        except OSError:
            return False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        select.select([], [handle.control], [], remaining)
    return True
