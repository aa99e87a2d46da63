"""A run's ``done`` is held to the run's caps before the host uses it: the bytes of the files a
stateless run left must lie end to end in the payload, each and all within the caps, so that
no forged layout makes the host copy one payload many times (``sandbox.run_events``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from _fake_agent import FakeAgent, send
from anyio.abc import ByteStream
from mcpx_agent import events
from mcpx_agent import output as agent_output
from mcpx_agent.protocol import encode
from test_service_in_memory import running, settings

from mcp_code_exec.errors import ProtocolViolation
from mcp_code_exec.protocol import frames
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.runtime.memory import MemoryByteStream, byte_pipe
from mcp_code_exec.sandbox import run_events
from mcp_code_exec.sandbox.channel import AgentChannel, Pending, Route, Routed
from mcp_code_exec.sandbox.run_events import RawRun, check_collected, collect, finish

pytestmark = pytest.mark.anyio


def options() -> wire.RunOptions:
    return wire.RunOptions(
        max_output_bytes=1, max_result_bytes=1, max_display_bytes=1, max_displays=1, max_images=1,
        max_image_bytes=1, max_image_pixels=1, collect_bytes=100, collect_file_bytes=40, collect_files=4,
    )  # fmt: skip


def entry(offset: int | None, length: int | None, name: str = "f") -> wire.FileEntry:
    return wire.FileEntry(path=name, size=length or 0, modified=1.0, offset=offset, length=length)


def test_files_laid_end_to_end_within_the_caps_are_accepted() -> None:
    files = [entry(0, 10), entry(None, None), entry(10, 40), entry(50, 0), entry(50, 30)]
    check_collected(files, b"x" * 80, options())
    check_collected([entry(None, None)], b"", options())


@pytest.mark.parametrize(
    ("files", "size"),
    [
        ([entry(0, 30)] * 300, 30),  # the same bytes claimed again and again
        ([entry(0, 20), entry(10, 20)], 30),  # overlapping
        ([entry(0, 10), entry(20, 10)], 30),  # a gap
        ([entry(5, 10)], 15),  # not from the start
        ([entry(0, 41)], 41),  # one file over its cap
        ([entry(0, 40), entry(40, 40), entry(80, 40)], 120),  # all of them over the run's cap
        ([entry(0, 10)], 20),  # bytes that belong to no file
        ([entry(0, 10)], 5),  # a file past the payload's end
        ([entry(0, None)], 0),  # an offset without a length
        ([entry(i, 1) for i in range(5)], 5),  # more files carried than the run keeps
    ],
    ids=["repeated", "overlapping", "gap", "offset", "file-cap", "run-cap", "extra", "short", "no-length", "count"],
)
def test_a_forged_layout_of_collected_files_is_a_protocol_violation(files: list[wire.FileEntry], size: int) -> None:
    with pytest.raises(ProtocolViolation):
        check_collected(files, b"x" * size, options())


async def test_a_done_that_claims_its_payload_many_times_ends_the_run_and_replaces_the_container() -> None:
    async def cell(code: str, request: dict[str, Any]) -> dict[str, Any]:
        if code != "forge":
            return {"stdout": "ok\n"}
        claims = [{"path": f"f{i}", "size": 8, "modified": 1.0, "offset": 0, "length": 8} for i in range(300)]
        return {"files": claims, "files_payload": b"x" * 8}

    async with running(FakeAgent(cell=cell), settings()) as (service, engine):
        forged = await service.run("me", "forge")
        assert forged.status == "crashed" and forged.files == []
        assert (await service.run("me", "after")).stdout == "ok\n"
        assert engine.started == 2  # the container that forged it was replaced


class OversizedPayloads(FakeAgent):
    """Sends, before a run's own events, the frame its code names (with only a header's worth of it
    read by then: the host must refuse it from its header alone)."""

    async def execute(self, stream: ByteStream, header: dict[str, Any], payload: bytes) -> None:
        rid, code = header["id"], payload.decode()
        if code == "image":  # over the run's max_image_bytes
            await send(stream, events.image(rid, "image/png", 1, 1, None), b"x" * 1_000_001)
        elif code == "stray":  # an image for a request never sent, its 1 MB never read
            await send(stream, events.image(rid + 1000, "image/png", 1, 1, None), b"x" * 1_000_001)
        elif code == "done":  # a session's done carries no files' bytes
            await send(stream, events.done(rid, **DONE), b"x")
            return
        await super().execute(stream, header, payload)


DONE: dict[str, Any] = {
    "status": "ok", "result": None, "error": None, "stdout": "", "stderr": "", "truncated": [],
    "session_restarted": False, "duration_ms": 1.0, "files": [], "notes": [], "recycle": False, "usage": None,
}  # fmt: skip


@pytest.mark.parametrize("code", ["image", "done"])
async def test_an_image_or_done_over_its_runs_caps_is_refused_from_its_header(code: str) -> None:
    async with running(OversizedPayloads(), settings()) as (service, _engine):
        session_id = (await service.new_session("me")).session_id if code == "done" else None
        result = await service.run("me", code, session_id=session_id)
        assert result.status == "crashed" and result.error is not None
        assert "frame is over its size limit" in result.error.message, result.error
        assert (await service.run("me", "after")).stdout == "ran after\n"


async def test_an_event_for_a_request_never_sent_crashes_the_run_before_it_is_read() -> None:
    async with running(OversizedPayloads(), settings()) as (service, _engine):
        result = await service.run("me", "stray")
        assert result.status == "crashed" and result.error is not None
        assert "'image' event for a request never sent" in result.error.message, result.error
        assert (await service.run("me", "after")).stdout == "ran after\n"


def test_a_done_whose_traceback_is_over_the_runs_caps_is_a_protocol_violation() -> None:
    error = wire.Error(type="E", message="m", traceback="x" * 5000)  # the cap: 8 characters a byte, and 4096
    done = wire.Done(ev="done", id=1, status="error", result=None, error=error, stdout="", stderr="", truncated=[],
                     session_restarted=False, duration_ms=1.0, files=[], notes=[], recycle=False)  # fmt: skip
    with pytest.raises(ProtocolViolation, match="run output over the caps"):
        finish(RawRun(), done, b"", options())


class OutputFlood(FakeAgent):
    """Sends, before a run's own events, a thousand output events at once (the agent sends at most
    two every 0.1 s, and only for a run that streams its output)."""

    async def execute(self, stream: ByteStream, header: dict[str, Any], payload: bytes) -> None:
        if payload == b"flood":
            for _ in range(1000):
                await send(stream, events.output(header["id"], "stdout", "x"))
        await super().execute(stream, header, payload)


async def test_output_flooded_faster_than_the_agent_streams_it_crashes_the_run() -> None:
    async with running(OutputFlood(), settings()) as (service, engine):
        result = await service.run("me", "flood")
        assert result.status == "crashed" and result.error is not None
        assert "'output' events faster than the agent sends them" in result.error.message, result.error
        assert (await service.run("me", "after")).stdout == "ran after\n"
        assert engine.started == 2  # the container that flooded was replaced


def pending(opened_at: float) -> Pending:
    send, _ = anyio.create_memory_object_stream[Routed]()
    request = wire.Exec(mode="stateless", timeout=1, stream=True, options=options())
    return Pending(send, request, request.answers(), {}, opened_at)


@pytest.mark.parametrize("behind_s", [0.0, 0.5, 20.0])
def test_the_agents_streamer_at_its_fastest_stays_within_the_pace_the_host_holds_it_to(behind_s: float) -> None:
    """Both streams flooded with bytes that decode and encode at their largest (one character each,
    of 3 bytes in UTF-8 or 6 escaped), flushed at every chance for 100 s; the host takes each event
    as it is sent, or after falling behind by ``behind_s`` (then the events come in a burst)."""
    sent: list[tuple[float, dict[str, Any]]] = []
    now = 0.0
    streamer = agent_output.Streamer(lambda event: sent.append((now, event)), 1)
    streamer.last = 0.0  # the run began at 0 (the host counts from before it sent the request)
    for tick in range(1, 20_001):
        now = tick / 200
        streamer.add("stdout", b"\xff" * 70_000)  # each a character of 3 bytes
        streamer.add("stderr", b"\x01" * 70_000)  # each escaped to 6
        streamer.maybe_flush(now)
    assert len(sent) >= 1900  # two events every 0.1 s (or 0.105 s, as the ticks fall)
    host = pending(opened_at=0.0)
    pace = frames.EVENT_PACES["output"]
    for at, _event in sent:
        taken_at = at if at < 50 else max(at, 50 + behind_s)  # at 50 s the host stops for behind_s
        assert host.within_pace("output", pace, taken_at), at
    assert all(len(event["text"]) <= run_events.OUTPUT_TEXT_MOST for _, event in sent)
    assert max(len(encode(event)) for _, event in sent) <= frames.event_header_limit("output")
    assert max(len(event["text"]) for _, event in sent) > agent_output.STREAM_CHUNK_MAX  # the marker too


def test_a_quiet_run_saves_up_at_most_half_a_minute_of_output_events() -> None:
    pace = frames.EVENT_PACES["output"]
    host = pending(opened_at=0.0)
    taken = 0
    while host.within_pace("output", pace, 3600.0):  # an hour of quiet, then a flood
        taken += 1
    assert taken == pace.at_first + pace.per_s * pace.most_s == 1232
    later = 3600 + 1.5 / pace.per_s  # then one and a half events' worth of time: one more, not two
    assert host.within_pace("output", pace, later) and not host.within_pace("output", pace, later)


@contextlib.asynccontextmanager
async def a_run(run_options: wire.RunOptions) -> AsyncIterator[tuple[Route, MemoryByteStream]]:
    """A run's route on a channel to a container the test speaks for."""
    host, container = byte_pipe()
    channel = AgentChannel(host, "test")
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await container.send(encode({"ev": "ready", "agent_version": 2, "python": "3.11"}))
            await tg.start(channel.run)
            route = await channel.start(wire.Exec(mode="stateless", timeout=1, stream=True, options=run_options))
            yield route, container
            route.close()
            tg.cancel_scope.cancel()


