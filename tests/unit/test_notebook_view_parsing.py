"""The notebook view without Docker: a session's history page as the agent builds it from hostile
bytes and as the host validates it, tables read as hostile bytes, and the per-caller tool listing
over the in-memory transport (the table frame: test_protocol_halves)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from _fake_agent import FakeAgent
from mcp import Client
from mcp.client.extension import advertise
from mcp.server.apps import APP_MIME_TYPE, EXTENSION_ID
from test_service_in_memory import running, settings

from mcp_code_exec.errors import ClientLimit, ProtocolViolation
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.protocol import frames
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.service import notebook
from mcp_code_exec.service.notebook import page_records, row_cells, view_of_page

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent import history_format
from mcpx_agent.supervisor import history_page as agent_page

TABLE = {
    "table": "0123456789abcdef",
    "columns": ["", "x"],
    "dtypes": ["int64", "int64"],
    "rows": 3,
    "total_rows": 3,
    "sorted_columns": 2,
}


def run_line(**fields: object) -> bytes:
    base: dict[str, object] = {"kind": "run", "n": 1, "code": "1", "status": "ok", "duration_ms": 2}
    return json.dumps({**base, **fields}).encode()


def page_of(cells: list[dict[str, Any]], **fields: Any) -> wire.HistoryPage:
    """The page as the host parses it from the agent's frame (``parse_event`` refuses a forged one)."""
    event = {"ev": "history_page", "id": 1, "cells": cells, "runs_dropped": 0, "more": False, "missing": False}
    raw = json.dumps({**event, **fields}, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")
    parsed = wire.parse_event(frames.decode_header(raw))
    assert isinstance(parsed, wire.HistoryPage)
    return parsed


def test_both_halves_cap_a_page_cell_alike() -> None:
    assert (agent_page.CODE_CHARS, agent_page.TEXT_CHARS, agent_page.NAME_CHARS) == (
        wire.PAGE_CODE_CHARS,
        wire.PAGE_TEXT_CHARS,
        wire.PAGE_NAME_CHARS,
    )
    assert agent_page.STREAM_CHARS == notebook.STREAM_CHARS and 2 * agent_page.STREAM_CHARS < wire.PAGE_STREAM_CHARS
    fields = wire.PageCell.model_fields
    assert fields["displays"].metadata[0].max_length == agent_page.MAX_DISPLAYS
    assert fields["figures"].metadata[0].max_length == agent_page.MAX_FIGURES
    assert fields["tables"].metadata[0].max_length == agent_page.MAX_TABLES


def test_a_history_line_becomes_a_cell_with_its_outputs_capped() -> None:
    line = run_line(stdout="a" * 100_000, result="2", displays=["d"], images=[{"file": "img-1-0.png"}], tables=[TABLE])
    found = agent_page.cell(line)
    assert isinstance(found, dict)
    (cell,) = view_of_page("s", page_of([found])).cells
    assert len(cell.stdout) < 2 * notebook.STREAM_CHARS + 100 and "characters not shown" in cell.stdout
    assert (cell.result, cell.displays, [f.index for f in cell.figures]) == ("2", ["d"], [0])
    assert cell.tables[0].table == TABLE["table"] and cell.tables[0].sorted_columns == 2


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser goes
        b'"a string"',
        json.dumps({"kind": "shell"}).encode(),
    ],
)
def test_lines_that_are_not_runs_are_skipped(line: bytes) -> None:
    assert agent_page.cell(line) is None


def test_hostile_fields_are_checked_one_by_one_and_the_rest_of_the_run_kept() -> None:
    line = run_line(
        status="pwned",
        n="7",
        at=-5,
        duration_ms=float("inf"),
        images=[{"file": "../../etc/passwd"}, {"file": "img-1-1.png"}, "x"],
        tables=[{**TABLE, "table": "../x"}, {**TABLE, "columns": ["a"]}, 5, {**TABLE, "rows": -3}],
        error={"type": 5, "message": "m", "traceback": ["not", "text"]},
        displays=[1, "kept"],
    )
    found = agent_page.cell(line)
    assert isinstance(found, dict)
    (cell,) = view_of_page("s", page_of([found])).cells
    assert (cell.status, cell.n, cell.displays, cell.at, cell.duration_ms) == ("error", 0, ["kept"], None, 0)
    assert [t.rows for t in cell.tables] == [0]
    assert [f.index for f in cell.figures] == [0]  # the one well-named image, first of the cell's figures
    assert cell.error is not None and (cell.error.type, cell.error.traceback) == ("Error", "")


