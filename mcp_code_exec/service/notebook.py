"""The notebook view of a session or a run: its cells, a table's pages, a figure at full size.

What a session ran comes from its history on its volume (``/mnt/data/.mcpx/history/``, written by
the agent's supervisor) and its tables from ``/mnt/data/.mcpx/tables/<id>/`` (written by the
worker: see the agent's ``worker/tables.py``). The session's own code can rewrite both, so they are
read as hostile: only through paths the server builds itself, in bounded pieces, and the only
things parsed are JSON lines of bounded length and fixed-width numbers; every field is checked and
capped, anything else is skipped. The host never sorts or converts a table (its sort orders were
written in the sandbox) and nothing here reads Arrow, Parquet or pickles.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import FileOperationError, InvalidPath, TooLarge
from ..models import ErrorInfo, FigureRef, NotebookCell, NotebookView, TablePage, TableRef
from ..sandbox.transfer import CHUNK_BYTES
from .files import FileOps
from .runs import Run

HISTORY = ".mcpx/history/runs.jsonl"
TABLES = ".mcpx/tables"
IMAGE_NAME = re.compile(r"img-[0-9]{1,9}-[0-9]{1,4}\.(png|jpeg)")
TABLE_ID = re.compile(r"[0-9a-f]{16}")
RECORD = re.compile(rb"([0-9]{12}) ([0-9]{8})\n")
RECORD_BYTES = 22
STATUSES = ("ok", "error", "timeout", "memory_limit", "crashed", "cancelled")
MAX_CELLS = 200  # the newest; older ones are counted
MAX_LINE = 4 << 20
CODE_CHARS = 20_000
STREAM_CHARS = 4_000  # head and tail each
TEXT_CHARS = 8_000
MAX_DISPLAYS = 20
MAX_FIGURES = 50
MAX_TABLES = 8
PAGE_MAX_ROWS = 200
PAGE_MAX_BYTES = 64 << 10
CELL_CHARS = 1_000


def _text(value: Any, cap: int = TEXT_CHARS) -> str:
    if not isinstance(value, str):
        return ""
    return value if len(value) <= cap else value[: cap - 1] + "…"


def _stream(value: Any) -> str:
    text = value if isinstance(value, str) else ""
    if len(text) <= 2 * STREAM_CHARS:
        return text
    cut = len(text) - 2 * STREAM_CHARS
    return f"{text[:STREAM_CHARS]}\n[… {cut} characters not shown …]\n{text[-STREAM_CHARS:]}"


def _number(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and abs(value) < 1e15
    return float(value) if ok else 0.0


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _table(value: Any) -> TableRef | None:
    if not isinstance(value, dict) or not isinstance(value.get("table"), str) or not TABLE_ID.fullmatch(value["table"]):
        return None
    columns, dtypes = value.get("columns"), value.get("dtypes")
    if not isinstance(columns, list) or not isinstance(dtypes, list) or len(columns) != len(dtypes):
        return None
    names = [_text(c, 200) for c in columns[:200]]
    return TableRef(
        table=value["table"],
        columns=names,
        dtypes=[_text(d, 200) for d in dtypes[: len(names)]],
        rows=int(_number(value.get("rows"))),
        total_rows=int(_number(value.get("total_rows"))),
        sorted_columns=min(len(names), int(_number(value.get("sorted_columns")))),
    )


def cell_of_line(raw: bytes) -> NotebookCell | int | None:
    """A history line as a cell; a header as the number of runs it says were dropped; else None."""
    if len(raw) > MAX_LINE:
        return None
    try:
        found = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(found, dict):
        return None
    if found.get("kind") == "header":
        return int(_number(found.get("runs_dropped")))
    if found.get("kind") != "run":
        return None
    n = int(_number(found.get("n")))
    error = found.get("error")
    images = _list(found.get("images"))
    figures = [
        FigureRef(cell=n, index=k, mime_type="image/png" if image["file"].endswith(".png") else "image/jpeg")
        for k, image in enumerate(images[:MAX_FIGURES])
        if isinstance(image, dict) and isinstance(image.get("file"), str) and IMAGE_NAME.fullmatch(image["file"])
    ]
    displays, tables = _list(found.get("displays")), _list(found.get("tables"))
    return NotebookCell(
        n=n,
        at=_number(found.get("at")) or None,
        code=_text(found.get("code"), CODE_CHARS),
        status=found["status"] if found.get("status") in STATUSES else "error",
        duration_ms=_number(found.get("duration_ms")),
        stdout=_stream(found.get("stdout")),
        stderr=_stream(found.get("stderr")),
        result=_text(found["result"]) if isinstance(found.get("result"), str) else None,
        displays=[_text(d) for d in displays[:MAX_DISPLAYS] if isinstance(d, str)],
        error=ErrorInfo(
            type=_text(error.get("type"), 200) or "Error",
            message=_text(error.get("message")),
            traceback=_stream(error.get("traceback")),
        )
        if isinstance(error, dict)
        else None,
        figures=figures,
        tables=[ref for ref in map(_table, tables[:MAX_TABLES]) if ref is not None],
        outputs_dropped=found.get("outputs_dropped") is True,
    )


def cells_of_history(data: bytes) -> tuple[list[NotebookCell], int]:
    """The cells of a history file's bytes (the newest ``MAX_CELLS``), and the runs it says were dropped."""
    cells: list[NotebookCell] = []
    dropped = 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        found = cell_of_line(line)
        if isinstance(found, NotebookCell):
            cells.append(found)
        elif isinstance(found, int):
            dropped += max(0, found)
    return cells, dropped


