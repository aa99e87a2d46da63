"""The host's and the agent's halves of the protocol agree: frames, limits, nesting, images, paths,
every event the agent builds, and the constants both state.

The agent's modules run inside the sandbox (stdlib only) and cannot import the host package, so
each half has its own code; these tests run the same inputs through both so they cannot drift.
"""

from __future__ import annotations

import inspect
import json
import os
import struct
import subprocess
import sys
import typing
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mcp_code_exec.broker.broker import Refused, parse_arguments
from mcp_code_exec.config import Config
from mcp_code_exec.errors import InvalidPath, ProtocolViolation
from mcp_code_exec.models import RestoreOutcome
from mcp_code_exec.protocol import frames, paths
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.sandbox import run_events, spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent import events, identity
from mcpx_agent import protocol as agent
from mcpx_agent.supervisor import files as agent_files
from mcpx_agent.supervisor import transfer as agent_transfer
from mcpx_agent.supervisor import worker_results


def png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"\x00" * width * 3 for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def jpeg_header(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof + b"\xff\xd9"


def test_both_halves_state_the_same_limits() -> None:
    for name in ("MAX_REQUEST_HEADER", "MAX_REQUEST_PAYLOAD", "MAX_EVENT_HEADER", "MAX_EVENT_PAYLOAD", "MAX_DEPTH"):
        assert getattr(frames, name) == getattr(agent, name), name
    assert frames.PREFIX.format == agent.PREFIX.format
    assert frames.MAX_CHUNK == agent_transfer.MAX_CHUNK
    assert frames.IMAGE_MAGIC == agent.IMAGE_MAGIC
    assert spec.SANDBOX_GID == identity.SANDBOX_GID
    assert run_events.MAX_TABLES == worker_results.MAX_TABLES
    assert set(typing.get_args(RestoreOutcome)) == set(agent.RESTORE_OUTCOMES)


def test_the_agents_fallback_caps_are_the_configurations_defaults() -> None:
    """A run whose options lack a cap gets the agent's own: the same as the host sends by default."""
    limits = Config().limits
    output = limits.max_output_bytes
    assert {
        "max_output_bytes": output,
        "max_result_bytes": output,
        "max_display_bytes": output,
        "max_displays": limits.max_displays,
        "max_images": limits.max_images,
        "max_image_bytes": limits.max_image_bytes,
        "max_image_pixels": limits.max_image_pixels,
    } == worker_results.DEFAULTS


def test_a_request_the_host_encodes_is_what_the_agent_reads(tmp_path: Path) -> None:
    request = wire.Exec(id=7, mode="session", timeout=2.5, stream=True, options=options())
    read_end, write_end = os.pipe()
    os.write(write_end, request.frame("print('é')".encode()))
    os.close(write_end)
    reader = agent.FrameReader(read_end, max_header=agent.MAX_REQUEST_HEADER, max_payload=agent.MAX_REQUEST_PAYLOAD)
    reader.fill()
    ((header, payload),) = reader.frames()
    os.close(read_end)
    assert header["op"] == "exec" and header["id"] == 7 and header["options"]["max_images"] == 20
    assert payload.decode() == "print('é')"


def test_an_event_the_agent_encodes_is_what_the_host_parses() -> None:
    event = {"ev": "display", "id": 3, "text": "ü" * 10}
    decoded = list(frames.event_decoder().feed(agent.encode(event)))
    assert decoded == [(event, b"")]
    parsed = wire.parse_event(decoded[0][0])
    assert isinstance(parsed, wire.Display) and parsed.text == "ü" * 10


@pytest.mark.parametrize(
    "raw",
    [b"[" * 40 + b"]" * 40, b'{"a":' * 40 + b"1" + b"}" * 40, b'"' + b"[" * 100 + b'"', b"[[1],[2],[3]]" * 20, b"{}"],
)
def test_both_halves_judge_nesting_alike(raw: bytes) -> None:
    assert frames.nesting_within(raw, frames.MAX_DEPTH) == agent.nesting_within(raw, agent.MAX_DEPTH)


@pytest.mark.parametrize("depth", [15, 16, 17, 40])
@pytest.mark.parametrize("shape", ["lists", "objects", "both kinds in turn"])
def test_nesting_is_judged_exactly_at_the_limit_whatever_the_strings_hold(depth: int, shape: str) -> None:
    value: Any = [1, "[[[{{{", 'a "[" and a \\ and [{']  # one level deep
    for level in range(depth - 1):
        if shape == "lists" or (shape == "both kinds in turn" and level % 2):
            value = [value, "]]]"]
        else:
            value = {"k": value, "s": "}}}"}
    raw = json.dumps(value).encode()
    for half in (frames, agent):
        assert half.nesting_within(raw, 16) == (depth <= 16), (half, depth, shape)


def test_an_unclosed_string_is_judged_in_linear_time() -> None:
    """An opening quote, then 256 KiB (a tool call's arguments at most) of escaped quotes: a match
    that failed at the end was retried from every later quote, and took minutes."""
    code = (
        "import sys; sys.path[:0] = sys.argv[1:]\n"
        "from mcp_code_exec.protocol import frames; from mcpx_agent import protocol\n"
        "raw = b'[' * 20 + b'\"' + b'\\\\\"' * (128 << 10)\n"
        "assert raw.count(b'\"') == 1 + (128 << 10) and len(raw) > 256 << 10\n"
        "print(frames.nesting_within(raw, 16), protocol.nesting_within(raw, 16))\n"
    )
    agent_path = str(Path(agent.__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).resolve().parents[2]), agent_path],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout == "False False\n", done.stderr  # the brackets before it are counted


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_a_header_or_arguments_in_another_encoding_than_utf8_are_refused(encoding: str) -> None:
    """In UTF-16 a character such as U+2241 holds a quote's byte, which hid deep nesting."""
    raw = json.dumps({"a": "\u2241", "b": [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]], "c": "\u2241"}).encode(encoding)
    with pytest.raises(ProtocolViolation):
        frames.decode_header(raw)
    with pytest.raises(agent.ProtocolError):
        agent.decode_header(raw)
    with pytest.raises(Refused) as refused:
        parse_arguments(raw)
    assert refused.value.kind == "argument"


