"""Results and records that cross layer boundaries (and form the tools' output schemas)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

RunStatus = Literal["ok", "error", "timeout", "memory_limit", "crashed", "cancelled"]
# "running": the call stopped waiting before the run ended; the run goes on (get_run, cancel_run).
RunState = Literal["ok", "error", "timeout", "memory_limit", "crashed", "cancelled", "running"]
# How a session's restore in a new container went: its last snapshot loaded (perhaps in part: the
# restore's note says what), there was none, or there was one that could not be loaded.
RestoreOutcome = Literal["restored", "none", "failed"]


class ErrorInfo(BaseModel):
    type: str = Field(description="exception class name, e.g. ZeroDivisionError")
    message: str
    traceback: str = Field("", description="traceback limited to the user's own code")
    line: int | None = Field(None, description="line of a SyntaxError")
    column: int | None = Field(None, description="column of a SyntaxError")
    tool_failure: bool = Field(
        False, description="the tool failed under the run (the engine, a container), not the user's code"
    )


class FileInfo(BaseModel):
    path: str = Field(description="path relative to /mnt/data")
    size: int
    modified: float = Field(description="modification time, seconds since the epoch")
    uri: str | None = Field(None, description="MCP resource URI to read the file")
    mime_type: str | None = None
    note: str | None = None
    text: str | None = Field(
        None, exclude=True, description="a small text file's content, inline in the content blocks (not structured)"
    )


class DirEntry(FileInfo):
    is_dir: bool = False


class ImageOutput(BaseModel):
    """An image a run produced. Its bytes go in an image content block, never in JSON."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    mime_type: str
    data: bytes = Field(exclude=True, repr=False)
    width: int = 0
    height: int = 0
    note: str | None = None


class TableRef(BaseModel):
    """A DataFrame or Series a session's run showed, kept in the sandbox for the notebook view."""

    table: str = Field(description="the table's id (for view_session's table pages)")
    columns: list[str]
    dtypes: list[str]
    rows: int = Field(description="rows kept (capped)")
    total_rows: int = Field(description="rows the table had")
    sorted_columns: int = Field(0, description="how many of the first columns can be sorted on")


class Usage(BaseModel):
    """What one run cost, measured where it is true: the container's accounting and the server's own."""

    wall_s: float | None = Field(
        None, description="seconds from admission to the end (installs and a restore included); the server's"
    )
    cpu_user_s: float | None = Field(None, description="CPU seconds in user mode, the sandbox's processes together")
    cpu_system_s: float | None = Field(None, description="CPU seconds in the kernel, the sandbox's processes together")
    peak_memory_bytes: int | None = Field(None, description="the run's interpreter's highest resident memory")
    data_written_bytes: int = Field(0, description="bytes of the files the run created or changed in /mnt/data")
    packages_installed: int = Field(0, description="packages installed for the run")
    tool_calls: int = Field(0, description="code mode's tool calls the run made")
    egress_bytes: int | None = Field(None, description="bytes sent and received through the egress proxy")

    @property
    def cpu_s(self) -> float:
        return (self.cpu_user_s or 0.0) + (self.cpu_system_s or 0.0)


class UsageTotals(BaseModel):
    """Runs' usage added up (peak memory: the highest)."""

    runs: int = 0
    wall_s: float = 0.0
    cpu_user_s: float = 0.0
    cpu_system_s: float = 0.0
    peak_memory_bytes: int = 0
    data_written_bytes: int = 0
    packages_installed: int = 0
    tool_calls: int = 0
    egress_bytes: int = 0
    idle_cpu_s: float = 0.0  # CPU its container used outside its runs (what they left running, snapshots)

    def add(self, usage: Usage) -> None:
        self.runs += 1
        self.wall_s = round(self.wall_s + (usage.wall_s or 0.0), 3)
        self.cpu_user_s = round(self.cpu_user_s + (usage.cpu_user_s or 0.0), 3)
        self.cpu_system_s = round(self.cpu_system_s + (usage.cpu_system_s or 0.0), 3)
        self.peak_memory_bytes = max(self.peak_memory_bytes, usage.peak_memory_bytes or 0)
        self.data_written_bytes += usage.data_written_bytes
        self.packages_installed += usage.packages_installed
        self.tool_calls += usage.tool_calls
        self.egress_bytes += usage.egress_bytes or 0


class QuotaUse(BaseModel):
    quota: str = Field(description="its name: runs_per_minute, cpu_s_per_hour, cpu_s_per_day, package_installs_per_day")
    limit: float = Field(description="the most the window may hold (0: no limit)")
    used: float = Field(description="what is counted in the window now")
    window_s: float = Field(description="the window's length in seconds")
    frees_in_s: float | None = Field(None, description="seconds until what is counted now has all left the window")


class SessionUsage(UsageTotals):
    session_id: str
    since: float = Field(description="counted since (Unix time): the session's start, or when this server took it over")


