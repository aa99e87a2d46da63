"""Every request the host sends the agent, and every event the agent may send back.

Requests are built from these models; events are parsed into them (strict types, no unknown
fields, bounded strings and lists), so a malformed or forged frame fails here, in one place, as
``ProtocolViolation``. The agent builds exactly these shapes (``mcpx_agent/events.py``, one builder
per event); the unit tier sends every builder's output through ``parse_event``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ..errors import ProtocolViolation
from ..models import RestoreOutcome
from .frames import MAX_CALL_NAME, encode

TEXT_MAX = 4 << 20  # no single text field of a well-formed event comes near this (the caps are far lower)
NAME_MAX = 4096
LIST_MAX = 10_000

Text = Annotated[str, Field(max_length=TEXT_MAX)]
Name = Annotated[str, Field(max_length=NAME_MAX)]
Count = Annotated[int, Field(ge=0)]
RunStatus = Literal["ok", "error", "timeout", "memory_limit", "crashed", "cancelled"]
Truncatable = Literal["stdout", "stderr", "result", "displays", "images", "traceback"]


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ToolParam(Wire):
    name: Name
    required: bool
    type: Name | None = None  # the JSON Schema type, when it names one


class ToolSpec(Wire):
    """One upstream tool as sandbox code sees it: ``mcp_tools.<server>.<name>(**arguments)``."""

    server: Name  # the configured server's name (an identifier)
    name: Name  # the tool's name made an identifier
    tool: Name  # the tool's own name, as sent upstream
    description: Text = ""
    params: Annotated[list[ToolParam], Field(max_length=256)] = []
    structured: bool = False  # it has an output schema: calls return its structured content
    open: bool = False  # its input schema takes other properties than those listed


class RunOptions(Wire):
    """How a run is capped and what it keeps; fixed for a service's life, sent with every run."""

    max_output_bytes: int
    max_result_bytes: int
    max_display_bytes: int
    max_displays: int
    max_images: int
    max_image_bytes: int
    max_image_pixels: int
    keep_originals: bool = False
    data_quota_bytes: int | None = None
    data_quota_files: int | None = None
    # The session's own filesystem holds it to the quota: the agent's count still says when it is
    # over, but never sheds files as for a flood (none can get past the filesystem).
    disk_enforced: bool = False
    collect_bytes: int = 0
    collect_file_bytes: int = 0
    collect_files: int = 100
    install: list[str] | None = None  # requirements the worker installs (offline) before the cell
    # Sessions: after the cell, the worker snapshots its namespace in the background (a forked child
    # writes /mnt/data/.mcpx/snapshot/ atomically; the next cell does not wait for it), unless the
    # namespace pickles to more than this many bytes (then the next result's notes say so, naming
    # the largest names). None: no snapshot (stateless runs, or snapshots turned off).
    snapshot_max_bytes: int | None = None
    # Sessions: append this run to the session's history on its volume (/mnt/data/.mcpx/history/:
    # code, streams, value, displays, images, error), keeping at most this many bytes of it (the
    # oldest outputs dropped first, and said so in the history). None: no history.
    history_max_bytes: int | None = None
    # Code mode: the upstream tools this run's caller may call (``import mcp_tools``; None: no module),
    # and how many calls it may make (the worker refuses those past it itself).
    tools: Annotated[list[ToolSpec], Field(max_length=LIST_MAX)] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    # Egress: the run's HTTP_PROXY (its grant; None: no egress) and its container's key (the relay's alone).
    egress_proxy: Annotated[str, Field(max_length=4096)] | None = None
    egress_key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None


# -- host -> agent ----------------------------------------------------------------------------------
class Request(Wire):
    """A request, and what the agent may answer it with: one event of ``answered_by`` (the events'
    ``ev``), or, for a run, its stream (``after``). The channel refuses any other event for it from
    the event's first bytes, before parsing it (``sandbox/channel.py``)."""

    op: str
    id: int = 0
    answered_by: ClassVar[frozenset[str]] = frozenset()  # none: it is not answered (it names a run's id)

    def frame(self, payload: bytes = b"") -> bytes:
        return encode(self.model_dump(mode="json", exclude_none=True), payload)

    def answers(self) -> frozenset[str]:  # what the agent may answer it with first
        return self.answered_by

    def after(self, kind: str) -> frozenset[str]:
        """What the agent may send for this request once it has sent an event of ``kind``."""
        return frozenset()

    def payload_caps(self) -> dict[str, int]:
        """The most each kind of its answers may carry, where less than the kind's own cap."""
        return {}