@pytest.mark.parametrize("blob", [png(3, 5), png(640, 480), jpeg_header(123, 45), b"\x89PNG\r\n\x1a\nshort", b"GIF89a"])
def test_both_halves_read_the_same_image_size(blob: bytes) -> None:
    for mime in ("image/png", "image/jpeg"):
        assert frames.image_size(mime, blob) == agent.image_size(mime, blob)


def test_image_sizes_are_read_from_the_headers() -> None:
    assert frames.image_size("image/png", png(640, 480)) == (640, 480)
    assert frames.image_size("image/jpeg", jpeg_header(123, 45)) == (123, 45)
    assert frames.image_size("image/png", b"\x89PNG\r\n\x1a\nshort") is None


PATHS = [
    "a.txt", "dir/b.csv", "/mnt/data/x", "/mnt/data", "./a//b/./c", "", "   ", "..", "a/../b", "/etc/passwd",
    "/mnt/datax/y", "a\x00b", "a\\b", "a" * 256, "a/" * 600, "é/ü.txt", "/mnt/data/../etc",
]  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
def test_both_halves_apply_the_same_path_rules(path: str) -> None:
    try:
        host: str | None = paths.normalize(path)
    except InvalidPath:
        host = None
    try:
        mine: str | None = "/".join(agent_files.split_path(path))
    except agent_files.FileError:
        mine = None
    assert host == mine or (host is None and mine == ""), (path, host, mine)


