"""Host side of the agent protocol, over a container's attached stdin/stdout stream.

The engine multiplexes the container's stdout and stderr on one stream with 8-byte headers
(type, 0, 0, 0, big-endian length). The agent's stdout carries frames (see the agent's
``protocol`` module); its stderr is only ever diagnostics and goes to our log.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.abc import ByteStream, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .errors import SandboxLost

log = logging.getLogger(__name__)

MUX = struct.Struct(">BxxxI")
PREFIX = struct.Struct(">II")
MAX_HEADER = 64 * 1024 * 1024
MAX_PAYLOAD = 256 * 1024 * 1024

Frame = tuple[dict[str, Any], bytes]


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return PREFIX.pack(len(raw), len(payload)) + raw + payload


class FrameDecoder:
    """Turns the engine's multiplexed byte stream into agent frames and stderr text."""

    def __init__(self) -> None:
        self.mux = bytearray()
        self.stdout = bytearray()

    def feed(self, data: bytes) -> tuple[list[Frame], bytes]:
        self.mux += data
        stderr = bytearray()
        while len(self.mux) >= MUX.size:
            kind, length = MUX.unpack_from(self.mux)
            if len(self.mux) < MUX.size + length:
                break
            chunk = self.mux[MUX.size : MUX.size + length]
            del self.mux[: MUX.size + length]
            if kind == 1:
                self.stdout += chunk
            else:
                stderr += chunk
        return self._frames(), bytes(stderr)

    def _frames(self) -> list[Frame]:
        frames: list[Frame] = []
        while len(self.stdout) >= PREFIX.size:
            header_len, payload_len = PREFIX.unpack_from(self.stdout)
            if header_len > MAX_HEADER or payload_len > MAX_PAYLOAD:
                raise SandboxLost("the sandbox sent a malformed frame")
            end = PREFIX.size + header_len + payload_len
            if len(self.stdout) < end:
                break
            header = json.loads(bytes(self.stdout[PREFIX.size : PREFIX.size + header_len]))
            payload = bytes(self.stdout[PREFIX.size + header_len : end])
            del self.stdout[:end]
            frames.append((header, payload))
        return frames


class AgentChannel:
    """Request/response and event routing to one container's agent.

    ``run`` is the reader loop; start it in a task group with ``tg.start(channel.run)``, which
    returns once the agent said it is ready.
    """

    def __init__(self, stream: ByteStream, name: str) -> None:
        self.stream = stream
        self.name = name
        self.ready_info: dict[str, Any] = {}
        self.closed = anyio.Event()
        self.close_reason = "the sandbox container stopped"
        self._send_lock = anyio.Lock()
        self._next_id = 0
        self._routes: dict[int, MemoryObjectSendStream[Frame]] = {}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        decoder = FrameDecoder()
        started = False
        try:
            while True:
                try:
                    data = await self.stream.receive(1 << 20)
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    break
                try:
                    frames, stderr = decoder.feed(data)
                except (SandboxLost, ValueError):
                    self.close_reason = "the sandbox sent malformed data"
                    break
                if stderr:
                    log.debug("agent %s stderr: %s", self.name, stderr[:2000].decode("utf-8", "replace").rstrip())
                for header, payload in frames:
                    if header.get("ev") == "ready" and not started:
                        self.ready_info = header
                        started = True
                        task_status.started()
                        continue
                    route = self._routes.get(header.get("id", -1))
                    if route is not None:
                        route.send_nowait((header, payload))
        finally:
            self.closed.set()
            for route in list(self._routes.values()):
                route.close()
            with anyio.CancelScope(shield=True):
                await self.stream.aclose()
            if not started:
                raise SandboxLost(f"the sandbox container exited before it was ready ({self.close_reason})")

    @property
    def alive(self) -> bool:
        return not self.closed.is_set()

    async def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        if self.closed.is_set():
            raise SandboxLost(self.close_reason)
        async with self._send_lock:
            try:
                await self.stream.send(encode(header, payload))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                raise SandboxLost(self.close_reason) from exc

    @asynccontextmanager
    async def exchange(
        self, op: str, payload: bytes = b"", **fields: Any
    ) -> AsyncIterator[tuple[int, MemoryObjectReceiveStream[Frame]]]:
        """Send a request; yield its id and the stream of frames the agent sends back for it."""
        self._next_id += 1
        request_id = self._next_id
        send, receive = anyio.create_memory_object_stream[Frame](max_buffer_size=math.inf)
        self._routes[request_id] = send
        try:
            await self.send({"op": op, "id": request_id, **fields}, payload)
            yield request_id, receive
        finally:
            self._routes.pop(request_id, None)
            send.close()
            receive.close()

    async def request(self, op: str, payload: bytes = b"", **fields: Any) -> Frame:
        """A request with exactly one reply; an agent-side refusal comes back as ``ev: error``."""
        async with self.exchange(op, payload, **fields) as (_, replies):
            try:
                return await replies.receive()
            except anyio.EndOfStream:
                raise SandboxLost(self.close_reason) from None

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()
