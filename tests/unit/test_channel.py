"""Whatever bytes a container sends, only its own channel ends: nothing reaches the task group."""

from __future__ import annotations

import json
import random
import re
import struct
import typing
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest

from mcp_code_exec.errors import ProtocolViolation, SandboxLost
from mcp_code_exec.protocol import frames
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.runtime.memory import MemoryByteStream, byte_pipe
from mcp_code_exec.sandbox import channel as channel_module
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


async def test_an_event_for_a_request_no_longer_waited_on_is_dropped_and_the_next_is_routed() -> None:
    asked = anyio.Event()

    async def agent(container: MemoryByteStream) -> None:
        await asked.wait()
        await container.send(frame({"ev": "pong", "id": 1, "oom_kills": 0}))  # abandoned meanwhile
        await container.send(frame({"ev": "pong", "id": 2, "oom_kills": 3}))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            channel, _ = await start(tg, agent)
            (await channel.start(wire.Ping())).close()
            route = await channel.start(wire.Ping())
            asked.set()
            event, _ = await route.receive()
            assert isinstance(event, wire.Pong) and event.oom_kills == 3
            tg.cancel_scope.cancel()


def options() -> wire.RunOptions:
    return wire.RunOptions(
        max_output_bytes=1000, max_result_bytes=1000, max_display_bytes=1000, max_displays=10, max_images=10,
        max_image_bytes=1000, max_image_pixels=1000,
    )  # fmt: skip


def pong(request_id: int) -> bytes:
    return frame({"ev": "pong", "id": request_id, "oom_kills": 0})


FORGED_ANSWERS: dict[str, tuple[list[bytes], str]] = {
    "for a request never sent": ([pong(999)], "'pong' event for a request never sent"),
    "a second answer": ([pong(1), pong(1)], r"'pong' event where its request \(ping\) gets \[\]"),
    "of a kind its request does not get": (
        [frame({"ev": "snapshot", "id": 1, "complete": True})],
        r"'snapshot' event where its request \(ping\) gets \['error', 'pong'\]",
    ),
    "more than a few for finished requests": (
        [pong(1)] * (channel_module.STRAYS_AT_FIRST + channel_module.STRAYS_PER_CLOSED_REQUEST + 1),
        "more events for finished requests than a sandbox sends",
    ),
}


@pytest.mark.parametrize("name", list(FORGED_ANSWERS))
async def test_an_event_its_request_cannot_get_now_ends_the_channel_before_it_is_parsed(name: str) -> None:
    sent, reason = FORGED_ANSWERS[name]
    asked = anyio.Event()

    async def agent(container: MemoryByteStream) -> None:
        await asked.wait()
        for data in sent:
            await container.send(data)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            channel, _ = await start(tg, agent)
            route = await channel.start(wire.Ping())
            if name == "more than a few for finished requests":
                route.close()
                route = await channel.start(wire.Ping())
            asked.set()
            with pytest.raises(SandboxLost, match=reason):
                while True:
                    await route.receive()


async def test_a_chunk_over_the_length_its_read_asked_for_is_refused_before_it_is_buffered() -> None:
    async def agent(container: MemoryByteStream) -> None:
        header = {"ev": "chunk", "id": 1, "path": "f", "offset": 0, "size": 11, "modified": 0.0, "mtime_ns": 0}
        await container.send(frame(header, b"x" * 11))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            channel, _ = await start(tg, agent)
            route = await channel.start(wire.ReadChunk(path="f", offset=0, length=10))
            with pytest.raises(SandboxLost, match="'chunk' frame is over its size limit"):
                await route.receive()


async def test_a_run_gets_its_stream_then_its_done_then_only_its_clean() -> None:
    asked = anyio.Event()
    output = frame({"ev": "output", "id": 1, "stream": "stdout", "text": "x"})
    done = frame({"ev": "done", "id": 1, "status": "ok", "result": None, "error": None, "stdout": "", "stderr": "",
                  "truncated": [], "session_restarted": False, "duration_ms": 1.0, "notes": [], "recycle": False,
                  "files": [], "usage": None})  # fmt: skip

    async def agent(container: MemoryByteStream) -> None:
        await asked.wait()
        for data in (output, done, frame({"ev": "clean", "id": 1, "ok": True, "problems": []}), output):
            await container.send(data)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            channel, _ = await start(tg, agent)
            route = await channel.start(wire.Exec(mode="stateless", timeout=1, stream=True, options=options()))
            asked.set()
            kinds = [(await route.receive())[0].ev for _ in range(3)]
            assert kinds == ["output", "done", "clean"]
            with pytest.raises(SandboxLost, match=r"'output' event where its request \(exec\) gets \['error'\]"):
                await route.receive()