def test_the_agents_worker_frame_check_refuses_what_the_host_would() -> None:
    with pytest.raises(agent.ProtocolError):
        agent.worker_frame({"kind": "done", "status": "ok", "result": 5, "error": None, "exec_ms": 1}, b"", 10)
    with pytest.raises(agent.ProtocolError):
        agent.worker_frame({"kind": "shell"}, b"", 10)
    with pytest.raises(agent.ProtocolError):
        agent.worker_frame({"kind": "image", "mime": "image/png", "width": 1, "height": 1}, b"not a png", 100)
    with pytest.raises(ProtocolViolation):
        wire.parse_event({"ev": "done", "id": 1, "status": "pwned"})
    ok = {"kind": "done", "status": "ok", "result": "1", "error": None, "exec_ms": 1.5, "truncated": ["result"]}
    assert agent.worker_frame(ok, b"", 10) == ok


TABLE: dict[str, Any] = {
    "table": "0123456789abcdef",
    "columns": ["", "x"],
    "dtypes": ["int64", "int64"],
    "rows": 3,
    "total_rows": 3,
    "sorted_columns": 2,
}


def test_both_halves_take_a_table_frame_and_refuse_a_forged_one() -> None:
    frame = {"kind": "table", **TABLE}
    assert agent.worker_frame(dict(frame), b"", 10) == frame
    assert isinstance(wire.parse_event({"ev": "table", "id": 1, **TABLE}), wire.Table)
    for forged in ({"table": "../../x"}, {"columns": ["a"]}, {"rows": 5}, {"sorted_columns": 3}):
        with pytest.raises(agent.ProtocolError):
            agent.worker_frame({**frame, **forged}, b"", 10)
    with pytest.raises(ProtocolViolation):
        wire.parse_event({"ev": "table", "id": 1, **TABLE, "table": "../../x"})


def options() -> wire.RunOptions:
    return wire.RunOptions(
        max_output_bytes=65536,
        max_result_bytes=65536,
        max_display_bytes=65536,
        max_displays=50,
        max_images=20,
        max_image_bytes=1_000_000,
        max_image_pixels=2_000_000,
    )


def test_run_options_round_trip_as_json() -> None:
    dumped = json.loads(json.dumps(options().model_dump(mode="json", exclude_none=True)))
    assert wire.RunOptions.model_validate(dumped) == options()


