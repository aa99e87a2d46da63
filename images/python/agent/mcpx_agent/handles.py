"""A worker as the processes that hold it see it: its pid and its four pipes.

The zygote makes one when it forks a worker (``worker.spawn``) and hands the pipe ends to the
supervisor, which makes its own from what arrives (``zygote.Zygote.receive``); neither side owns
the other's module, so the handle lives here, beside them both.
"""

from __future__ import annotations

import contextlib
import os


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