async def test_a_run_that_does_not_stream_its_output_gets_none_before_its_done() -> None:
    asked = anyio.Event()

    async def agent(container: MemoryByteStream) -> None:
        await asked.wait()
        image = {"ev": "image", "id": 1, "mime": "image/png", "width": 1, "height": 1, "note": None}
        await container.send(frame(image, b"png"))  # its stream, and still no output after it
        await container.send(frame(b'{"ev":"output","id":1,' + b"[" * 100_000))  # never parsed

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            channel, _ = await start(tg, agent)
            route = await channel.start(wire.Exec(mode="stateless", timeout=1, stream=False, options=options()))
            asked.set()
            assert (await route.receive())[0].ev == "image"
            with pytest.raises(SandboxLost, match=r"'output' event where its request \(exec\) gets \['display'"):
                await route.receive()


async def test_a_slow_consumer_slows_the_container_instead_of_growing_memory() -> None:
    sent = 0

    async def chatty(container: MemoryByteStream) -> None:
        nonlocal sent
        for _ in range(1000):
            await container.send(frame({"ev": "display", "id": 1, "text": "x" * 100}))  # not paced
            sent += 1

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            channel, _ = await start(tg, chatty)
            route = await channel.start(wire.Exec(mode="stateless", timeout=1, stream=True, options=options()))
            await anyio.wait_all_tasks_blocked()
            assert route._receive.statistics().current_buffer_used <= 64
            for _ in range(10):
                await route.receive()
            tg.cancel_scope.cancel()


def listing(request_id: int, entries: int) -> bytes:
    entry = {"path": "p" * 1000, "size": 0, "is_dir": False, "is_symlink": False, "modified": 0.0}
    return frame({"ev": "listing", "id": request_id, "entries": [entry] * entries, "truncated": False})


@pytest.mark.parametrize(("kind", "size"), [("output", frames.SMALL_HEADER + 1), ("pong", frames.SMALL_HEADER + 1)])
def test_a_header_over_its_kinds_cap_is_refused_from_its_first_bytes(kind: str, size: int) -> None:
    start = b'{"ev":"%s","id":1,"text":"' % kind.encode()
    decoder = frames.event_decoder()
    with pytest.raises(ProtocolViolation, match=f"'{kind}' frame's header is over its size limit"):
        list(decoder.feed(frames.PREFIX.pack(size, 0) + start + b"x" * 64))  # the rest never sent


async def test_an_event_for_a_request_no_longer_waited_on_is_skipped_unread_whatever_it_holds() -> None:
    not_json = b'{"ev":"listing","id":1,' + b"[" * (frames.MAX_EVENT_HEADER - 100)
    asked = anyio.Event()

    async def agent(container: MemoryByteStream) -> None:
        await asked.wait()
        await container.send(frame(not_json, b"x" * 1000))
        await container.send(listing(1, 2000))  # over a worker frame's size
        await container.send(pong(2))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            channel, _ = await start(tg, agent)
            (await channel.start(wire.ListFiles(path=".", limit=2000))).close()  # abandoned
            route = await channel.start(wire.Ping())
            asked.set()
            event, _ = await route.receive()
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
    text = "[{" * 10_000 + '"\\' * 5_000 + "\x01é"
    ((header, _),) = frames.event_decoder().feed(output_frame(text=text))
    assert header["text"] == text


def event_kinds() -> set[str]:
    models = typing.get_args(typing.get_args(wire.Event)[0])
    return {typing.get_args(model.model_fields["ev"].annotation)[0] for model in models}


def test_every_event_is_held_to_a_structure_and_every_request_is_answered_by_events_that_exist() -> None:
    assert event_kinds() == set(frames.EVENT_STRUCTURE_LIMITS)
    requests = {cls.__name__: cls.answered_by for cls in wire.Request.__subclasses__()}
    unanswered = {name for name, kinds in requests.items() if not kinds}
    assert unanswered == {"Interrupt", "ToolReply", "ToolPause"}  # each names its run's id, and gets nothing
    assert set().union(*requests.values()) <= event_kinds() - {"ready"}


# The pattern strings_out replaced, which stepped over each escape (kept as the reference).
STEPPING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
PIECES = ["\\", '"', '\\"', "\n", "é", "\x01", "[", "{", "a", "\ud800", "😀", "\\\\"]


def test_strings_are_taken_out_whatever_escapes_they_hold() -> None:
    chance = random.Random(7)

    def text() -> str:
        return "".join(chance.choice(PIECES) for _ in range(chance.randrange(6)))

    for _ in range(2000):
        value = {text(): [text(), 1, {text(): None}], "k": text()}
        raw = json.dumps(value, separators=(",", ":"), ensure_ascii=chance.random() < 0.5).encode(
            "utf-8", "surrogatepass"
        )
        assert frames.strings_out(raw) == STEPPING.sub(b"", raw) == b"{:[,1,{:null}],:}", raw