class Exec(Request):
    """Run a cell; its code is the payload (UTF-8), so no JSON escaping can inflate it."""

    op: Literal["exec"] = "exec"
    mode: Literal["stateless", "session"]
    timeout: float
    stream: bool
    options: RunOptions
    # What the cell shows and calls, as it runs; then its done (or a refusal), and a stateless run's clean.
    answered_by: ClassVar[frozenset[str]] = frozenset(
        {"output", "image", "display", "table", "tool_call", "done", "error"}
    )

    def answers(self) -> frozenset[str]:  # output only when it is to be streamed (otherwise the done holds it)
        return self.answered_by if self.stream else self.answered_by - {"output"}

    def after(self, kind: str) -> frozenset[str]:
        if kind in ("done", "clean"):  # an error after them: the clean-up failed (the container goes)
            return frozenset({"clean", "error"} if kind == "done" else {"error"})
        return frozenset() if kind == "error" else self.answers()

    def payload_caps(self) -> dict[str, int]:
        return {"image": self.options.max_image_bytes, "done": self.options.collect_bytes}


class Interrupt(Request):
    op: Literal["interrupt"] = "interrupt"


class Ping(Request):
    op: Literal["ping"] = "ping"
    answered_by: ClassVar[frozenset[str]] = frozenset({"pong", "error"})


class ListFiles(Request):
    op: Literal["list_files"] = "list_files"
    path: str
    limit: int
    answered_by: ClassVar[frozenset[str]] = frozenset({"listing", "error"})


class ReadChunk(Request):
    """Up to ``length`` bytes of a file from ``offset`` (the file is opened afresh for each chunk)."""

    op: Literal["read_chunk"] = "read_chunk"
    path: str
    offset: int
    length: int
    answered_by: ClassVar[frozenset[str]] = frozenset({"chunk", "error"})

    def payload_caps(self) -> dict[str, int]:
        return {"chunk": self.length}


class WriteChunk(Request):
    """The payload appended to upload ``upload``'s staging file at ``offset`` (where the last chunk
    ended; 0 begins the upload); ``final`` puts the file in place. The quota is checked per chunk,
    and against ``total`` (the announced size) when the upload begins."""

    op: Literal["write_chunk"] = "write_chunk"
    upload: str
    path: str
    offset: int
    final: bool
    total: int | None = None
    data_quota_bytes: int | None = None
    data_quota_files: int | None = None
    answered_by: ClassVar[frozenset[str]] = frozenset({"staged", "written", "error"})


class Restore(Request):
    """Load the session's last snapshot into the session worker's namespace (inside the sandbox, as
    the sandbox user), before anything else runs there. Answered by ``Restored`` (also when there
    is no snapshot, or it cannot be read: the session then goes on empty, and the note says why)."""

    op: Literal["restore"] = "restore"
    answered_by: ClassVar[frozenset[str]] = frozenset({"restored", "error"})


class SnapshotSync(Request):
    """Wait (up to ``timeout``) until the background snapshot, if one is being written, is complete:
    before a session's container is given back (pause) or its volume copied (fork). Answered by
    ``SnapshotSynced``."""

    op: Literal["snapshot_sync"] = "snapshot_sync"
    timeout: float
    answered_by: ClassVar[frozenset[str]] = frozenset({"snapshot", "error"})


class Variables(Request):
    """The session namespace's user variables: name, type, a short repr (capped in ``repr_chars``
    and in time), size or shape where known; at most ``limit``. Answered by ``VariableList``."""

    op: Literal["variables"] = "variables"
    limit: int
    repr_chars: int
    answered_by: ClassVar[frozenset[str]] = frozenset({"variables", "error"})


class ExportNotebook(Request):
    """Write the session's history as a Jupyter notebook (nbformat 4.5) to ``path`` under /mnt/data
    (built inside the sandbox from the newest ``read_max`` bytes of the history, within bounds of its
    own). Answered by ``Written``, or ``Failure``."""

    op: Literal["export_notebook"] = "export_notebook"
    path: str
    data_quota_bytes: int | None = None
    data_quota_files: int | None = None
    read_max: int | None = None  # bytes read from the end of the history (None: the agent's default)
    answered_by: ClassVar[frozenset[str]] = frozenset({"written", "error"})


class ReadHistoryPage(Request):
    """The newest runs of the session's history, as the notebook view shows them: built in the
    sandbox from the end of the file (at most ``read_max`` bytes read), at most ``max_cells`` cells
    and ``max_bytes`` of JSON. Answered by ``HistoryPage``."""

    op: Literal["history_page"] = "history_page"
    max_cells: int
    max_bytes: int
    read_max: int
    answered_by: ClassVar[frozenset[str]] = frozenset({"history_page", "error"})


class AbortUpload(Request):
    """Drop an upload and its staging file (an unknown one is already gone: answered the same)."""

    op: Literal["abort_upload"] = "abort_upload"
    upload: str
    answered_by: ClassVar[frozenset[str]] = frozenset({"dropped", "error"})