def test_the_largest_cell_the_agent_makes_passes_the_hosts_model() -> None:
    wide = "\x01é" * 12_500  # over every cap; escaped in JSON, and more than one byte in UTF-8
    name = "\x01é" * 101
    line = run_line(
        n=10**12,
        code=wide,
        stdout=wide,
        stderr=wide,
        result=wide,
        displays=[wide] * 25,
        images=[{"file": "img-1-0.jpeg"}] * 100,
        tables=[{**TABLE, "columns": [name] * 250, "dtypes": [name] * 250, "sorted_columns": 999}] * 10,
        error={"type": wide, "message": wide, "traceback": wide},
    )
    found = agent_page.cell(line)
    assert isinstance(found, dict)
    (cell,) = page_of([found]).cells
    assert cell.n == 10**9 - 1 and len(cell.figures) == 50 and len(cell.tables) == 8
    assert agent_page.sent_size(found) < frames.MAX_EVENT_HEADER // 2  # a page is cut at 4 MiB at most


@pytest.mark.parametrize(
    "forged",
    [
        {"code": "x" * (wire.PAGE_CODE_CHARS + 1)},
        {"stdout": "x" * (wire.PAGE_STREAM_CHARS + 1)},
        {"displays": ["d"] * 21},
        {"figures": ["image/gif"]},
        {"n": -1},
        {"duration_ms": 1e300},
        {"status": "pwned"},
        {"tables": [{**TABLE, "table": "../../x"}]},
        {"extra": 1},
    ],
)
def test_a_page_cell_over_the_models_caps_is_refused_whole(forged: dict[str, Any]) -> None:
    found = agent_page.cell(run_line())
    assert isinstance(found, dict)
    with pytest.raises(ProtocolViolation):
        page_of([{**found, **forged}])


def lines_file(tmp_path: Path, lines: list[bytes]) -> tuple[int, int]:
    path = tmp_path / "runs.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return os.open(path, os.O_RDONLY), path.stat().st_size


def test_a_page_is_the_newest_runs_oldest_first_with_the_headers_count(tmp_path: Path) -> None:
    header = json.dumps({"kind": "header", "runs_dropped": 7}).encode()
    fd, size = lines_file(tmp_path, [header, *(run_line(n=n) for n in range(1, 301))])
    try:
        page = agent_page.Page(200, 1 << 20)
        agent_page.read_newest(fd, size, 1 << 30, page)
        dropped = agent_page.runs_dropped(fd)
    finally:
        os.close(fd)
    assert [cell["n"] for cell in reversed(page.cells)] == list(range(101, 301))
    assert page.full and dropped == 7
    view = view_of_page("s", page_of(list(reversed(page.cells)), runs_dropped=dropped, more=page.full))
    assert view.runs_dropped == 7 and "older runs are not shown" in view.notes[0]


def test_a_million_one_line_runs_are_read_from_the_end_and_only_a_page_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fd, size = lines_file(tmp_path, [b'{"kind":"run"}'] * 1_150_000)
    read: list[int] = []
    pread = os.pread

    def counted(fd: int, length: int, offset: int) -> bytes:
        read.append(length)
        return pread(fd, length, offset)

    monkeypatch.setattr(os, "pread", counted)
    try:
        page = agent_page.Page(200, 1 << 20)
        agent_page.read_newest(fd, size, size, page)
    finally:
        os.close(fd)
    assert len(page.cells) == 200 and page.full and sum(read) <= agent_page.BLOCK


@pytest.mark.parametrize(
    "lines",
    [
        [b"junk"] * 100_000,  # no run at all: at most MAX_LINES looked at
        [b"x" * (3 << 20)],  # one line longer than what may be read
    ],
)
def test_a_history_of_junk_ends_the_page_at_its_bounds(tmp_path: Path, lines: list[bytes]) -> None:
    fd, size = lines_file(tmp_path, [run_line(n=1), *lines])
    try:
        page = agent_page.Page(200, 1 << 20)
        agent_page.read_newest(fd, size, 2 << 20, page)
    finally:
        os.close(fd)
    assert page.cells == [] and page.full and page.lines <= agent_page.MAX_LINES + 1


