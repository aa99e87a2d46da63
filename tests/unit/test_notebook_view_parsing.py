"""The notebook view without Docker: a session's history and tables read as hostile bytes, and the
per-caller tool listing over the in-memory transport (the table frame: test_protocol_halves)."""

from __future__ import annotations

import json

import pytest
from _fake_agent import FakeAgent
from mcp import Client
from mcp.client.extension import advertise
from mcp.server.apps import APP_MIME_TYPE, EXTENSION_ID
from test_service_in_memory import running, settings

from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.models import NotebookCell
from mcp_code_exec.service.notebook import STREAM_CHARS, cell_of_line, cells_of_history, page_records, row_cells

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


def test_a_history_line_becomes_a_cell_with_its_outputs_capped() -> None:
    line = run_line(stdout="a" * 100_000, result="2", displays=["d"], images=[{"file": "img-1-0.png"}], tables=[TABLE])
    cell = cell_of_line(line)
    assert isinstance(cell, NotebookCell)
    assert len(cell.stdout) < 2 * STREAM_CHARS + 100 and "characters not shown" in cell.stdout
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
    assert cell_of_line(line) is None


def test_hostile_fields_are_checked_one_by_one_and_the_rest_of_the_run_kept() -> None:
    line = run_line(
        status="pwned",
        n="7",
        images=[{"file": "../../etc/passwd"}, {"file": "img-1-1.png"}, "x"],
        tables=[{**TABLE, "table": "../x"}, {**TABLE, "columns": ["a"]}, 5],
        error={"type": 5, "message": "m", "traceback": ["not", "text"]},
        displays=[1, "kept"],
    )
    cell = cell_of_line(line)
    assert isinstance(cell, NotebookCell)
    assert (cell.status, cell.n, cell.displays, cell.tables) == ("error", 0, ["kept"], [])
    assert [f.index for f in cell.figures] == [1]
    assert cell.error is not None and (cell.error.type, cell.error.traceback) == ("Error", "")


def test_a_history_counts_dropped_runs_and_skips_junk_between_cells() -> None:
    data = b"\n".join([b'{"kind": "header", "runs_dropped": 3}', run_line(n=4), b"\x00\xff junk", run_line(n=5)])
    cells, dropped = cells_of_history(data)
    assert [cell.n for cell in cells] == [4, 5] and dropped == 3


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