def cell_of_run(run: Run) -> NotebookCell:
    """A run as one cell, from the host's own record of it (a stateless run's images went out with its
    result and are not kept)."""
    result = run.result
    assert result is not None
    return NotebookCell(
        n=1,
        run_id=run.id,
        code=_text(run.code, CODE_CHARS),
        status=result.status,
        duration_ms=result.duration_ms,
        stdout=_stream(result.stdout),
        stderr=_stream(result.stderr),
        result=result.result,
        displays=[_text(d) for d in result.displays[:MAX_DISPLAYS]],
        error=result.error,
        figures=[FigureRef(cell=1, index=k, mime_type="image/png", available=False) for k in range(result.image_count)],
        tables=result.tables,
    )


def page_records(data: bytes, rows: int) -> list[tuple[int, int]]:
    """Fixed-width ``(offset, length)`` records, each checked (a bad one ends the page)."""
    found: list[tuple[int, int]] = []
    for at in range(0, len(data) - RECORD_BYTES + 1, RECORD_BYTES):
        match = RECORD.fullmatch(data[at : at + RECORD_BYTES])
        if match is None:
            break
        found.append((int(match[1]), int(match[2])))
    return found[:rows]


def row_cells(raw: bytes) -> list[str | int | float | bool | None]:
    """One stored row: a JSON array of scalars (anything else in it becomes a short string)."""
    try:
        found = json.loads(raw)
    except (ValueError, RecursionError):
        return ["(unreadable row)"]
    if not isinstance(found, list):
        return ["(unreadable row)"]
    cells: list[str | int | float | bool | None] = []
    for value in found[:200]:
        if value is None or isinstance(value, bool | int | float):
            cells.append(value)
        else:
            cells.append(_text(value if isinstance(value, str) else json.dumps(value)[:CELL_CHARS], CELL_CHARS))
    return cells


