"""The notebook view (MCP Apps): ``view_session`` and ``view_run`` for the model and the view, the
view's own tools (a table's page, a figure at full size), and the view itself as a ``ui://`` resource.

Hosts that render MCP Apps show ``ui://mcp-code-exec/notebook.html`` beside the conversation; the
model still gets a short text summary. The view's tools are app-only (``_meta.ui.visibility =
["app"]``): hosts do not show them to the model, and ``tools/list`` leaves them out for clients that
do not declare the Apps extension (``sdk.SandboxServer``). Every other tool is marked model-only, so
a host refuses the view any call that runs code or changes files. Each tool checks the caller's
identity like every other tool.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Annotated, Any

from mcp.server.apps import Apps
from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, ImageContent, TextContent, ToolAnnotations
from pydantic import Field

from ..models import NotebookView, TablePage
from ..service.notebook import PAGE_MAX_ROWS, cell_of_run
from ..service.port import ServicePort
from .identity import owner_of
from .sdk import SandboxServer

VIEW_URI = "ui://mcp-code-exec/notebook.html"
VIEW_HTML = Path(__file__).with_name("notebook.html")
READING = ToolAnnotations(read_only_hint=True, open_world_hint=False)
FOR_BOTH = {"ui": {"resourceUri": VIEW_URI, "visibility": ["model", "app"]}}
FOR_APP = {"ui": {"resourceUri": VIEW_URI, "visibility": ["app"]}}
FOR_MODEL = {"ui": {"visibility": ["model"]}}


def view_extension() -> Apps:
    """The Apps extension with the view's HTML (one self-contained file: the spec's default CSP, no
    network at all, holds)."""
    apps = Apps()
    apps.add_html_resource(
        VIEW_URI,
        VIEW_HTML.read_text(encoding="utf-8"),
        name="notebook",
        title="Notebook view of a session",
        description="A session's cells with their output, figures and tables",
        prefers_border=True,
    )
    return apps


def summary(view: NotebookView) -> str:
    """What the model reads: one line a cell (its figures and tables named), never the data."""
    where = f"session {view.session_id}" if view.session_id else f"run {view.run_id}"
    lines = [f"Notebook view of {where}: {len(view.cells)} cell(s) (shown to the user where the host renders it)."]
    if view.runs_dropped or view.cells_omitted:
        lines.append(f"{view.runs_dropped + view.cells_omitted} older run(s) not shown.")
    for cell in view.cells[-50:]:
        first = next((line for line in cell.code.splitlines() if line.strip()), "")[:80]
        extra = [f"{len(cell.figures)} figure(s)"] if cell.figures else []
        extra += [f"table {t.table} ({t.total_rows} rows x {len(t.columns)} columns)" for t in cell.tables]
        lines.append(
            f"[{cell.n}] {cell.status} {cell.duration_ms:.0f} ms: {first}"
            + (f" -> {', '.join(extra)}" if extra else "")
        )
    return "\n".join([*lines, *view.notes])


def view_result(view: NotebookView) -> CallToolResult:
    return CallToolResult(content=[TextContent(text=summary(view))], structured_content=view.model_dump(mode="json"))


class NotebookTools:
    def __init__(self, server: SandboxServer, service: ServicePort) -> None:
        self.server = server
        self.service = service

    def register(self, wrap: Any) -> None:
        """``wrap``: the tools' error mapping and log line (``tools.tool_errors``)."""
        for name, fn, title, description, meta in (
            ("view_session", self.view_session, "View session", VIEW_SESSION, FOR_BOTH),
            ("view_run", self.view_run, "View run", VIEW_RUN, FOR_BOTH),
            ("notebook_table_page", self.table_page, "Table page", TABLE_PAGE, FOR_APP),
            ("notebook_figure", self.figure, "Figure", FIGURE, FOR_APP),
        ):
            self.server.tool(name=name, title=title, description=description, annotations=READING, meta=meta)(wrap(fn))

    async def view_session(
        self, session_id: Annotated[str, Field(description="The session to show")], ctx: Context
    ) -> Annotated[CallToolResult, NotebookView]:
        view = await self.service.notebook.session_view(owner_of(ctx), session_id)
        return view_result(view)

    async def view_run(
        self, run_id: Annotated[str, Field(description="The run to show (a stateless run's run_id)")], ctx: Context
    ) -> Annotated[CallToolResult, NotebookView]:
        run = self.service.get_run(owner_of(ctx), run_id)
        if run.result is None:
            view = NotebookView(run_id=run_id, cells=[], notes=["the run is still going; view it once it ends"])
        else:
            view = NotebookView(run_id=run_id, session_id=run.session_id, cells=[cell_of_run(run)])
        return view_result(view)

    async def table_page(
        self,
        session_id: Annotated[str, Field(description="The session that showed the table")],
        table: Annotated[str, Field(description="The table's id, from view_session")],
        ctx: Context,
        offset: Annotated[int | None, Field(ge=0, description="The first row (default 0)")] = None,
        limit: Annotated[int | None, Field(ge=1, le=PAGE_MAX_ROWS, description="Rows (default 50)")] = None,
        sort: Annotated[int | None, Field(ge=0, le=199, description="Sort on this column")] = None,
        descending: bool | None = None,
    ) -> TablePage:
        return await self.service.notebook.table_page(
            owner_of(ctx), session_id, table, offset or 0, limit or 50, sort, bool(descending)
        )

    async def figure(
        self,
        session_id: Annotated[str, Field(description="The session whose cell drew it")],
        cell: Annotated[int, Field(ge=0, lt=10**9, description="The cell's number")],
        index: Annotated[int, Field(ge=0, lt=10_000, description="The figure's place in the cell, from 0")],
        ctx: Context,
    ) -> CallToolResult:
        cap = self.service.config.limits.max_image_bytes
        data, mime = await self.service.notebook.figure(owner_of(ctx), session_id, cell, index, cap)
        return CallToolResult(content=[ImageContent(data=base64.b64encode(data).decode(), mime_type=mime)])


VIEW_SESSION = (
    "Show a session as a notebook: each cell's code, output, errors, figures and tables. Hosts that render "
    "MCP Apps show it to the user as a live view (figures at full size, tables that page and sort); you get a "
    "short summary of the cells. Use it when the user wants to see the work."
)
VIEW_RUN = "Show one run (for example a stateless run, by its run_id) as a notebook cell, like view_session."
TABLE_PAGE = "For the notebook view: rows of a table a session showed (at most 200 rows and 64 KiB a page)."
FIGURE = "For the notebook view: a figure of a session's cell at the size it was drawn."