class ToolReply(Request):
    """The answer to a tool call of the running cell: ``ok`` with the value as JSON in the payload,
    or the kind of error (the sandbox's exception) with ``{"message": ...}``."""

    op: Literal["tool_result"] = "tool_result"
    call: int
    ok: bool
    error: Literal["tool", "denied", "budget", "timeout", "unavailable", "argument"] | None = None


class ToolPause(Request):
    """Stop (``paused``) or restart the run's clock: a call waits for a human's approval."""

    op: Literal["tool_pause"] = "tool_pause"
    paused: bool


# -- agent -> host ----------------------------------------------------------------------------------
class Ready(Wire):
    ev: Literal["ready"]
    agent_version: int
    python: Name


class Pong(Wire):
    ev: Literal["pong"]
    id: int
    oom_kills: int | None


class Output(Wire):
    ev: Literal["output"]
    id: int
    stream: Literal["stdout", "stderr"]
    text: Text


class Image(Wire):
    ev: Literal["image"]
    id: int
    mime: Literal["image/png", "image/jpeg"]
    width: Count
    height: Count
    note: Name | None = None


class Display(Wire):
    ev: Literal["display"]
    id: int
    text: Text


class Table(Wire):
    """A DataFrame or Series a run showed, kept under ``/mnt/data/.mcpx/tables/<table>/`` for the
    notebook view (its files are read only in bounded pieces: see ``service/notebook_files``)."""

    ev: Literal["table"]
    id: int
    table: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    columns: Annotated[list[Annotated[str, Field(max_length=200)]], Field(max_length=200)]
    dtypes: Annotated[list[Annotated[str, Field(max_length=200)]], Field(max_length=200)]
    rows: Annotated[int, Field(ge=0, le=10_000)]
    total_rows: Count
    sorted_columns: Annotated[int, Field(ge=0, le=200)]


class Error(Wire):
    type: Name
    message: Text
    traceback: Text = ""
    line: int | None = None
    column: int | None = None


class FileEntry(Wire):
    path: Name
    size: Count
    modified: float
    new: bool = True
    offset: Count | None = None
    length: Count | None = None
    note: Name | None = None


class RunUsage(Wire):
    """What a run cost, as the agent measured it (``meter.RunMeter``)."""

    cpu_user_s: Annotated[float, Field(allow_inf_nan=False, ge=0, lt=1e15)]
    cpu_system_s: Annotated[float, Field(allow_inf_nan=False, ge=0, lt=1e15)]
    peak_memory_bytes: Count | None = None
    data_written_bytes: Count = 0
    packages_installed: Count = 0
    tool_calls: Count = 0


class Done(Wire):
    ev: Literal["done"]
    id: int
    status: RunStatus
    result: Text | None
    error: Error | None
    stdout: Text
    stderr: Text
    truncated: Annotated[list[Truncatable], Field(max_length=16)]
    session_restarted: bool
    duration_ms: float
    files: Annotated[list[FileEntry], Field(max_length=LIST_MAX)]
    notes: Annotated[list[Name], Field(max_length=16)]
    recycle: bool
    usage: RunUsage | None = None  # agents before version 6 send none


class Clean(Wire):
    """After a stateless run: every process of the sandbox user is gone and everything is wiped."""

    ev: Literal["clean"]
    id: int
    ok: bool
    problems: Annotated[list[Name], Field(max_length=16)]


class ListedEntry(Wire):
    path: Name
    size: Count
    is_dir: bool
    is_symlink: bool
    modified: float


class Listing(Wire):
    ev: Literal["listing"]
    id: int
    entries: Annotated[list[ListedEntry], Field(max_length=LIST_MAX)]
    truncated: bool


class Chunk(Wire):
    """Part of a file; its bytes are the payload. ``size`` and ``mtime_ns`` are the file's, so the
    host can tell a file that changes between chunks."""

    ev: Literal["chunk"]
    id: int
    path: Name
    offset: Count
    size: Count
    modified: float
    mtime_ns: Count


class Staged(Wire):
    ev: Literal["staged"]
    id: int
    upload: Name
    size: Count


class Dropped(Wire):
    ev: Literal["dropped"]
    id: int
    upload: Name


class Written(Wire):
    ev: Literal["written"]
    id: int
    path: Name
    size: Count
    modified: float


class Restored(Wire):
    """How a restore went: ``restored`` names loaded, ``skipped`` those the snapshot could not keep
    or load (each "name (why)"), and ``note`` the sentence for the run's notes."""

    ev: Literal["restored"]
    id: int
    outcome: RestoreOutcome
    restored: Count
    skipped: Annotated[list[Name], Field(max_length=1000)]
    note: Name
    taken_at: float | None = None  # when the snapshot was written (epoch seconds)


