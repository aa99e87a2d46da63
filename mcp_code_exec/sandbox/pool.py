"""Warm containers: started in the background, lent out, recycled or replaced.

A ``WarmPool`` keeps ``size`` containers that belong to it (idle, lent, or being confirmed
clean). ``acquire`` waits a bounded time for an idle one and raises ``PoolBusy`` past that, so
load turns into a clear "retry" instead of an unbounded queue. A caller that has waited
``grow_after_s`` gets one more container started, up to ``max_size``: short runs never trigger
it, but long runs cannot hold every container while others wait. The extra ones are retired as
they come back. A released container is idle
again only once its agent confirms that the run's processes are dead and everything is wiped;
any doubt, and it is destroyed and replaced. ``take`` removes a container for good (it becomes a
session) and the pool starts a replacement. Failed starts are retried with backoff, never in a
tight loop, and the last failure is reported to callers who would otherwise wait in vain.
Over several engines, ``misplaced`` says which containers would be better placed elsewhere (an
engine came back): they are replaced instead of reused, and ``retire_misplaced`` does the same for
those waiting idle; the replacements are placed afresh.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from types import TracebackType

import anyio
from anyio.abc import TaskGroup

from ..errors import PoolBusy, PoolClosed, SandboxError
from ..observability import metrics
from ..observability.tracing import traced
from .container import Sandbox

log = logging.getLogger(__name__)

Starter = Callable[[], Awaitable[Sandbox]]


class WarmPool:
    def __init__(
        self,
        name: str,
        starter: Starter,
        *,
        size: int,
        acquire_timeout_s: float,
        max_size: int | None = None,
        grow_after_s: float = 0.5,
        max_runs: int | None = None,
        max_backoff_s: float = 30.0,
        concurrency: int = 2,
        start_after: anyio.Event | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        misplaced: Callable[[Sandbox], bool] | None = None,
    ) -> None:
        self.name = name
        self.size = size
        self.max_size = max(size, max_size or size)
        self.grow_after_s = grow_after_s
        self.acquire_timeout_s = acquire_timeout_s
        self.max_runs = max_runs
        self.max_backoff_s = max_backoff_s
        self.last_error: SandboxError | None = None
        self.starts = 0
        self.failures = 0
        self.recent_backoffs: deque[float] = deque(maxlen=32)  # the waits after failed starts, newest last
        self.died_idle = 0  # warm containers found dead while waiting (and replaced)
        self._starter = starter
        self._sleep = sleep
        self._misplaced = misplaced
        self._owned = 0  # idle + lent + starting
        self._target = size  # how many to own now: size, plus those started for callers who waited
        self._idle_send, self._idle_recv = anyio.create_memory_object_stream[Sandbox](max_buffer_size=math.inf)
        self._wanted = anyio.Event()
        self._start_slots = anyio.Semaphore(concurrency)
        self._lent: set[Sandbox] = set()
        self._confirming: set[Sandbox] = set()  # released, waiting for the agent's "clean"
        # Idle containers still counted in ``_owned``. One that dies while idle is forgotten at
        # once by its watcher (and replaced); ``acquire`` then skips it when it comes out of the queue.
        self._idle_set: set[Sandbox] = set()
        self._unremoved: list[Sandbox] = []  # destroyed while the engine was unreachable
        self._tg: TaskGroup | None = None
        self._closed = False
        self._start_after = start_after  # e.g. the session spares wait for the first stateless container
        self.ready = anyio.Event()  # set when the first container is warm
        self._changed = anyio.Event()  # set (and renewed) whenever a container comes, goes or changes hands

    async def __aenter__(self) -> WarmPool:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._refill_loop)
        if self.size:
            log.info(
                "pool %s: warming up %d containers (libraries preloaded; about a second each)", self.name, self.size
            )
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        assert self._tg is not None
        # Its tasks' scope shielded before it is cancelled: a pool closed because its service was
        # cancelled (the local service's SIGTERM) would otherwise be cancelled again while it waits
        # for its tasks, and never destroy its containers nor their volumes. Its own cancellation
        # still ends the tasks, so the wait stays bounded.
        self._tg.cancel_scope.shield = True
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            doomed: list[Sandbox] = [*self._lent, *self._confirming, *self._unremoved]
            self._unremoved.clear()
            while True:
                try:
                    sandbox = self._idle_recv.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
                if sandbox in self._idle_set:  # the others were destroyed when they died
                    doomed.append(sandbox)
            self._idle_set.clear()
            async with anyio.create_task_group() as tg:
                for sandbox in doomed:
                    tg.start_soon(self._destroy, sandbox)
            self._lent.clear()
            self._confirming.clear()

    def _touch(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, condition: Callable[[WarmPool], bool], timeout_s: float) -> None:
        """Wait until ``condition(pool)`` holds (checked whenever the pool changes); TimeoutError past the bound."""
        with anyio.fail_after(timeout_s):
            while not condition(self):
                await self._changed.wait()

    @property
    def idle(self) -> int:
        return len(self._idle_set)

    @property
    def owned(self) -> int:
        return self._owned

    @property
    def busy(self) -> int:
        """Lent out, or back and being confirmed clean."""
        return len(self._lent) + len(self._confirming)

    def container_ids(self) -> set[str]:
        """Ids of the containers the pool holds now, idle or lent (for leak checks)."""
        return {sandbox.container_id for sandbox in self._idle_set | self._lent | self._confirming}

    @traced("mcpx.container.acquire")
    async def acquire(self, timeout_s: float | None = None) -> Sandbox:
        """An idle, healthy container, lent to the caller until ``release``."""
        if self._closed:
            raise PoolClosed("the server is shutting down")
        wait = self.acquire_timeout_s if timeout_s is None else timeout_s
        began, warm = time.monotonic(), self.idle > 0
        with anyio.move_on_after(wait):
            with anyio.move_on_after(self.grow_after_s):
                sandbox = await self._take_idle()
                metrics.admitted(self.name, "warm" if warm else "waited", time.monotonic() - began)
                return sandbox
            grew = self._grow()
            sandbox = await self._take_idle()
            metrics.admitted(self.name, "cold" if grew else "waited", time.monotonic() - began)
            return sandbox
        metrics.rejected("pool_busy")
        if self.last_error is not None and self.idle == 0:
            raise PoolBusy(f"no sandbox is available: starting one failed ({self.last_error}); retry shortly")
        raise PoolBusy(f"all {self.size} sandboxes stayed busy for {wait:.0f} s; retry shortly")

    async def _take_idle(self) -> Sandbox:
        while True:
            sandbox = await self._idle_recv.receive()
            if sandbox not in self._idle_set:
                continue  # its watcher saw it die and has already replaced it
            self._idle_set.discard(sandbox)
            if sandbox.alive:
                self._lent.add(sandbox)
                self._touch()
                return sandbox
            self._forget(sandbox, "crashed")  # died while idle: the health check is the channel itself

    def _grow(self) -> bool:
        """Start one more container for a caller who waited, if none is starting; whether it did."""
        starting = self._owned - len(self._idle_set) - len(self._lent) - len(self._confirming)
        if starting <= 0 and self._target < self.max_size:  # every container is busy, none about to be free
            self._target += 1
            self._wanted.set()
            log.info("pool %s: a caller waited %.1f s; growing to %d", self.name, self.grow_after_s, self._target)
            return True
        return starting > 0  # one already starting serves this caller, cold

    def _surplus(self) -> bool:
        """An extra container is back and the warm ones suffice: retire it."""
        if self._target > self.size and len(self._idle_set) >= self.size:
            self._target -= 1
            return True
        return False

    def release(self, sandbox: Sandbox) -> None:
        """Give a lent container back; it is reused once it confirms it is clean, else replaced."""
        self._lent.discard(sandbox)
        worn = self.max_runs is not None and sandbox.runs_served >= self.max_runs
        if self._closed or not sandbox.alive or worn or self._tg is None or self._surplus():
            closing = self._closed or self._tg is None
            self._forget(sandbox, None if closing else sandbox.ended_by or ("recycled" if worn else "surplus"))
            return
        self._confirming.add(sandbox)
        self._tg.start_soon(self._reuse_when_clean, sandbox)

    async def _reuse_when_clean(self, sandbox: Sandbox) -> None:
        clean = await sandbox.confirm_clean()  # cancelled: it stays in _confirming, for aclose to destroy
        self._confirming.discard(sandbox)
        if not clean:
            self._forget(sandbox, None if self._closed else "broken")
        elif not self._closed and not self._surplus() and not self._moves(sandbox):
            self._put_idle(sandbox)
        else:
            self._forget(sandbox, None if self._closed else "moved" if self._moves(sandbox) else "surplus")

    def _moves(self, sandbox: Sandbox) -> bool:
        return self._misplaced is not None and self._misplaced(sandbox)

    def retire_misplaced(self) -> None:
        """Replace the idle containers that would be better placed elsewhere (an engine came back)."""
        if self._closed or self._tg is None:
            return
        for sandbox in list(self._idle_set):
            if self._moves(sandbox):
                self._idle_set.discard(sandbox)  # ``acquire`` skips it when it comes out of the queue
                log.info("pool %s: container %s moves to another engine", self.name, sandbox.container_id[:12])
                self._forget(sandbox, "moved")

    async def take(self, timeout_s: float | None = None) -> Sandbox:
        """A container that leaves the pool for good; a replacement starts in the background."""
        sandbox = await self.acquire(timeout_s)
        self._lent.discard(sandbox)
        self._owned -= 1
        self._target = max(self.size, self._target - (self._target > self.size))
        self._wanted.set()
        return sandbox

    def _put_idle(self, sandbox: Sandbox) -> None:
        self._idle_set.add(sandbox)
        self._idle_send.send_nowait(sandbox)
        self.ready.set()
        self._touch()

    async def _watch(self, sandbox: Sandbox) -> None:
        """Health check of a warm container: its channel closes when the container dies."""
        await sandbox.channel.closed.wait()
        if sandbox in self._idle_set:
            self._idle_set.discard(sandbox)
            self.died_idle += 1
            log.warning("pool %s: idle container %s died; replacing it", self.name, sandbox.container_id[:12])
            self._forget(sandbox, "crashed")

    def _forget(self, sandbox: Sandbox, reason: str | None) -> None:
        """Destroy a container the pool owned; ``reason`` why it is replaced (None: the pool closes)."""
        if reason is not None:
            metrics.container_replaced(self.name, reason)
        self._owned -= 1
        self._wanted.set()
        self._touch()
        if self._tg is not None:
            self._tg.start_soon(self._destroy, sandbox)

    async def _destroy(self, sandbox: Sandbox) -> None:
        # Anything still in the pool owns its volume. What the engine could not remove (it was
        # gone) is retried once a start succeeds again, and at close.
        if not await sandbox.destroy(with_volume=True):
            self._unremoved.append(sandbox)

    async def _refill_loop(self) -> None:
        if self._start_after is not None:
            await self._start_after.wait()
        backoff = 0.5
        began = time.monotonic()
        announced = self.size == 0
        while True:
            missing = self._target - self._owned
            if missing <= 0:
                self._wanted = anyio.Event()
                if self._target - self._owned <= 0:
                    await self._wanted.wait()
                continue
            results: list[SandboxError | None] = []  # each start's failure (None: it started)
            async with anyio.create_task_group() as tg:
                for _ in range(missing):
                    self._owned += 1
                    tg.start_soon(self._start_one, results)
            failed = next((error for error in results if error is not None), None)
            if failed is None:
                backoff = 0.5
                if not announced and self._owned >= self.size:
                    announced = True
                    log.info(
                        "pool %s: %d warm containers ready in %.1f s", self.name, self.size, time.monotonic() - began
                    )
            else:
                log.warning(  # this batch's own reason: a start that succeeded beside it cleared last_error
                    "pool %s: container start failed (%s); retrying in %.1f s", self.name, failed, backoff
                )
                self.recent_backoffs.append(backoff)
                await self._sleep(backoff)  # backoff between failed starts, not synchronisation
                backoff = min(backoff * 2, self.max_backoff_s)

    async def _start_one(self, results: list[SandboxError | None]) -> None:
        async with self._start_slots:
            began = time.monotonic()
            try:
                sandbox = await self._starter()
            except Exception as exc:  # noqa: BLE001 - a failed start must never take the pool down
                metrics.container_started(self.name, False, time.monotonic() - began)
                self._owned -= 1
                self.failures += 1
                self.last_error = exc if isinstance(exc, SandboxError) else SandboxError(f"{type(exc).__name__}: {exc}")
                results.append(self.last_error)
                return
        metrics.container_started(self.name, True, time.monotonic() - began)
        self.starts += 1
        self.last_error = None
        if self._unremoved and self._tg is not None:  # the engine answers again: finish removals
            retry, self._unremoved = self._unremoved, []
            for old in retry:
                self._tg.start_soon(self._destroy, old)
        results.append(None)
        if self._closed:
            await self._destroy(sandbox)
            return
        assert self._tg is not None
        if self._surplus():  # started for callers who have since been served: not needed now
            self._owned -= 1
            self._touch()
            await self._destroy(sandbox)
            return
        self._tg.start_soon(self._watch, sandbox)
        self._put_idle(sandbox)
