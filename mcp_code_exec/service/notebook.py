"""The notebook view of a session or a run: its cells, a table's pages, a figure at full size.

What a session ran is its history on its volume (``/mnt/data/.mcpx/history/``, written by the
agent's supervisor), and its tables are under ``/mnt/data/.mcpx/tables/<id>/`` (written by the
worker: see the agent's ``worker/tables.py``). The session's own code can rewrite both, so the host
never reads the history file: the agent builds the view's page in the sandbox, on the sandbox's
time, reading from the end of the file within bounds the host sets (``ReadHistoryPage``), and the
host only validates what comes back (``HistoryPage``: a bounded frame, every field capped, refused
whole otherwise). One view per identity is built at a time. Tables and figures are read only
through paths the server builds itself, in bounded pieces; the only things parsed are short JSON
lines and fixed-width numbers. A figure must be the image it claims to be. The host never sorts or
converts a table (its sort orders were written in the sandbox) and nothing here reads Arrow,
Parquet or pickles.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from ..errors import ClientLimit, FileOperationError, InvalidPath, TooLarge
from ..models import ErrorInfo, FigureRef, NotebookCell, NotebookView, TablePage, TableRef, Usage
from ..protocol import messages as wire
from ..protocol.frames import image_size
from ..sandbox.transfer import CHUNK_BYTES
from .files import FileOps
from .run_registry import Run

TABLES = ".mcpx/tables"
IMAGE_NAME = re.compile(r"img-[0-9]{1,9}-[0-9]{1,4}\.(png|jpeg)")
TABLE_ID = re.compile(r"[0-9a-f]{16}")
RECORD = re.compile(rb"([0-9]{12}) ([0-9]{8})\n")
RECORD_BYTES = 22
VIEW_CELLS = 200  # the newest; older ones are said to be left out
VIEW_BYTES = 2 << 20  # of the page's JSON, as the agent sends it
VIEW_WAIT_S = 10.0  # for the identity's previous view, then for a session another call holds
CODE_CHARS = 20_000
STREAM_CHARS = 4_000  # head and tail each
TEXT_CHARS = 8_000
MAX_DISPLAYS = 20
PAGE_MAX_ROWS = 200
PAGE_MAX_BYTES = 64 << 10
CELL_CHARS = 1_000
ROW_TOO_LARGE = "(a row over the page's size cap: not shown)"


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


def cell_of_page(cell: wire.PageCell) -> NotebookCell:
    """A checked history page's cell as the view's (its fields were capped by the page's model)."""
    error = cell.error
    return NotebookCell(
        n=cell.n,
        at=cell.at,
        code=cell.code,
        status=cell.status,
        duration_ms=cell.duration_ms,
        stdout=cell.stdout,
        stderr=cell.stderr,
        result=cell.result,
        displays=list(cell.displays),
        error=ErrorInfo(type=error.type, message=error.message, traceback=error.traceback) if error else None,
        figures=[FigureRef(cell=cell.n, index=k, mime_type=mime) for k, mime in enumerate(cell.figures)],
        tables=[TableRef(**table.model_dump()) for table in cell.tables],
        outputs_dropped=cell.outputs_dropped,
        usage=Usage(**cell.usage.model_dump()) if cell.usage is not None else None,
    )


def view_of_page(session_id: str, page: wire.HistoryPage) -> NotebookView:
    if page.missing:
        return NotebookView(session_id=session_id, cells=[], notes=["this session has not run anything yet"])
    notes = []
    if page.more:
        notes.append(f"older runs are not shown: the view shows the newest {len(page.cells)} that fit its size")
    return NotebookView(
        session_id=session_id,
        cells=[cell_of_page(cell) for cell in page.cells],
        runs_dropped=page.runs_dropped,
        cells_omitted=0,
        notes=notes,
    )


class OneAtATime:
    """One holder per key at once: the others wait their turn at most ``wait_s``, then are refused. A
    key nobody holds or waits for is forgotten."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._locks: dict[str, tuple[anyio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (anyio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            acquired = False
            with anyio.move_on_after(self.wait_s):
                await lock.acquire()
                acquired = True
            if not acquired:
                raise ClientLimit(f"another view of yours took over {self.wait_s:.0f} s; retry once it is shown")
            try:
                yield
            finally:
                lock.release()
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


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
        usage=result.usage,
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
        self.viewing = OneAtATime(VIEW_WAIT_S)

    async def session_view(self, owner: str, session_id: str) -> NotebookView:
        """The newest cells of the session's history, from the page its agent builds (one view per
        identity at a time)."""
        request = wire.ReadHistoryPage(max_cells=VIEW_CELLS, max_bytes=VIEW_BYTES, read_max=self.history_read_max)
        async with self.viewing.hold(owner):
            page = await self.files.ask(owner, session_id, request, wire.HistoryPage, busy_wait_s=VIEW_WAIT_S)
        return view_of_page(session_id, page)

    async def figure(self, owner: str, session_id: str, cell: int, index: int, max_bytes: int) -> tuple[bytes, str]:
        """A figure of the session's history, at the size the run drew it."""
        for extension, mime in (("png", "image/png"), ("jpeg", "image/jpeg")):
            path = f".mcpx/history/img-{cell}-{index}.{extension}"
            if not IMAGE_NAME.fullmatch(path.rsplit("/", 1)[1]):
                raise InvalidPath("no such figure")
            try:
                size, _ = await self.files.read_ranges(owner, session_id, path, [])
            except FileOperationError as exc:
                if "no such file" in str(exc):
                    continue  # the other extension, then
                raise
            if size > max_bytes:
                raise TooLarge(f"the figure is {size} bytes, over the cap of {max_bytes}")
            ranges = [(at, min(CHUNK_BYTES, size - at)) for at in range(0, size, CHUNK_BYTES)]
            _, pieces = await self.files.read_ranges(owner, session_id, path, ranges)
            data = b"".join(pieces)
            if image_size(mime, data) is None:
                raise FileOperationError(f"figure {index} of cell {cell} is not a {mime} image")
            return data, mime
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
        shown = [row_cells(raw) for raw in rows]
        if truncated and not shown:  # a row alone over the cap: said, so that the next page moves on
            shown = [[ROW_TOO_LARGE]]
        return TablePage(
            table=table,
            offset=offset,
            rows=shown,
            total=total,
            sort=sort,
            descending=descending,
            truncated=truncated,
        )
