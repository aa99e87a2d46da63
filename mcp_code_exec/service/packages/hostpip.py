"""The host's pip runs done for calls: a pool of their own, a share of it per client identity, a
timeout of their own, and each ended with the call that asked for it.

Every run of pip is a subprocess in a process group of its own; when the run that asked for it is
cancelled or times out, or pip goes past its own timeout (``[packages] pip_timeout_s``) or past the
bytes it was given, the group is killed and the process reaped before the call returns. At most
``pip_workers`` runs go at once, and at most ``pip_workers_per_client`` of one client identity; the
others wait their turn within their run's own timeout.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
from anyio.abc import ByteReceiveStream, Process

from ...errors import DownloadTooLarge, PipTimeout
from ...runtime.processes import signal_group
from .pipcall import Place, Runner, failure, pip_command

log = logging.getLogger(__name__)
OUTPUT_KEPT = 64 * 1024  # of each of pip's streams, the end is kept (its errors are there)
WATCH_EVERY_S = 0.2  # how often the bytes a run of pip downloaded are counted
REAP_S = 10.0  # how long a killed pip may take to be reaped


class Slots:
    """``total`` places, at most ``per_owner`` of them held by one owner at once."""

    def __init__(self, total: int, per_owner: int) -> None:
        self.total = total
        self.per_owner = per_owner
        self.held: Counter[str] = Counter()
        self._changed = anyio.Event()

    def _free(self, owner: str) -> bool:
        return sum(self.held.values()) < self.total and self.held[owner] < self.per_owner

    @asynccontextmanager
    async def hold(self, owner: str) -> AsyncIterator[None]:
        while not self._free(owner):
            await self._changed.wait()
        self.held[owner] += 1
        try:
            yield
        finally:
            self.held[owner] -= 1
            if not self.held[owner]:
                del self.held[owner]
            self._changed.set()  # every waiter looks again
            self._changed = anyio.Event()


@dataclass
class Output:
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        while self.size - len(self.chunks[0]) >= OUTPUT_KEPT:
            self.size -= len(self.chunks.pop(0))

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", "replace")


class HostPip:
    """Runs the host's pip for one client identity at a time's share (see the module's docstring)."""

    def __init__(self, workers: int, per_owner: int, timeout_s: float) -> None:
        self.slots = Slots(workers, per_owner)
        self.timeout_s = timeout_s
        self.running: dict[int, str] = {}  # pid -> owner, while pip runs (for logs and tests)
        self.started = 0  # runs of pip, all told

    def runner(self, owner: str) -> Runner:
        """``Runner`` for ``owner``'s runs."""

        async def run(args: Sequence[str], what: str, place: Place, max_bytes: int | None) -> str:
            return await self.run(owner, args, what, place, max_bytes=max_bytes)

        return run

    async def run(
        self, owner: str, args: Sequence[str], what: str, place: Place, *, max_bytes: int | None = None
    ) -> str:
        """pip's standard output; ``WheelError`` when it failed, took too long or downloaded too much."""
        async with self.slots.hold(owner):
            began = time.monotonic()
            try:
                with anyio.fail_after(self.timeout_s):
                    returncode, stdout, stderr, over = await self._run(owner, args, place, max_bytes)
            except TimeoutError:
                raise PipTimeout(
                    f"{what}: pip took longer than {self.timeout_s:g} s ([packages] pip_timeout_s; is the index "
                    "reachable?)"
                ) from None
            log.debug("pip %s: %.0f ms, exit %s", what, (time.monotonic() - began) * 1000, returncode)
        if over:
            raise DownloadTooLarge(f"{what}: pip downloaded more than {max_bytes} bytes and was stopped")
        if returncode != 0:
            raise failure(stderr or stdout, what)
        return stdout

    async def _run(
        self, owner: str, args: Sequence[str], place: Place, max_bytes: int | None
    ) -> tuple[int, str, str, bool]:
        process = await anyio.open_process(
            pip_command(args),
            cwd=place.cwd,
            env=place.environment(),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: killed whole
        )
        self.started += 1
        self.running[process.pid] = owner
        stdout, stderr = Output(), Output()
        over = False

        async def watch() -> None:
            nonlocal over
            assert max_bytes is not None
            while True:
                await anyio.sleep(WATCH_EVERY_S)  # a poll of the disk; pip says nothing of its progress
                if await anyio.to_thread.run_sync(place.downloaded) > max_bytes:
                    over = True
                    kill(process)
                    return

        try:
            async with anyio.create_task_group() as watching:
                if max_bytes is not None:
                    watching.start_soon(watch)
                async with anyio.create_task_group() as reading:
                    assert process.stdout is not None and process.stderr is not None
                    reading.start_soon(drain, process.stdout, stdout)
                    reading.start_soon(drain, process.stderr, stderr)
                    returncode = await process.wait()
                watching.cancel_scope.cancel()
        except BaseException:
            kill(process)
            raise
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(REAP_S):
                await process.aclose()  # reaped (after a kill, at once)
            if process.returncode is None:  # pragma: no cover - SIGKILL is not ignored
                log.warning("pip (pid %d) did not end after it was killed", process.pid)
            else:
                self.running.pop(process.pid, None)
        return returncode, stdout.text(), stderr.text(), over


async def drain(stream: ByteReceiveStream, into: Output) -> None:
    async for chunk in stream:
        into.add(chunk)


def kill(process: Process) -> None:
    """Kill pip and whatever it started (its process group), if it has not been reaped yet."""
    if process.returncode is None:
        signal_group(process, signal.SIGKILL)
