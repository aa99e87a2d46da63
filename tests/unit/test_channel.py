"""Whatever bytes a container sends, only its own channel ends: nothing reaches the task group."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest

from mcp_code_exec.errors import SandboxLost
from mcp_code_exec.protocol import frames
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.runtime.memory import MemoryByteStream, byte_pipe
from mcp_code_exec.sandbox.channel import AgentChannel

pytestmark = pytest.mark.anyio
READY = {"ev": "ready", "agent_version": 2, "python": "3.11"}


def frame(header: bytes | dict[str, object], payload: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return frames.PREFIX.pack(len(raw), len(payload)) + raw + payload


HOSTILE: dict[str, bytes] = {
    "deep arrays": frame(b"[" * 200_000 + b"]" * 200_000),
    "deep objects": frame(b'{"ev":"done","id":1,"error":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_001),
    "huge header": struct.pack(">II", 2**31, 0),
    "huge payload": struct.pack(">II", 2, 2**31) + b"{}",
    "not json": frame(b"\xff\xfe garbage"),
    "not an object": frame(b"[1, 2]"),
    "unknown event": frame({"ev": "shell", "id": 1}),
    "bad type": frame({"ev": "clean", "id": 1, "ok": "yes", "problems": []}),
    "extra field": frame({"ev": "pong", "id": 1, "oom_kills": 0, "pwned": True}),
    "bool as id": frame({"ev": "pong", "id": True, "oom_kills": 0}),
}


async def start(
    tg: anyio.abc.TaskGroup, script: Callable[[MemoryByteStream], Coroutine[Any, Any, None]]
) -> tuple[AgentChannel, MemoryByteStream]:
    host, container = byte_pipe()
    channel = AgentChannel(host, "test")
    await container.send(frame(READY))
    await tg.start(channel.run)
    tg.start_soon(script, container)
    return channel, container


@pytest.mark.parametrize("name", list(HOSTILE))
async def test_hostile_bytes_close_only_that_channel(name: str) -> None:
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:  # would raise if anything escaped the channel

            async def hostile(container: MemoryByteStream) -> None:
                await container.send(HOSTILE[name])

            channel, _ = await start(tg, hostile)
            route = await channel.start(wire.Ping())
            with pytest.raises(SandboxLost, match=r"malformed|could not be handled|stopped"):
                await route.receive()
            await channel.closed.wait()
    assert not channel.alive
    assert "replaced" in channel.close_reason


async def test_a_container_that_speaks_before_it_is_ready_never_starts() -> None:
    host, container = byte_pipe()
    channel = AgentChannel(host, "test")
    await container.send(frame({"ev": "pong", "id": 1, "oom_kills": 0}))
    refused: list[BaseException] = []
    with anyio.fail_after(5):
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(channel.run)
        except* SandboxLost as group:
            refused += group.exceptions
    assert len(refused) == 1 and "before it was ready" in str(refused[0])


async def test_events_are_routed_to_their_request_and_strays_are_dropped() -> None:
    async def agent(container: MemoryByteStream) -> None:
        await container.send(frame({"ev": "pong", "id": 999, "oom_kills": 0}))  # nobody asked
        await container.send(frame({"ev": "pong", "id": 1, "oom_kills": 3}))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            channel, _ = await start(tg, agent)
            event, _ = await channel.request(wire.Ping())
            assert isinstance(event, wire.Pong) and event.oom_kills == 3
            tg.cancel_scope.cancel()


async def test_a_slow_consumer_slows_the_container_instead_of_growing_memory() -> None:
    sent = 0

    async def chatty(container: MemoryByteStream) -> None:
        nonlocal sent
        for _ in range(1000):
            await container.send(frame({"ev": "output", "id": 1, "stream": "stdout", "text": "x" * 100}))
            sent += 1

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            channel, _ = await start(tg, chatty)
            route = await channel.start(wire.Interrupt())  # id 1: the one the output is for
            await anyio.wait_all_tasks_blocked()
            assert route._receive.statistics().current_buffer_used <= 64
            for _ in range(10):
                await route.receive()
            tg.cancel_scope.cancel()
