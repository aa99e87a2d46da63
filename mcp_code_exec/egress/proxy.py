"""The egress proxy's life: started, fed, health-checked and restarted by the server.

The attach stream is the proxy's lifeline, as it is a sandbox's: its stdin carries the bootstrap
line and then the control channel (JSON lines), its stdout the replies and access records. When
the server goes, stdin closes and the proxy exits (its container removes itself). A ping every
``health_s`` must be answered within ``ping_timeout_s``; a proxy that does not answer, or whose
stream ends, is removed and started again with backoff, and is given again everything it must know
(``resend``: the configuration, the day's counters, narrowings, ended grants). Sandboxes need
nothing then: their relay connects to the same socket path at each new connection.

Messages a run sends (a session's new run, a run's end) are put on a queue and written by a task
of this object, so the run never waits for the proxy; while the proxy is down they are dropped
(what must survive a restart is in ``resend``).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import ByteStream, TaskStatus

from ..errors import EgressError, ProxyGone, SandboxError
from ..runtime.base import ProxyEngine, ProxySpec

log = logging.getLogger(__name__)
LINE_MAX = 1 << 20  # a reply or record; the CA's bootstrap answer is a few KiB
QUEUE_MAX = 10_000
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # a life this long resets the backoff

Message = dict[str, Any]


class EgressProxy:
    def __init__(
        self,
        engine: ProxyEngine,
        spec: ProxySpec,
        *,
        boot: Callable[[], Message],
        resend: Callable[[], list[Message]],
        on_event: Callable[[Message], None],
        health_s: float = 10.0,
        ping_timeout_s: float = 5.0,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.engine = engine
        self.spec = spec
        self.boot = boot
        self.resend = resend
        self.on_event = on_event
        self.health_s = health_s
        self.ping_timeout_s = ping_timeout_s
        self.start_timeout_s = start_timeout_s
        self.ready = anyio.Event()  # set while a proxy answers (a new one at each restart)
        self.container_id: str | None = None
        self.starts = 0
        self.last_error: str | None = None
        self._stream: ByteStream | None = None
        self._queue_in, self._queue_out = anyio.create_memory_object_stream[bytes](QUEUE_MAX)
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[anyio.Event, list[Message]]] = {}
        self._booted = anyio.Event()

    # -- what the service calls --------------------------------------------------------------------
    def send(self, message: Message) -> None:
        """Fire and forget (never waits): dropped while the proxy is down or the queue is full."""
        if not self.ready.is_set():
            return
        try:
            self._queue_in.send_nowait(encode(message))
        except anyio.WouldBlock:
            log.warning("egress: the proxy's queue is full; a %s message was dropped", message.get("op"))

    async def ask(self, message: Message, timeout_s: float = 10.0) -> Message:
        """Send and wait for the proxy's answer (ack, nack or pong); ``ProxyGone`` without one."""
        if self._stream is None or not self.ready.is_set():
            raise ProxyGone("the egress proxy is not running (it is being started again)")
        ident = next(self._ids)
        answered = anyio.Event()
        box: list[Message] = []
        self._waiting[ident] = (answered, box)
        try:
            await self._queue_in.send(encode({**message, "id": ident}))
            with anyio.fail_after(timeout_s):
                await answered.wait()
        except TimeoutError:
            raise ProxyGone(f"the egress proxy did not answer within {timeout_s:g} s") from None
        finally:
            self._waiting.pop(ident, None)
        if not box:
            raise ProxyGone("the egress proxy stopped before it answered")
        reply = box[0]
        if reply.get("ev") == "nack":
            raise EgressError(f"the egress proxy refused a {message.get('op')} message: {reply.get('error')}")
        return reply

    async def ping(self) -> float:
        started = time.perf_counter()
        await self.ask({"op": "ping"}, self.ping_timeout_s)
        return time.perf_counter() - started

    # -- its life ------------------------------------------------------------------------------------
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep a proxy running until cancelled (started at once; ``ready`` says when it answers)."""
        task_status.started()
        delay = 1.0
        while True:
            began = time.monotonic()
            try:
                await self._life()
            except* (SandboxError, OSError, TimeoutError, anyio.BrokenResourceError, anyio.EndOfStream) as stopped:
                first = stopped.exceptions[0]
                self.last_error = str(first) or type(first).__name__
            log.warning("egress: the proxy stopped (%s); starting it again in %.0f s", self.last_error, delay)
            if time.monotonic() - began > STABLE_S:
                delay = 1.0
            await anyio.sleep(delay)  # backoff between starts
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _life(self) -> None:
        self.starts += 1
        self._booted = anyio.Event()
        container_id, stream = await self.engine.start_proxy(self.spec)
        self.container_id, self._stream = container_id, stream
        try:
            await stream.send(encode(self.boot()))
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, stream)
                with anyio.fail_after(self.start_timeout_s):
                    await self._booted.wait()
                for message in self.resend():
                    await stream.send(encode(message))
                self.ready.set()
                log.info("egress: the proxy answers (start %d)", self.starts)
                tg.start_soon(self._write, stream)
                await self._watch()
        finally:
            self.ready = anyio.Event()
            self._stream = None
            for answered, _ in self._waiting.values():
                answered.set()  # with no answer: ``ask`` says the proxy is gone
            with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                await stream.aclose()
                await self.engine_remove(container_id)

    async def engine_remove(self, container_id: str) -> None:
        remove = getattr(self.engine, "remove", None)
        if remove is not None:
            try:
                await remove(container_id)
            except SandboxError as exc:
                log.warning("egress: could not remove the proxy's container: %s", exc)

    async def _watch(self) -> None:
        while True:
            await anyio.sleep(self.health_s)  # the health check's period
            await self.ping()

    async def _write(self, stream: ByteStream) -> None:
        async for line in self._queue_out:
            await stream.send(line)

    async def _read(self, stream: ByteStream) -> None:
        buffer = b""
        while True:
            try:
                chunk = await stream.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                raise ProxyGone("the egress proxy's stream ended") from None
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self._take(line)
            if len(buffer) > LINE_MAX:
                raise ProxyGone("the egress proxy sent a line too long")

    def _take(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        kind = event.get("ev")
        if kind == "ready":
            self._booted.set()
        elif kind in ("ack", "nack", "pong"):
            ident = event.get("id")
            waiting = self._waiting.get(ident) if isinstance(ident, int) else None
            if waiting is not None:
                waiting[1].append(event)
                waiting[0].set()
            elif kind == "nack":
                log.warning("egress: the proxy refused a message: %s", str(event.get("error"))[:300])
        else:
            self.on_event(event)

    async def aclose(self) -> None:
        self._queue_in.close()


def encode(message: Message) -> bytes:
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"


__all__ = ["EgressProxy", "Message"]
