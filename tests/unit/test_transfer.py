"""Files in chunks: every answer of the agent held to what was asked, and the service's streams over
the in-memory engine (a fake agent that stages uploads and serves reads by offset)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from _fake_agent import FakeAgent, send
from anyio.abc import ByteStream
from test_service_in_memory import running, settings

from mcp_code_exec.errors import FileOperationError, ProtocolViolation, QuotaExceeded, TooLarge
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.protocol.frames import MAX_CHUNK, PREFIX, event_decoder
from mcp_code_exec.sandbox.transfer import CHUNK_BYTES, check_chunk, check_staged, check_written

pytestmark = pytest.mark.anyio
MIB = 1 << 20


def chunk(offset: int = 0, size: int = 10, path: str = "a.bin", mtime_ns: int = 5) -> wire.Chunk:
    return wire.Chunk(ev="chunk", id=1, path=path, offset=offset, size=size, modified=1.0, mtime_ns=mtime_ns)


def test_a_chunk_that_is_what_was_asked_is_accepted() -> None:
    first = check_chunk(chunk(), b"x" * 4, path="a.bin", offset=0, length=4, first=None)
    assert check_chunk(chunk(offset=8), b"yy", path="a.bin", offset=8, length=4, first=first).offset == 8
    assert check_chunk(chunk(size=0), b"", path="a.bin", offset=0, length=4, first=None).size == 0


@pytest.mark.parametrize(
    ("event", "payload"),
    [
        (chunk(path="other.bin"), b"x" * 4),  # another file
        (chunk(offset=4), b"x" * 4),  # another offset
        (chunk(), b"x" * 5),  # more than asked
        (chunk(), b"x" * 3),  # fewer than the stated size allows
        (chunk(size=2), b"x" * 4),  # more than the stated size
        (wire.Staged(ev="staged", id=1, upload="u", size=4), b"x" * 4),  # not a chunk at all
    ],
)
def test_a_chunk_that_is_not_what_was_asked_is_a_protocol_violation(event: wire.Event, payload: bytes) -> None:
    with pytest.raises(ProtocolViolation):
        check_chunk(event, payload, path="a.bin", offset=0, length=4, first=None)


def test_a_file_that_changes_between_chunks_is_the_users_doing_not_a_violation() -> None:
    first = chunk()
    for later in (chunk(offset=4, size=12), chunk(offset=4, mtime_ns=6)):
        with pytest.raises(FileOperationError, match="changed while being read") as caught:
            check_chunk(later, b"x" * 4, path="a.bin", offset=4, length=4, first=first)
        assert not isinstance(caught.value, ProtocolViolation)


def test_upload_acknowledgements_must_match_what_was_sent() -> None:
    staged = wire.Staged(ev="staged", id=1, upload="u1", size=8)
    assert check_staged(staged, upload="u1", size=8) is staged
    for upload, size in (("u2", 8), ("u1", 9)):
        with pytest.raises(ProtocolViolation):
            check_staged(staged, upload=upload, size=size)
    written = wire.Written(ev="written", id=1, path="a.bin", size=8, modified=1.0)
    assert check_written(written, path="a.bin", size=8) is written
    for path, size in (("b.bin", 8), ("a.bin", 7)):
        with pytest.raises(ProtocolViolation):
            check_written(written, path=path, size=size)
    with pytest.raises(ProtocolViolation):
        check_written(staged, path="a.bin", size=8)


async def pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def test_a_file_bigger_than_a_chunk_goes_in_and_out_in_chunks() -> None:
    agent = FakeAgent()
    data = os.urandom(2 * CHUNK_BYTES + 12345)
    async with running(agent, settings()) as (service, _):
        sid = (await service.new_session("me")).session_id
        info = await service.write_stream("me", sid, "d/big.bin", pieces(data, 100_000), max_bytes=10 * MIB)
        assert info.size == len(data) and agent.files["d/big.bin"] == data and agent.staging == {}
        writes = [r for r in agent.requests if r["op"] == "write_chunk"]
        assert [(w["offset"], w["final"]) for w in writes] == [
            (0, False),
            (CHUNK_BYTES, False),
            (2 * CHUNK_BYTES, True),
        ]
        async with service.read_stream("me", sid, "d/big.bin") as found:
            assert found.size == len(data)
            digest = hashlib.sha256()
            async for part in found.chunks():
                assert len(part) <= CHUNK_BYTES
                digest.update(part)
        assert digest.digest() == hashlib.sha256(data).digest()
        assert sum(r["op"] == "read_chunk" for r in agent.requests) == 3
        await service.close_session("me", sid)


async def test_a_small_write_is_one_request_and_the_read_cap_is_checked_on_the_first_chunk() -> None:
    agent = FakeAgent()
    async with running(agent, settings(limits={"read_max_bytes": 2 * MIB})) as (service, _):
        sid = (await service.new_session("me")).session_id
        await service.write_file("me", sid, "small.txt", b"hello")
        assert [r["op"] for r in agent.requests if r["op"] != "ping"][-1:] == ["write_chunk"]
        assert (await service.read_file("me", sid, "small.txt")).data == b"hello"
        agent.files["huge.bin"] = b"z" * (3 * MIB)
        with pytest.raises(TooLarge, match="over the read cap"):
            await service.read_file("me", sid, "huge.bin")
        assert [r["offset"] for r in agent.requests if r.get("path") == "huge.bin"] == [0]
        await service.close_session("me", sid)


async def test_an_upload_over_the_quota_or_the_cap_is_dropped_and_nothing_is_written() -> None:
    agent = FakeAgent(quota=3 * MIB)
    async with running(agent, settings()) as (service, _):
        sid = (await service.new_session("me")).session_id
        with pytest.raises(QuotaExceeded):
            await service.write_stream("me", sid, "q.bin", pieces(b"q" * 4 * MIB, MIB), max_bytes=10 * MIB)
        with pytest.raises(TooLarge):
            await service.write_stream("me", sid, "c.bin", pieces(b"c" * 3 * MIB, MIB), max_bytes=2 * MIB)
        assert agent.files == {} and agent.staging == {}
        assert any(r["op"] == "abort_upload" for r in agent.requests)
        await service.close_session("me", sid)


async def test_a_source_that_fails_midway_aborts_the_upload() -> None:
    agent = FakeAgent()

    async def failing() -> AsyncIterator[bytes]:
        yield b"a" * (CHUNK_BYTES + 1)
        raise ConnectionError("the client went away")

    async with running(agent, settings()) as (service, _):
        sid = (await service.new_session("me")).session_id
        with pytest.raises(ConnectionError):
            await service.write_stream("me", sid, "half.bin", failing(), max_bytes=10 * MIB)
        assert agent.files == {} and agent.staging == {}
        await service.close_session("me", sid)


class LyingAgent(FakeAgent):
    """Answers every chunk read with one byte more than asked for."""

    async def answer(self, stream: ByteStream, header: dict[str, Any], payload: bytes) -> None:
        if header["op"] != "read_chunk":
            await super().answer(stream, header, payload)
            return
        meta = {"path": header["path"], "offset": header["offset"], "size": 1, "modified": 1.0, "mtime_ns": 1}
        await send(stream, {"ev": "chunk", "id": header["id"], **meta}, b"xx")


async def test_an_agent_that_sends_more_than_it_was_asked_is_replaced() -> None:
    async with running(LyingAgent(), settings()) as (service, engine):
        sid = (await service.new_session("me")).session_id
        sandbox = service.sessions.get(sid, "me").sandbox
        with pytest.raises(ProtocolViolation):
            await service.read_file("me", sid, "a.bin")
        assert sandbox is not None and not sandbox.alive
        started = engine.started
        await service.list_files("me", sid)  # the session goes on in a new container
        assert engine.started == started + 1
        await service.close_session("me", sid)


def test_a_chunk_frame_announcing_more_than_a_chunk_is_refused_before_its_payload_is_buffered() -> None:
    header = json.dumps({"ev": "chunk", "id": 1}, separators=(",", ":")).encode()
    with pytest.raises(ProtocolViolation, match="'chunk' frame is over its size limit"):
        list(event_decoder().feed(PREFIX.pack(len(header), MAX_CHUNK + 1) + header))  # not one byte of the payload sent
    done = json.dumps({"ev": "done", "id": 1}, separators=(",", ":")).encode()
    assert list(event_decoder().feed(PREFIX.pack(len(done), MAX_CHUNK + 1) + done)) == []


@pytest.mark.parametrize(
    "header",
    [
        {"ev": "staged", "id": 1, "upload": "u", "size": 1},
        {"ev": "output", "id": 1, "stream": "stdout", "text": "x"},
        {"ev": "pong", "id": 1},
        {"ev": "history_page", "id": 1},
        {"ev": "no_such_event", "id": 1},
    ],
    ids=["an acknowledgement", "output", "a pong", "a history page", "an unknown event"],
)
def test_a_payload_on_an_event_that_carries_none_is_refused_before_it_is_buffered(header: dict[str, Any]) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    with pytest.raises(ProtocolViolation, match="over its size limit"):
        list(event_decoder().feed(PREFIX.pack(len(raw), 1) + raw))


class FsizeAgent(FakeAgent):
    """Refuses every upload as the agent does past the sandbox's file-size limit."""

    async def write_chunk(self, stream: ByteStream, header: dict[str, Any], payload: bytes) -> None:
        message = {"ev": "error", "id": header["id"], "message": "x: file too large", "kind": "too_large"}
        await send(stream, message)


async def test_the_agents_file_size_refusal_is_told_apart_from_other_refusals() -> None:
    async with running(FsizeAgent(), settings()) as (service, _):
        sid = (await service.new_session("me")).session_id
        with pytest.raises(TooLarge, match="file too large"):
            await service.write_file("me", sid, "x", b"data")
        await service.close_session("me", sid)


def test_a_frame_whose_header_does_not_begin_with_its_kind_is_refused_before_it_is_buffered() -> None:
    raw = json.dumps({"id": 1, "ev": "chunk"}, separators=(",", ":")).encode()
    with pytest.raises(ProtocolViolation, match="does not begin with its kind"):
        list(event_decoder().feed(PREFIX.pack(len(raw) + 1000, 0) + raw + b" " * 100))  # 900 bytes never sent