class UsageReport(BaseModel):
    quotas: list[QuotaUse] = Field(default_factory=list, description="your quotas counted over time (none: no limits)")
    session: SessionUsage | None = Field(None, description="the session's runs added up")


class RunResult(BaseModel):
    """What a run produced. ``status`` says how it ended; nothing in user code raises on the host."""

    status: RunState = Field(description="how the run ended, or 'running' when it goes on after this call")
    stdout: str = ""
    stderr: str = ""
    result: str | None = Field(None, description="repr of the last expression's value")
    displays: list[str] = Field(default_factory=list, description="text of display() outputs")
    error: ErrorInfo | None = None
    files: list[FileInfo] = Field(default_factory=list, description="files the run created or changed")
    files_omitted: int = Field(0, description="more files the run created or changed than files names")
    images: list[ImageOutput] = Field(default_factory=list, exclude=True)
    image_count: int = 0
    tables: list[TableRef] = Field(
        default_factory=list, description="DataFrames and Series the run showed, kept for view_session (sessions)"
    )
    duration_ms: float = 0.0
    truncated: list[str] = Field(
        default_factory=list, description="what was cut at its cap: stdout, stderr, result, displays, images, traceback"
    )
    notes: list[str] = Field(default_factory=list, description="what the sandbox has to say about this run")
    session_id: str | None = None
    session_restarted: bool = Field(
        False, description="the interpreter was replaced; variables not in its last snapshot were lost"
    )
    # What the restore before this run did, when it had one: how the answer words a restart.
    restore: RestoreOutcome | None = Field(None, exclude=True)
    run_id: str | None = Field(None, description="this run's id, for get_run, cancel_run and the files it left")
    usage: Usage | None = Field(None, description="what the run cost (once it ended)")


class SessionInfo(BaseModel):
    session_id: str
    idle_timeout_s: float
    max_lifetime_s: float
    memory_mb: int
    cpus: float
    default_timeout_s: float
    max_run_s: float
    network: bool
    egress: list[str] | None = Field(
        None,
        description="the hosts this session's code may reach through the server's proxy (host patterns; no "
        "port: 80 and 443); absent when the server has no egress",
    )


class VariableInfo(BaseModel):
    name: str
    type: str
    repr: str = Field(description="a short repr, capped")
    size: int | None = Field(None, description="bytes, where known")
    shape: list[int] | None = Field(None, description="for arrays and frames")


class VariableListing(BaseModel):
    session_id: str
    variables: list[VariableInfo]
    truncated: bool = Field(False, description="more names exist than were listed")
    notes: list[str] = Field(default_factory=list)


class WrittenFile(BaseModel):
    path: str = Field(description="relative to /mnt/data")
    size: int
    uri: str = Field(description="the file's resource URI (read it with read_file or resources/read)")


class ForkedSessions(BaseModel):
    session_id: str = Field(description="the session forked")
    forks: list[str] = Field(description="the new sessions' ids; each starts paused and resumes at its first call")


class FileContent(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    path: str
    size: int
    modified: float
    data: bytes = Field(exclude=True, repr=False)


# -- the notebook view (view_session, view_run and the view's own tools) -------------------------------
class FigureRef(BaseModel):
    cell: int = Field(description="the cell (run number in the session) that drew it")
    index: int = Field(description="its place among the cell's images, from 0")
    mime_type: str
    available: bool = Field(True, description="false: a stateless run's images went out with its result")


class NotebookCell(BaseModel):
    n: int = Field(description="the run's number in the session (1 for a stateless run)")
    run_id: str | None = None
    at: float | None = Field(None, description="when it ended (Unix time)")
    code: str
    status: str
    duration_ms: float
    stdout: str = Field("", description="head and tail, capped")
    stderr: str = Field("", description="head and tail, capped")
    result: str | None = None
    displays: list[str] = Field(default_factory=list)
    error: ErrorInfo | None = None
    figures: list[FigureRef] = Field(default_factory=list)
    tables: list[TableRef] = Field(default_factory=list)
    outputs_dropped: bool = Field(False, description="the history's cap dropped this cell's outputs")
    usage: Usage | None = Field(None, description="what the run cost, as the sandbox measured it")


class NotebookView(BaseModel):
    session_id: str | None = None
    run_id: str | None = None
    cells: list[NotebookCell]
    runs_dropped: int = Field(0, description="older runs the history's cap dropped whole")
    cells_omitted: int = Field(0, description="older cells left out of this view")
    notes: list[str] = Field(default_factory=list)


class TablePage(BaseModel):
    table: str
    offset: int
    rows: list[list[str | int | float | bool | None]]
    total: int = Field(description="rows kept for the view")
    sort: int | None = None
    descending: bool = False
    truncated: bool = Field(False, description="the page stopped early at its byte cap")
