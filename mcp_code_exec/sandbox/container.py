"""One running container and its agent: start it, run code in it, touch its files, remove it.

The agent's events are checked twice: their shapes by the protocol's models, and against the
run's own caps (``run_events``: how many images and displays, how big, whether an image is one).
An agent that breaks them is broken, whatever the reason, and is replaced (``ProtocolViolation``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import anyio
from anyio.abc import TaskGroup

from ..egress.tokens import new_container_key
from ..errors import FileOperationError, QuotaExceeded, SandboxError, SandboxLost, TooLarge
from ..observability.tracing import traced
from ..protocol import messages as wire
from ..runtime.base import ContainerEngine, ContainerSpec
from .channel import AgentChannel, Route
from .run_events import OutputSink, RawRun, collect
from .spec import Kind
from .tool_calls import RunClock, ToolCalls, ToolHandler

log = logging.getLogger(__name__)
HOST_GRACE_S = 15.0  # beyond the agent's own deadline, before we give up on the container
CANCEL_GRACE_S = 3.0
CLEAN_WAIT_S = 10.0  # how long a stateless container may take to confirm it is clean
REQUEST_TIMEOUT_S = 60.0


@dataclass(eq=False)
class Sandbox:
    engine: ContainerEngine
    container_id: str
    channel: AgentChannel
    kind: Kind
    volume: str | None = None
    runs_served: int = 0
    broken: bool = False  # never to serve again (``mark_broken``); destroyed, or replaced by its pool
    ended_by: str = ""  # why it was broken, for the metrics: crashed, broken, memory, recycled
    started_at: float = field(default_factory=time.monotonic)
    egress_key: str = field(default_factory=new_container_key, repr=False)  # egress grants work from it alone
    _awaiting_clean: Route | None = None

    @property
    def alive(self) -> bool:
        return self.channel.alive and not self.broken

    def mark_broken(self, reason: Literal["crashed", "broken", "memory", "recycled"]) -> None:
        """It must not serve again: whoever holds it destroys it (its pool replaces it). ``reason``
        names why in the metrics (the last one said)."""
        self.broken, self.ended_by = True, reason

    @traced("mcpx.sandbox.run")
    async def execute(
        self,
        code: str,
        *,
        timeout_s: float,
        options: wire.RunOptions,
        raw: RawRun,
        output: OutputSink | None = None,
        tools: ToolHandler | None = None,
    ) -> None:
        """Run a cell, its output streamed into ``output`` as it comes (without: in the result only).
        ``raw``, the caller's, collects the agent's account as it arrives: a caller whose run was
        cancelled (after the interrupt reached the agent) still reads what it got there. ``tools``
        answers the cell's tool calls (code mode); without it, a call is a protocol violation."""
        self.runs_served += 1
        request = wire.Exec(mode=self.kind, timeout=timeout_s, stream=output is not None, options=options)
        try:
            route = await self.channel.start(request, code.encode("utf-8", "surrogatepass"))
            try:
                await self._run(route, raw, options, timeout_s, output, tools)
            except BaseException:
                route.close()
                raise
        except SandboxLost:
            self.mark_broken("crashed")
            raise
        except (anyio.get_cancelled_exc_class(), KeyboardInterrupt):
            raise
        except Exception as exc:
            self.mark_broken("broken")
            log.warning("sandbox %s: handling a run failed", self.container_id[:12], exc_info=True)
            raise SandboxLost(f"the sandbox's answer could not be handled ({type(exc).__name__})") from exc
        if self.kind == "stateless" and not raw.recycle:
            self._awaiting_clean = route  # the pool reuses the container once it confirms it is clean
        else:
            route.close()
        if raw.recycle and self.kind == "stateless":
            self.mark_broken("memory" if raw.result.status == "memory_limit" else "recycled")

    async def _run(
        self,
        route: Route,
        raw: RawRun,
        options: wire.RunOptions,
        timeout_s: float,
        output: OutputSink | None,
        tools: ToolHandler | None,
    ) -> None:
        try:
            with anyio.fail_after(timeout_s + HOST_GRACE_S) as scope:
                if tools is None:  # code mode is off for this run: a call frame is refused at once
                    await collect(route, raw, options, output, refuse_on=self.channel)
                    return
                broken: list[SandboxError] = []  # raised as it is, not in the task group's exception group
                async with anyio.create_task_group() as calls_group:
                    calls = ToolCalls(tools, self.channel, calls_group, RunClock(self.channel, route.id, scope))
                    try:
                        await collect(route, raw, options, output, calls)
                    except SandboxError as exc:
                        broken.append(exc)
                    calls_group.cancel_scope.cancel()  # the cell is done, or broke the protocol: its calls are dropped
                if broken:
                    raise broken[0]
        except TimeoutError:
            self.mark_broken("broken")
            raise SandboxLost("the sandbox stopped answering; it was replaced") from None
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._interrupt(route, raw, options)
            raise

    async def _interrupt(self, route: Route, raw: RawRun, options: wire.RunOptions) -> None:
        """The caller went away: stop the run inside, and wait (briefly) for the agent to settle."""
        try:
            await self.channel.send(wire.Interrupt(id=route.id).frame())
            with anyio.fail_after(CANCEL_GRACE_S):
                await collect(route, raw, options, None)
        except (TimeoutError, SandboxError):
            self.mark_broken("broken")

    async def confirm_clean(self, timeout_s: float = CLEAN_WAIT_S) -> bool:
        """After a stateless run: True once the agent reports every process gone and all wiped."""
        route, self._awaiting_clean = self._awaiting_clean, None
        if route is None:
            return self.alive
        try:
            with anyio.fail_after(timeout_s):
                event, _ = await route.receive()
        except (TimeoutError, SandboxError):
            event = None
        finally:
            route.close()
        if not isinstance(event, wire.Clean) or not event.ok:
            self.mark_broken("broken")
            detail = "; ".join(event.problems) if isinstance(event, wire.Clean) else "no confirmation"
            log.warning("sandbox %s is not reused: %s", self.container_id[:12], detail)
        return self.alive

    async def request(self, request: wire.Request, payload: bytes = b"") -> tuple[wire.Event, bytes]:
        """A request with exactly one answer (the agent's refusal raised as ``FileOperationError``)."""
        route = await self.send_request(request, payload)
        try:
            return await self.answer(route)
        finally:
            route.close()

    @contextmanager
    def _answering(self) -> Iterator[None]:
        """Bounded in time; a sandbox that stops answering, or is lost, is broken (it is replaced)."""
        try:
            with anyio.fail_after(REQUEST_TIMEOUT_S):
                yield
        except TimeoutError:
            self.mark_broken("broken")
            raise SandboxLost("the sandbox stopped answering; it was replaced") from None
        except SandboxLost:
            self.mark_broken("crashed")
            raise

    async def send_request(self, request: wire.Request, payload: bytes = b"") -> Route:
        """Send a request; its answer comes with ``answer(route)`` (several may be in flight)."""
        with self._answering():
            return await self.channel.start(request, payload)

    async def answer(self, route: Route) -> tuple[wire.Event, bytes]:
        with self._answering():
            event, data = await route.receive()
        if isinstance(event, wire.Failure):
            refusal = {"quota": QuotaExceeded, "too_large": TooLarge}.get(event.kind or "", FileOperationError)
            raise refusal(event.message)
        return event, data

    async def ping(self, timeout_s: float = 5.0) -> bool:
        try:
            with anyio.fail_after(timeout_s):
                event, _ = await self.channel.request(wire.Ping())
            return isinstance(event, wire.Pong)
        except (TimeoutError, SandboxError):
            self.mark_broken("broken")
            return False

    async def destroy(self, *, with_volume: bool = False) -> bool:
        """Remove the container (and, for a pool's spare, the volume it was made with).

        False when something could not be removed (the engine is gone): the caller may retry.
        """
        self.broken = True
        if self._awaiting_clean is not None:
            self._awaiting_clean.close()
            self._awaiting_clean = None
        removed = True
        with anyio.CancelScope(shield=True):
            await self.channel.aclose()
            try:
                with anyio.fail_after(30):
                    await self.engine.remove(self.container_id)
            except (TimeoutError, SandboxError) as exc:
                log.warning("could not remove container %s: %s", self.container_id[:12], exc)
                removed = False
            if with_volume and self.volume is not None:
                try:
                    with anyio.fail_after(30):
                        await self.engine.remove_volume(self.volume)
                except (TimeoutError, SandboxError) as exc:
                    log.warning("could not remove volume %s: %s", self.volume, exc)
                    removed = False
        return removed


async def start_sandbox(
    engine: ContainerEngine,
    spec: ContainerSpec,
    task_group: TaskGroup,
    *,
    kind: Kind,
    timeout_s: float,
) -> Sandbox:
    """Start a container and wait until its agent is ready (libraries imported)."""
    container_id, stream = await engine.start(spec)
    channel = AgentChannel(stream, container_id[:12])
    try:
        with anyio.fail_after(timeout_s):
            await task_group.start(channel.run)
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await channel.aclose()
            await engine.remove(container_id)
        if isinstance(exc, TimeoutError):
            raise SandboxLost(f"the sandbox did not become ready within {timeout_s:.0f} s") from None
        raise
    return Sandbox(engine=engine, container_id=container_id, channel=channel, kind=kind, volume=spec.volume)