class SnapshotSynced(Wire):
    ev: Literal["snapshot"]
    id: int
    complete: bool  # no snapshot is being written now
    taken_at: float | None = None  # the last complete snapshot's time, if any
    size: Count | None = None


class VariableInfo(Wire):
    name: Name
    type: Name
    repr: Name
    size: Count | None = None  # bytes, where known
    shape: Annotated[list[Count], Field(max_length=32)] | None = None


class VariableList(Wire):
    ev: Literal["variables"]
    id: int
    variables: Annotated[list[VariableInfo], Field(max_length=LIST_MAX)]
    truncated: bool


# A history page's cell: every field capped as the agent caps it (``supervisor/history_page``), so a
# page that is not one is refused whole, like any forged frame.
PAGE_CODE_CHARS = 20_000
PAGE_STREAM_CHARS = 2 * 4_000 + 64  # head and tail, and the line between them
PAGE_TEXT_CHARS = 8_000
PAGE_NAME_CHARS = 200
PAGE_MAX_CELLS = 1000
Finite = Annotated[float, Field(allow_inf_nan=False, ge=0, lt=1e15)]
PageName = Annotated[str, Field(max_length=PAGE_NAME_CHARS)]


class PageTable(Wire):
    table: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    columns: Annotated[list[PageName], Field(max_length=200)]
    dtypes: Annotated[list[PageName], Field(max_length=200)]
    rows: Annotated[int, Field(ge=0, lt=10**15)]
    total_rows: Annotated[int, Field(ge=0, lt=10**15)]
    sorted_columns: Annotated[int, Field(ge=0, le=200)]


class PageError(Wire):
    type: PageName
    message: Annotated[str, Field(max_length=PAGE_TEXT_CHARS)]
    traceback: Annotated[str, Field(max_length=PAGE_STREAM_CHARS)]


class PageCell(Wire):
    n: Annotated[int, Field(ge=0, lt=10**9)]
    at: Finite | None
    code: Annotated[str, Field(max_length=PAGE_CODE_CHARS)]
    status: RunStatus
    duration_ms: Finite
    stdout: Annotated[str, Field(max_length=PAGE_STREAM_CHARS)]
    stderr: Annotated[str, Field(max_length=PAGE_STREAM_CHARS)]
    result: Annotated[str, Field(max_length=PAGE_TEXT_CHARS)] | None
    displays: Annotated[list[Annotated[str, Field(max_length=PAGE_TEXT_CHARS)]], Field(max_length=20)]
    error: PageError | None
    figures: Annotated[list[Literal["image/png", "image/jpeg"]], Field(max_length=50)]
    tables: Annotated[list[PageTable], Field(max_length=8)]
    outputs_dropped: bool
    usage: RunUsage | None = None


class HistoryPage(Wire):
    """The newest runs of a session's history (oldest first); ``more``: older runs are left out (the
    page or a bound on reading ended it); ``missing``: the session has no history yet."""

    ev: Literal["history_page"]
    id: int
    cells: Annotated[list[PageCell], Field(max_length=PAGE_MAX_CELLS)]
    runs_dropped: Annotated[int, Field(ge=0, lt=10**15)]
    more: bool
    missing: bool


class ToolCall(Wire):
    """Sandbox code called an upstream tool; its JSON arguments are the payload. Everything here is
    the sandbox's (forged at will): the host's broker judges the server, tool and arguments."""

    ev: Literal["tool_call"]
    id: int
    call: Annotated[int, Field(ge=0, lt=1 << 31)]
    server: Annotated[str, Field(max_length=MAX_CALL_NAME)]
    tool: Annotated[str, Field(max_length=MAX_CALL_NAME)]
    raw: bool = False


class Failure(Wire):
    """The agent refused a request (a bad path, a quota); the message is for the model."""

    ev: Literal["error"]
    id: int | None
    message: Text
    kind: Literal["quota", "too_large"] | None = None  # refusals the host tells apart


Event = Annotated[
    Ready
    | Pong
    | Output
    | Image
    | Display
    | Table
    | Done
    | Clean
    | Listing
    | Chunk
    | Staged
    | Dropped
    | Written
    | Restored
    | SnapshotSynced
    | VariableList
    | HistoryPage
    | ToolCall
    | Failure,
    Field(discriminator="ev"),
]
_EVENTS: TypeAdapter[Event] = TypeAdapter(Event)


def parse_event(header: dict[str, Any]) -> Event:
    try:
        return _EVENTS.validate_python(header)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])[:100]
        raise ProtocolViolation(f"the agent sent a malformed event ({where}: {first['msg'][:100]})") from None


def event_id(header: dict[str, Any]) -> int | None:
    """The request an event belongs to, read before the event is parsed (for routing)."""
    value = header.get("id")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
