"""A one-off command that Ctrl-C, SIGTERM or SIGHUP stops by cancelling its work.

Python's default SIGTERM ends the process where it stands. No ``with`` or ``finally`` block
runs, so a stopped ``image build`` used to leave its build context behind in the temporary
directory (hundreds of MB where its wheels could not be hard links), or a debootstrap rootfs.
And Ctrl-C's ``KeyboardInterrupt`` left the engine's build running in an abandoned thread, which
the interpreter then waited for, so the image was built and tagged anyway. Here the signal
cancels the command's task instead: each of its context managers removes what it made, and a
second signal while they do is ignored.

For the CLI's one-off commands only. The server and the local service handle their own signals.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.abc

T = TypeVar("T")
STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """The command was stopped by a signal, and its work has unwound."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process that signal ended


def run_until_stopped(work: Callable[[], Awaitable[T]]) -> T:
    """``anyio.run(work)``; raises ``Stopped`` once the work was cancelled by a stopping signal.

    A signal this process ignores (SIGHUP under ``nohup``) stays ignored, and every handler is
    what it was once this returns. Called from another thread than the main one (``main`` run by
    an embedding program), it is plain ``anyio.run``: only the main thread can receive signals."""
    if threading.current_thread() is not threading.main_thread():
        return anyio.run(work)
    watched = [signum for signum in STOPPING_SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN]
    before = {signum: signal.getsignal(signum) for signum in watched}
    try:
        return anyio.run(_until_stopped, work, watched)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


async def _until_stopped(work: Callable[[], Awaitable[T]], watched: list[signal.Signals]) -> T:
    received: list[int] = []
    results: list[T] = []
    failures: list[Exception] = []  # raised as they are, not in the task group's exception group
    work_scope = anyio.CancelScope()

    async def watch(*, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # Open until the work has unwound: a second signal during its clean-up is ignored, not fatal.
        with anyio.open_signal_receiver(*watched) as signals:
            task_status.started()  # the work begins once a stop would be caught
            async for signum in signals:
                if not received:
                    received.append(signum)
                    work_scope.cancel()

    async with anyio.create_task_group() as group:
        await group.start(watch)
        with work_scope:
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


def exit_now_if_threads_remain(code: int) -> int:
    """``code``, or the process's end with it when other threads still run: a blocking engine call
    (a build's output stream) abandoned by the cancelled work does not return for a cancellation,
    and the interpreter would wait for it at exit. Ending the process closes its connections,
    which makes the engine cancel the build. Call it only once every ``with`` and ``finally`` has
    run. (An idle worker thread of anyio's may still be ending: ending the process then costs
    nothing either.)"""
    if threading.active_count() == 1:
        return code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
