"""The host's and the agent's halves of the protocol agree: frames, limits, nesting, images, paths.

The agent's modules run inside the sandbox (stdlib only) and cannot import the host package, so
each half has its own code; these tests run the same inputs through both so they cannot drift.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from pathlib import Path

import pytest

from mcp_code_exec.errors import InvalidPath, ProtocolViolation
from mcp_code_exec.protocol import frames, paths
from mcp_code_exec.protocol import messages as wire

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent import protocol as agent
from mcpx_agent.supervisor import files as agent_files
from mcpx_agent.supervisor import transfer as agent_transfer


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
    decoded = frames.FrameDecoder().feed(agent.encode(event))
    assert decoded == [(event, b"")]
    parsed = wire.parse_event(decoded[0][0])
    assert isinstance(parsed, wire.Display) and parsed.text == "ü" * 10


@pytest.mark.parametrize(
    "raw",
    [b"[" * 40 + b"]" * 40, b'{"a":' * 40 + b"1" + b"}" * 40, b'"' + b"[" * 100 + b'"', b"[[1],[2],[3]]" * 20, b"{}"],
)
def test_both_halves_judge_nesting_alike(raw: bytes) -> None:
    assert frames.nesting_within(raw, frames.MAX_DEPTH) == agent.nesting_within(raw, agent.MAX_DEPTH)


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


TABLE = {
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
