"""Whatever bytes a container sends, only its own channel ends: nothing reaches the task group."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest

from mcp_code_exec.errors import ProtocolViolation, SandboxLost
from mcp_code_exec.protocol import frames
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.runtime.memory import MemoryByteStream, byte_pipe
from mcp_code_exec.sandbox.channel import AgentChannel

pytestmark = pytest.mark.anyio
READY = {"ev": "ready", "agent_version": 2, "python": "3.11"}


def frame(header: bytes | dict[str, object], payload: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
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
    "kind not first": frame(b'{"id":1,"ev":"pong","oom_kills":0}'),
    "a second id": frame(b'{"ev":"pong","id":1,"oom_kills":0,"id":7}'),
    "a second kind": frame(b'{"ev":"pong","id":1,"oom_kills":0,"ev":"clean"}'),
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


def listing(request_id: int, entries: int) -> bytes:
    entry = {"path": "p" * 1000, "size": 0, "is_dir": False, "is_symlink": False, "modified": 0.0}
    return frame({"ev": "listing", "id": request_id, "entries": [entry] * entries, "truncated": False})


@pytest.mark.parametrize(("kind", "size"), [("output", 2 * frames.SMALL_HEADER + 1), ("pong", frames.SMALL_HEADER + 1)])
def test_a_header_over_its_kinds_cap_is_refused_from_its_first_bytes(kind: str, size: int) -> None:
    start = b'{"ev":"%s","id":1,"text":"' % kind.encode()
    decoder = frames.event_decoder()
    with pytest.raises(ProtocolViolation, match=f"'{kind}' frame's header is over its size limit"):
        list(decoder.feed(frames.PREFIX.pack(size, 0) + start + b"x" * 64))  # the rest never sent


async def test_a_request_gets_one_answer_larger_than_a_worker_frame() -> None:
    big = listing(1, 2000)
    assert len(big) > frames.WORKER_SIZED

    async def agent(container: MemoryByteStream) -> None:
        await container.send(big)
        await container.send(big)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            channel, _ = await start(tg, agent)
            route = await channel.start(wire.ListFiles(path="/mnt/data", limit=2000))
            event, _ = await route.receive()
            assert isinstance(event, wire.Listing) and len(event.entries) == 2000
            with pytest.raises(SandboxLost, match="'listing' frame's header is over its size limit"):
                await route.receive()


async def test_an_event_for_no_request_is_skipped_unread_whatever_it_holds() -> None:
    not_json = b'{"ev":"done","id":5,' + b"[" * (frames.MAX_EVENT_HEADER - 100)

    async def agent(container: MemoryByteStream) -> None:
        await container.send(frame(not_json, b"x" * 1000))
        await container.send(listing(6, 2000))  # over a worker frame's size, for a request never made
        await container.send(frame({"ev": "pong", "id": 1, "oom_kills": 0}))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            channel, _ = await start(tg, agent)
            event, _ = await channel.request(wire.Ping())
            assert isinstance(event, wire.Pong) and channel.alive
            tg.cancel_scope.cancel()


def test_frames_are_decoded_one_at_a_time_as_the_reader_takes_them() -> None:
    taken = frames.event_decoder().feed(frame({"ev": "pong", "id": 1, "oom_kills": 0}) + frame(b"[" * 1000))
    header, _ = next(taken)  # the second frame's header is not looked at yet: the reader may yield first
    assert header["ev"] == "pong"
    with pytest.raises(ProtocolViolation, match="does not begin with its kind"):
        next(taken)


def output_frame(extra: bytes = b"", text: str = "x") -> bytes:
    body = json.dumps({"ev": "output", "id": 1, "stream": "stdout", "text": text}, separators=(",", ":"))
    return frame(body.encode()[:-1] + extra + b"}")


def test_an_output_with_more_than_a_little_outside_its_strings_is_refused_before_it_is_parsed() -> None:
    numbers = b',"n":[' + b",".join([b"1"] * 600) + b"]"  # over STRUCTURE_CHECKED_ABOVE
    with pytest.raises(ProtocolViolation, match="more than 256 bytes outside its strings, or 16 strings"):
        list(frames.event_decoder().feed(output_frame(numbers)))
    short_strings = b',"n":[' + b",".join([b'"a"'] * 10_000) + b"]"
    with pytest.raises(ProtocolViolation, match="more than 256 bytes outside its strings, or 16 strings"):
        list(frames.event_decoder().feed(output_frame(short_strings)))


def test_an_output_whose_text_is_all_brackets_quotes_and_escapes_is_read_as_text() -> None:
    text = "[{" * 20_000 + '"\\' * 5_000 + "\x01é"
    ((header, _),) = frames.event_decoder().feed(output_frame(text=text))
    assert header["text"] == text