# -- every event the agent says, through the other half ---------------------------------------------
ERROR = events.run_error("ValueError", "bad", "Traceback ...")
USAGE = events.run_usage(0.25, 0.0, 52_428_800, 4, 1, 3)
FILE = {"path": "a.csv", "size": 4, "modified": 1.5, "new": True, "offset": 0, "length": 4}
LISTED = {"path": "a.csv", "size": 4, "is_dir": False, "is_symlink": False, "modified": 1.5}
VARIABLE = {"name": "df", "type": "pandas.DataFrame", "repr": "x", "size": 80, "shape": [10, 1]}
CELL = {
    "n": 1, "at": 1.5, "code": "1", "status": "ok", "duration_ms": 2.0, "stdout": "", "stderr": "", "result": "1",
    "displays": [], "error": None, "figures": ["image/png"], "tables": [TABLE], "outputs_dropped": False,
    "usage": USAGE,
}  # fmt: skip
# One call of each builder of an event for the host (the request id is the first argument).
HOST_EVENTS: dict[str, Callable[[], dict[str, Any]]] = {
    "ready": lambda: events.ready(5, "3.11.2"),
    "pong": lambda: events.pong(1, None),
    "output": lambda: events.output(1, "stderr", "é"),
    "image": lambda: events.image(1, "image/png", 640, 480, None),
    "display": lambda: events.display(1, "text"),
    "table": lambda: events.table(1, **TABLE),
    "tool_call": lambda: events.tool_call(1, 3, "time", "now", False),
    "done": lambda: events.done(
        1,
        status="error",
        result=None,
        error=ERROR,
        stdout="a",
        stderr="",
        truncated=["stdout"],
        session_restarted=True,
        duration_ms=1.5,
        notes=["n"],
        recycle=False,
        files=[FILE],
        usage=USAGE,
    ),
    "clean": lambda: events.clean(1, False, ["processes of the sandbox user survived"]),
    "listing": lambda: events.listing(1, [LISTED], False),
    "chunk": lambda: events.chunk(1, "a.csv", 0, 4, 1.5, 1_500_000_000),
    "staged": lambda: events.staged(1, "0" * 32, 4),
    "dropped": lambda: events.dropped(1, "0" * 32),
    "written": lambda: events.written(1, "a.csv", 4, 1.5),
    "restored": lambda: events.restored(1, "restored", 2, ["gen (generator)"], "restored 2 names", 1.5),
    "snapshot": lambda: events.snapshot(1, True, None, None),
    "variables": lambda: events.variables(1, [VARIABLE], True),
    "history_page": lambda: events.history_page(1, [CELL], 0, more=False, missing=False),
    "failure": lambda: events.failure(1, "nothing was written: quota", "quota"),
}
# One call of each builder of a worker's frame (it reaches the supervisor's check, never the host).
WORKER_FRAMES: dict[str, Callable[[], dict[str, Any]]] = {
    "worker_done": lambda: events.worker_done("error", None, ERROR, 1.5, ["traceback"], 51_200, 0),
    "worker_note": lambda: events.worker_note("the snapshot was too large"),
    "worker_display": lambda: events.worker_display("text"),
    "worker_image": lambda: events.worker_image("image/png", 3, 5, "downscaled"),
    "worker_table": lambda: events.worker_table(**TABLE),
    "worker_call": lambda: events.worker_call(3, "time", "now", True),
    "worker_restored": lambda: events.worker_restored("restored", 2, ["gen (generator)"], "restored 2 names", 1.5),
    "worker_snapshot_synced": lambda: events.worker_snapshot_synced(False, 1.5, 10),
    "worker_variables": lambda: events.worker_variables([VARIABLE], False),
}
REQUESTS = {
    "cell_request",
    "tool_reply",
    "snapshot_order",
    "snapshot_sync_request",
    "restore_request",
    "variables_request",
}


def builders() -> set[str]:
    return {
        name
        for name, value in vars(events).items()
        if inspect.isfunction(value) and value.__module__ == events.__name__
    }


def test_every_builder_of_the_agent_is_run_through_the_halves_here() -> None:
    assert builders() == {*HOST_EVENTS, *WORKER_FRAMES, *REQUESTS, "run_error", "run_usage"}


@pytest.mark.parametrize("name", sorted(HOST_EVENTS))
def test_every_event_the_agent_builds_is_one_the_host_parses(name: str) -> None:
    event = HOST_EVENTS[name]()
    decoded = list(frames.event_decoder().feed(agent.encode(event)))  # its kind and id read from its first bytes
    assert decoded == [(event, b"")]
    parsed = wire.parse_event(decoded[0][0])
    assert parsed.model_dump(mode="json", exclude_unset=True) == event


def test_the_agent_builds_every_event_the_host_knows() -> None:
    known = {
        typing.get_args(model.model_fields["ev"].annotation)[0]
        for model in typing.get_args(typing.get_args(wire.Event)[0])
    }
    assert {HOST_EVENTS[name]()["ev"] for name in HOST_EVENTS} == known


@pytest.mark.parametrize("name", sorted(WORKER_FRAMES))
def test_every_frame_a_worker_builds_passes_the_supervisors_check(name: str) -> None:
    frame = WORKER_FRAMES[name]()
    payload = png(3, 5) if frame["kind"] == "image" else b""
    assert agent.worker_frame(dict(frame), payload, 1 << 20) == frame


def test_the_workers_builders_cover_every_frame_the_supervisor_accepts() -> None:
    assert {WORKER_FRAMES[name]()["kind"] for name in WORKER_FRAMES} == set(agent.WORKER_FRAMES)
