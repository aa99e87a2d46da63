"""A one-off command that SIGTERM or SIGHUP stops as Ctrl-C does: by cancelling its work.

Python's default SIGTERM ends the process where it stands. No ``with`` or ``finally`` block
runs, so a stopped ``image build`` used to leave its build context behind in the temporary
directory (hundreds of MB where its wheels could not be hard links), or a debootstrap rootfs.
Here the signal cancels the command's task instead, and each of its context managers removes
what it made.

For the CLI's one-off commands only. The server and the local service handle their own signals.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.abc

T = TypeVar("T")
STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """The command was stopped by a signal; everything it made is removed."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process that signal ended


def run_until_stopped(work: Callable[[], Awaitable[T]]) -> T:
    """``anyio.run(work)``; raises ``Stopped`` once the work was cancelled by a stopping signal.
    Called from another thread than the main one (``main`` run by an embedding program), it is
    plain ``anyio.run``: only the main thread can receive signals, and they are its owner's."""
    if threading.current_thread() is not threading.main_thread():
        return anyio.run(work)

    async def main() -> T:
        received: list[int] = []
        results: list[T] = []
        failures: list[Exception] = []  # raised as they are, not in the task group's exception group
        async with anyio.create_task_group() as group:

            async def watch(*, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
                with anyio.open_signal_receiver(*STOPPING_SIGNALS) as signals:
                    task_status.started()  # the work begins once a stop would be caught
                    async for signum in signals:
                        received.append(signum)
                        group.cancel_scope.cancel()
                        return

            await group.start(watch)
            try:
                results.append(await work())
            except Exception as exc:  # noqa: BLE001 - raised again below, once the watcher has ended
                failures.append(exc)
            group.cancel_scope.cancel()
        if results:
            return results[0]  # done before the stop came
        if received:
            raise Stopped(received[0])
        raise failures[0]

    return anyio.run(main)


def exit_now_if_threads_remain(code: int) -> int:
    """``code``, or the process's end with it when threads abandoned by the cancelled work still
    run: a blocking engine call (a build's output stream) does not return for a cancellation, and
    the interpreter would wait for it at exit. Ending the process closes its connections, which
    makes the engine cancel the build. Call it only once every ``with`` and ``finally`` has run."""
    if threading.active_count() == 1:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    import os

    os._exit(code)
