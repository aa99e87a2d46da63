"""One running container and its agent: start it, run code in it, touch its files, remove it."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup

from .channel import AgentChannel
from .errors import FileOperationError, SandboxError, SandboxLost
from .models import ErrorInfo, ImageOutput
from .runtime.base import ContainerEngine, ContainerSpec

log = logging.getLogger(__name__)

OutputCallback = Callable[[str, str], Awaitable[None]]
HOST_GRACE_S = 15.0  # beyond the agent's own deadline, before we give up on the container
CANCEL_GRACE_S = 3.0


@dataclass
class RawRun:
    """The agent's account of a run, before the service turns it into a ``RunResult``."""

    status: str
    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    error: ErrorInfo | None = None
    displays: list[str] = field(default_factory=list)
    images: list[ImageOutput] = field(default_factory=list)
    files: list[dict[str, Any]] = field(default_factory=list)
    file_bytes: bytes = b""
    truncated: list[str] = field(default_factory=list)
    duration_ms: float = 0.0
    session_restarted: bool = False
    recycle: bool = False


@dataclass(eq=False)
class Sandbox:
    engine: ContainerEngine
    container_id: str
    channel: AgentChannel
    kind: Literal["stateless", "session"]
    volume: str | None = None
    runs: int = 0
    broken: bool = False
    started_at: float = field(default_factory=time.monotonic)

    @property
    def alive(self) -> bool:
        return self.channel.alive and not self.broken

    async def execute(
        self,
        code: str,
        *,
        mode: Literal["stateless", "session"],
        timeout_s: float,
        options: dict[str, Any],
        on_output: OutputCallback | None = None,
    ) -> RawRun:
        self.runs += 1
        raw = RawRun(status="crashed")
        fields: dict[str, Any] = {
            "code": code,
            "mode": mode,
            "timeout": timeout_s,
            "options": options,
            "stream": on_output is not None,
        }
        try:
            async with self.channel.exchange("exec", b"", **fields) as (request_id, events):
                try:
                    with anyio.fail_after(timeout_s + HOST_GRACE_S):
                        await self._collect(events, raw, on_output)
                except TimeoutError:
                    self.broken = True
                    raise SandboxLost("the sandbox stopped answering; it was replaced") from None
                except anyio.get_cancelled_exc_class():
                    with anyio.CancelScope(shield=True):
                        await self._interrupt(request_id, events, raw)
                    raise
        except SandboxLost:
            self.broken = True
            raise
        if raw.recycle:
            self.broken = self.kind == "stateless"
        return raw

    async def _collect(self, events: Any, raw: RawRun, on_output: OutputCallback | None) -> None:
        async for header, payload in events:
            event = header.get("ev")
            if event == "done":
                _fill(raw, header, payload)
                return
            if event == "output" and on_output is not None:
                await on_output(str(header.get("stream")), str(header.get("text", "")))
            elif event == "image":
                raw.images.append(
                    ImageOutput(
                        mime_type=str(header.get("mime", "image/png")),
                        data=payload,
                        width=int(header.get("width") or 0),
                        height=int(header.get("height") or 0),
                        note=header.get("note"),
                    )
                )
            elif event == "text":
                raw.displays.append(str(header.get("text", "")))
        raise SandboxLost(self.channel.close_reason)

    async def _interrupt(self, request_id: int, events: Any, raw: RawRun) -> None:
        """The caller went away: stop the run inside, and wait (briefly) for the agent to settle."""
        try:
            await self.channel.send({"op": "interrupt", "id": request_id})
            with anyio.fail_after(CANCEL_GRACE_S):
                await self._collect(events, raw, None)
        except (TimeoutError, SandboxError):
            self.broken = True

    async def request(self, op: str, payload: bytes = b"", **fields: Any) -> tuple[dict[str, Any], bytes]:
        with anyio.fail_after(60):
            header, data = await self.channel.request(op, payload, **fields)
        if header.get("ev") == "error":
            raise FileOperationError(str(header.get("message", "the sandbox refused the operation")))
        return header, data

    async def ping(self, timeout_s: float = 5.0) -> bool:
        try:
            with anyio.fail_after(timeout_s):
                await self.channel.request("ping")
            return True
        except (TimeoutError, SandboxError):
            self.broken = True
            return False

    async def destroy(self, *, with_volume: bool = False) -> bool:
        """Remove the container (and, for a pool's spare, the volume it was made with).

        False when something could not be removed (the engine is gone): the caller may retry.
        """
        self.broken = True
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


def _fill(raw: RawRun, header: dict[str, Any], payload: bytes) -> None:
    raw.status = str(header.get("status", "crashed"))
    raw.stdout = str(header.get("stdout", ""))
    raw.stderr = str(header.get("stderr", ""))
    raw.result = header.get("result")
    error = header.get("error")
    raw.error = ErrorInfo.model_validate(error) if isinstance(error, dict) else None
    raw.files = list(header.get("files") or [])
    raw.file_bytes = payload
    raw.truncated = list(header.get("truncated") or [])
    raw.duration_ms = float(header.get("duration_ms") or 0.0)
    raw.session_restarted = bool(header.get("session_restarted"))
    raw.recycle = bool(header.get("recycle"))


async def start_sandbox(
    engine: ContainerEngine,
    spec: ContainerSpec,
    task_group: TaskGroup,
    *,
    kind: Literal["stateless", "session"],
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