def test_a_page_stops_at_its_byte_cap(tmp_path: Path) -> None:
    fd, size = lines_file(tmp_path, [run_line(n=n, stdout="s" * 5000) for n in range(1, 101)])
    try:
        page = agent_page.Page(200, 100_000)
        agent_page.read_newest(fd, size, 1 << 30, page)
    finally:
        os.close(fd)
    assert 0 < len(page.cells) < 20 and page.full and page.used <= 100_000
    assert page.cells[0]["n"] == 100


def test_a_history_image_is_served_only_as_a_file_of_its_own(tmp_path: Path) -> None:
    image = tmp_path / "img-1-0.png"
    image.write_bytes(os.urandom(200_000))
    assert history_format.servable(image.stat())
    os.link(image, tmp_path / "img-1-1.png")
    assert not history_format.servable(image.stat())
    sparse = tmp_path / "img-2-0.png"
    with sparse.open("wb") as out:
        out.truncate(1 << 20)
    assert not history_format.servable(sparse.stat())


def test_a_missing_history_is_an_empty_notebook() -> None:
    view = view_of_page("s", page_of([], missing=True))
    assert view.cells == [] and view.notes == ["this session has not run anything yet"]


def test_table_records_are_fixed_width_and_a_bad_one_ends_the_page() -> None:
    data = b"000000000000 00000010\n000000000010 00000012\nxxxxxxxxxxxx 00000001\n000000000022 00000001\n"
    assert page_records(data, 10) == [(0, 10), (10, 12)]
    assert page_records(data, 1) == [(0, 10)]


def test_a_stored_row_keeps_scalars_and_turns_anything_else_into_short_text() -> None:
    assert row_cells(b'[1, "a", null, true, 2.5]') == [1, "a", None, True, 2.5]
    assert row_cells(b'[{"nested": [1]}, "' + b"z" * 5000 + b'"]')[0] == '{"nested": [1]}'
    assert len(str(row_cells(b'["' + b"z" * 5000 + b'"]')[0])) <= 1000
    assert row_cells(b'{"not": "a row"}') == ["(unreadable row)"]
    assert row_cells(b"[[[[") == ["(unreadable row)"]


@pytest.mark.anyio
async def test_app_only_tools_are_listed_only_to_a_client_that_declares_apps() -> None:
    apps = advertise(EXTENSION_ID, {"mimeTypes": [APP_MIME_TYPE]})
    async with running(FakeAgent(), settings()) as (service, _):
        server = build_server(service)
        async with Client(server) as plain, Client(server, extensions=[apps]) as host:
            for_plain = {tool.name: tool.meta for tool in (await plain.list_tools()).tools}
            for_host = {tool.name: tool.meta for tool in (await host.list_tools()).tools}
            view = await host.read_resource("ui://mcp-code-exec/notebook.html")
    assert set(for_host) - set(for_plain) == {"notebook_table_page", "notebook_figure"}
    assert for_host["notebook_figure"] == {
        "ui": {"resourceUri": "ui://mcp-code-exec/notebook.html", "visibility": ["app"]}
    }
    assert (for_plain["run_python"] or {})["ui"] == {"visibility": ["model"]}
    assert "view_session" in for_plain and "view_run" in for_plain
    assert view.contents[0].mime_type == APP_MIME_TYPE


@pytest.mark.anyio
async def test_one_view_per_identity_is_built_at_a_time_and_a_late_one_is_refused() -> None:
    views = notebook.OneAtATime(wait_s=0.2)
    order: list[str] = []
    release = anyio.Event()

    async def view(name: str) -> None:
        async with views.hold("alice"):
            order.append(name)
            await release.wait()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(view, "first")
        await anyio.wait_all_tasks_blocked()
        async with views.hold("bob"):  # another identity does not wait
            order.append("bob")
        with pytest.raises(ClientLimit):
            async with views.hold("alice"):
                order.append("never")
        release.set()
    assert order == ["first", "bob"] and len(views) == 0