class Notebook:
    """Reads what the view shows, for its owner only."""

    def __init__(self, files: FileOps, history_max_bytes: int) -> None:
        self.files = files
        self.history_read_max = history_max_bytes + (1 << 20)  # what the agent keeps, and a little junk

    async def session_view(self, owner: str, session_id: str) -> NotebookView:
        size, _ = await self.files.read_ranges(owner, session_id, HISTORY, [])
        start = max(0, size - self.history_read_max)
        ranges = [(at, min(CHUNK_BYTES, size - at)) for at in range(start, size, CHUNK_BYTES)]
        _, pieces = await self.files.read_ranges(owner, session_id, HISTORY, ranges)
        data = b"".join(pieces)
        if start:
            data = data[data.find(b"\n") + 1 :]  # the first line read is only the end of one
        cells, dropped = cells_of_history(data)
        omitted = max(0, len(cells) - MAX_CELLS)
        notes = ["the history's start is not shown: it is larger than the history's cap"] if start else []
        return NotebookView(
            session_id=session_id, cells=cells[omitted:], runs_dropped=dropped, cells_omitted=omitted, notes=notes
        )

    async def session_view_or_empty(self, owner: str, session_id: str) -> NotebookView:
        """A session that has run nothing yet (no history file) is an empty notebook."""
        try:
            return await self.session_view(owner, session_id)
        except FileOperationError as exc:
            if "no such file" not in str(exc):
                raise
            return NotebookView(session_id=session_id, cells=[], notes=["this session has not run anything yet"])

    async def figure(self, owner: str, session_id: str, cell: int, index: int, max_bytes: int) -> tuple[bytes, str]:
        """A figure of the session's history, at the size the run drew it."""
        for extension, mime in (("png", "image/png"), ("jpeg", "image/jpeg")):
            path = f".mcpx/history/img-{cell}-{index}.{extension}"
            if not IMAGE_NAME.fullmatch(path.rsplit("/", 1)[1]):
                raise InvalidPath("no such figure")
            try:
                size, _ = await self.files.read_ranges(owner, session_id, path, [])
            except FileOperationError:
                continue
            if size > max_bytes:
                raise TooLarge(f"the figure is {size} bytes, over the cap of {max_bytes}")
            ranges = [(at, min(CHUNK_BYTES, size - at)) for at in range(0, size, CHUNK_BYTES)]
            _, pieces = await self.files.read_ranges(owner, session_id, path, ranges)
            return b"".join(pieces), mime
        raise FileOperationError(f"no figure {index} in cell {cell} (the history's cap may have dropped it)")

    async def table_page(
        self, owner: str, session_id: str, table: str, offset: int, limit: int, sort: int | None, descending: bool
    ) -> TablePage:
        """Rows ``offset`` to ``offset + limit`` (at most ``PAGE_MAX_ROWS`` and ``PAGE_MAX_BYTES``), in
        stored order or in the order of column ``sort``."""
        if not TABLE_ID.fullmatch(table):
            raise InvalidPath("no such table")
        offset, limit = max(0, offset), max(1, min(limit, PAGE_MAX_ROWS))
        order = "index" if sort is None else f"sort-{int(sort)}"
        folder = f"{TABLES}/{table}"
        size, _ = await self.files.read_ranges(owner, session_id, f"{folder}/{order}", [])
        total = size // RECORD_BYTES
        first = offset if not descending else max(0, total - offset - limit)
        count = max(0, min(limit, total - offset))
        _, pieces = await self.files.read_ranges(
            owner, session_id, f"{folder}/{order}", [(first * RECORD_BYTES, count * RECORD_BYTES)]
        )
        records = page_records(pieces[0], count)
        if descending:
            records.reverse()
        wanted, used, truncated = [], 0, False
        for start, length in records:
            if used + length > PAGE_MAX_BYTES:
                truncated = True
                break
            wanted.append((start, length))
            used += length
        _, rows = await self.files.read_ranges(owner, session_id, f"{folder}/rows.jsonl", wanted)
        return TablePage(
            table=table,
            offset=offset,
            rows=[row_cells(raw) for raw in rows],
            total=total,
            sort=sort,
            descending=descending,
            truncated=truncated,
        )
