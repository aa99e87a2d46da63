"""Code mode's upstreams without an engine: messages split with none held past the cap, the error
that answers a request whose answer was too large (and never another request), HTTP bodies capped
as they are read, and where a stdio upstream may start (the configuration's checks)."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from mcp_code_exec.broker.transport import (
    EDGE,
    TOO_LARGE_CODE,
    CappedTransport,
    LineSplitter,
    Oversized,
    oversized_reply,
)
from mcp_code_exec.config.settings import load_config
from mcp_code_exec.errors import ConfigError

pytestmark = pytest.mark.anyio
CAP = 1000


def answer(request_id: Any, text: str, *, id_last: bool = False) -> bytes:
    """A tools/call answer as the Python SDK frames it (id before the result), or the TypeScript
    SDK (result first, id last)."""
    result = {"content": [{"type": "text", "text": text}]}
    message = {"result": result, "jsonrpc": "2.0", "id": request_id} if id_last else {
        "jsonrpc": "2.0", "id": request_id, "result": result
    }  # fmt: skip
    return json.dumps(message).encode() + b"\n"


def test_lines_come_out_whole_across_chunks_and_one_past_the_cap_only_by_its_edges() -> None:
    splitter = LineSplitter(CAP)
    small, big = answer(1, "hello"), answer(2, "x" * 50_000)
    stream = small + big + small
    out: list[bytes | Oversized] = []
    for start in range(0, len(stream), 4096):
        out += splitter.feed(stream[start : start + 4096])
        assert len(splitter.pending) <= CAP  # nothing past the cap is ever held
    assert out[0] == small.rstrip(b"\n") and out[2] == small.rstrip(b"\n")
    oversized = out[1]
    assert isinstance(oversized, Oversized) and oversized.size == len(big) - 1
    assert len(oversized.head) == len(oversized.tail) == EDGE and big.startswith(oversized.head)


@pytest.mark.parametrize("id_last", [False, True])
def test_an_answer_past_the_cap_becomes_an_error_for_its_own_request(id_last: bool) -> None:
    (line,) = LineSplitter(CAP).feed(answer(7, "y" * 5000, id_last=id_last))
    assert isinstance(line, Oversized)
    reply = oversized_reply(line, {3, 7}, CAP)
    assert reply is not None and reply.id == 7 and reply.error.code == TOO_LARGE_CODE
    assert "max_answer_mb" in reply.error.message


def test_ids_inside_the_result_never_name_the_request() -> None:
    """The text is the upstream's (a file a sandbox wrote, say): an id in it must not fail another call."""
    forged = 'x", "id": 3}' + "z" * 3000 + '{"jsonrpc": "2.0", "id": 3, "result": {"id": 3}'
    for id_last in (False, True):
        (line,) = LineSplitter(CAP).feed(answer(99, forged, id_last=id_last))
        assert isinstance(line, Oversized)
        reply = oversized_reply(line, {3}, CAP)  # 99 is not waiting: only the forged 3 is
        assert reply is None
    (line,) = LineSplitter(CAP).feed(b'{"jsonrpc": "2.0", "method": "notifications/message", "params": {"x": "'
                                     + b"w" * 3000 + b'"}}\n')  # fmt: skip
    assert isinstance(line, Oversized) and oversized_reply(line, {1, 2}, CAP) is None  # no id: the connection ends


class Body(httpx2.AsyncByteStream):
    """A body that arrives in chunks, as from the network (and counts what was sent)."""

    def __init__(self, size: int) -> None:
        self.size, self.sent = size, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.sent < self.size:
            chunk = b"a" * min(100, self.size - self.sent)
            self.sent += len(chunk)
            yield chunk


async def test_an_http_answer_past_the_cap_fails_as_it_is_read() -> None:
    bodies: list[Body] = []

    def upstream(request: httpx2.Request) -> httpx2.Response:
        kind = request.url.params.get("kind", "application/json")
        bodies.append(Body(int(request.url.params["size"])))
        return httpx2.Response(200, headers={"content-type": kind}, stream=bodies[-1])

    transport = CappedTransport(httpx2.MockTransport(upstream), CAP)
    async with httpx2.AsyncClient(transport=transport) as http:
        assert len((await http.get("http://up/", params={"size": CAP})).content) == CAP
        with pytest.raises(httpx2.StreamError, match="max_answer_mb"):
            await http.get("http://up/", params={"size": CAP * 100})
        assert bodies[-1].sent <= CAP + 100  # read no further than the cap and one chunk
        streamed = await http.get("http://up/", params={"size": CAP * 2, "kind": "text/event-stream"})
        assert len(streamed.content) == CAP * 2  # an event stream is bounded per event, by the SDK


def code_mode_config(tmp_path: Path, server: str, mounts: str = "") -> str:
    path = tmp_path / "config.toml"
    path.write_text(f'[[code_mode.servers]]\nname = "up"\n{server}\n{mounts}')
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    return str(caught.value)


def test_an_upstreams_working_directory_or_program_in_a_writable_mount_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "project").mkdir(parents=True)
    program = shared / "server.sh"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    writable = f'[[mounts]]\nname = "ws"\npath = "{shared}"\nwritable = true\n'
    python = f'command = "{sys.executable}"\nargs = ["-m", "mcp_server_time"]'
    for server in (
        f'{python}\ncwd = "{shared / "project"}"',
        f'{python}\ncwd = "{tmp_path}"',
        f'command = "{program}"',
    ):
        said = code_mode_config(tmp_path, server, writable)
        assert "overlaps the writable mount" in said and "\n" not in said.strip(), said
    read_only = writable.replace("writable = true", "writable = false")
    load_config_ok = tmp_path / "ok.toml"
    load_config_ok.write_text(
        f'[[code_mode.servers]]\nname = "up"\n{python}\ncwd = "{shared / "project"}"\n{read_only}'
    )
    assert load_config(load_config_ok, environ={}).code_mode.servers[0].cwd == str(shared / "project")


def test_an_upstreams_working_directory_is_absolute_and_exists(tmp_path: Path) -> None:
    python = f'command = "{sys.executable}"'
    assert "not an absolute path" in code_mode_config(tmp_path, f'{python}\ncwd = "relative/dir"')
    assert "not a directory" in code_mode_config(tmp_path, f'{python}\ncwd = "{tmp_path / "missing"}"')


def test_the_answer_cap_holds_at_least_a_result(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[code_mode]\nmax_answer_mb = 1\nmax_result_kb = 2048\n")
    with pytest.raises(ConfigError, match="max_answer_mb"):
        load_config(path, environ={})