async def calls(container: MemoryByteStream, route: Route, count: int) -> None:
    for _ in range(count):
        await container.send(encode(events.tool_call(route.id, 1, "s", "t", raw=False), b"{}"))


async def test_the_calls_a_run_may_not_have_answered_are_counted_across_its_interrupt() -> None:
    raw = RawRun()
    async with a_run(options()) as (route, container):
        await calls(container, route, 60)
        with anyio.CancelScope() as scope:  # the run's own collect, until its caller goes away
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect, route, raw, options(), None)
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
        assert raw.tool_calls == 60
        await calls(container, route, 41)
        with pytest.raises(ProtocolViolation, match="more than 100 tool calls, far past what it may make"):
            await collect(route, raw, options(), None)  # the interrupt's: no calls answered, none refused


async def test_an_interrupted_code_mode_run_may_have_its_budgets_calls_in_flight() -> None:
    budget = options().model_copy(update={"max_tool_calls": 500})
    raw = RawRun()
    async with a_run(budget) as (route, container):
        await calls(container, route, 150)
        await container.send(encode(events.done(route.id, **DONE)))
        await collect(route, raw, budget, None)
    assert raw.tool_calls == 150 and raw.result.status == "ok"


@pytest.mark.parametrize("extra", [0, 1])
async def test_output_in_larger_pieces_than_the_agent_streams_is_a_protocol_violation(extra: int) -> None:
    log: list[str] = []
    async with a_run(options()) as (route, container):
        text = "x" * (run_events.OUTPUT_TEXT_MOST + extra)
        await container.send(encode(events.output(route.id, "stdout", text)))
        await container.send(encode(events.done(route.id, **DONE)))
        sink = SimpleNamespace(add=lambda stream, text: log.append(text))
        if extra:
            with pytest.raises(ProtocolViolation, match="in larger pieces than the agent streams it"):
                await collect(route, RawRun(), options(), sink)
        else:
            await collect(route, RawRun(), options(), sink)
    assert log == ([] if extra else [text])
