"""The server over this process's stdin and stdout (``serve --in-process``), and the stdin it reads.

The SDK's ``run_stdio_async`` reads stdin in a worker thread, which cancellation cannot interrupt:
SIGTERM or SIGINT would wait until the client wrote another line or closed the pipe. So the server
reads a private copy of fd 0 only once it is readable (``StdinLines``), while fd 0 itself reads
``/dev/null``. SIGINT/SIGTERM and stdin closing end the server; every container and volume is removed
before the process exits. ``--metrics-port`` serves the metrics beside it, on the HTTP host's
metrics listener.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import anyio

from ...config.settings import Config
from ...service.facade import SandboxService
from ..app import build_server, stop_on_signal
from ..http.listeners import connection_budget, is_loopback
from ..http.observe import METRICS_MAX_CONNECTIONS, check_metrics_port, metrics_port
from ..identity import LOCAL, serving_as
from ..sdk import serve_streams
from .late_service import stdio_scope

log = logging.getLogger(__name__)


async def serve_stdio(config: Config, identity: str = LOCAL, metrics: int | None = None) -> int:
    """Serve one client on this process's stdin and stdout as ``identity`` until stdin closes or a
    signal comes; ``metrics``: the port of ``--metrics-port``."""
    check_metrics_port(config.metrics, metrics, is_loopback)
    budget = connection_budget(0, METRICS_MAX_CONNECTIONS if metrics is not None else 0)
    async with anyio.create_task_group() as tg:
        await tg.start(stop_on_signal, tg.cancel_scope)  # before the SandboxService starts anything
        async with (
            SandboxService.start(config, scope=stdio_scope(config.sessions)) as service,
            metrics_port(config.metrics, metrics, config.http, budget),
        ):
            server = build_server(service)
            with serving_as(identity), claimed_stdin() as stdin:
                await serve_streams(server, stdin)
            log.info("stdin closed; shutting down")
        tg.cancel_scope.cancel()
    log.info("shut down cleanly")
    return 0


@contextmanager
def claimed_stdin() -> Iterator[StdinLines]:
    """Read the client from a private copy of fd 0; fd 0 itself reads /dev/null meanwhile (as in the SDK)."""
    private = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
    finally:
        os.close(null)
    try:
        yield StdinLines(private)
    finally:
        os.dup2(private, 0)
        os.close(private)


class StdinLines:
    """Lines from a file descriptor, read only once it is readable (so the wait is cancellable)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        pending = bytearray()
        pollable = True
        while True:
            try:
                if pollable:
                    await anyio.wait_readable(self.fd)
                    chunk = os.read(self.fd, 1 << 20)
                else:  # a regular file cannot be polled (epoll refuses it), and reads never block
                    chunk = await anyio.to_thread.run_sync(os.read, self.fd, 1 << 20)
            except BlockingIOError:
                continue
            except PermissionError:
                pollable = False
                continue
            except OSError:
                chunk = b""
            if not chunk:
                if pending:
                    yield pending.decode("utf-8", "replace")
                return
            start = len(pending)
            pending += chunk
            end = pending.find(b"\n", start)
            while end != -1:
                yield pending[: end + 1].decode("utf-8", "replace")
                del pending[: end + 1]
                end = pending.find(b"\n")
