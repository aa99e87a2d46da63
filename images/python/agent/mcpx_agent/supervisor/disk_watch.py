"""The session's /mnt/data: the files its last run left, and the disk quota held over its runs.

``DiskWatch`` owns
- the files the last run left (the next run reports only what it changed; a file put in place by
  the supervisor, an upload or an export, is noted so that no run reports it);
- the disk quota: each run is held to it once it ended (``report_run``), and so is what a run left
  running (``watch_idle``, every ``quota.CHECK_S`` between runs); past the flood ceiling every
  process is stopped and files are removed until /mnt/data fits;
- what it did between runs, told with the next run's result (``take_notices``).

Stopping the session's processes is the worker's owner's (``session_worker.SessionWorker``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from . import processes, quota, tree
from .port import SupervisorPort
from .session_worker import SessionWorker

if TYPE_CHECKING:
    from .runner import Runner

FLOOD_NOTICE = (
    "/mnt/data grew past {ceiling} times the session's disk quota: every process of the session was "
    "stopped (variables were lost) and the largest files were removed until it fit: {removed}"
)
BACKGROUND_NOTICE = (
    "processes left running by an earlier run wrote past the session's disk quota; every process of the "
    "session was stopped (variables were lost, files were kept)"
)


class FileReport(NamedTuple):
    """What a session run did to /mnt/data, as its result says it."""

    files: list[dict[str, Any]]  # the files it changed
    quota_error: str | None  # it is to blame for the quota: the run is an error
    flood_note: str | None  # it flooded /mnt/data: everything was stopped and files removed
    over: bool  # /mnt/data is over the quota after it
    used: int | None  # the bytes in use, where they were counted


class DiskWatch:
    """The files the session's last run left, and the disk quota held after runs and between them."""

    def __init__(self, supervisor: SupervisorPort, worker: SessionWorker) -> None:
        self.supervisor = supervisor
        self.worker = worker
        self.files: dict[str, tuple[int, int]] = {}  # what the last run left, to report changes
        self.options: dict[str, Any] = {}  # the last run's, for the watch between runs
        self.usage: tuple[int, int] | None = None  # (bytes, entries) after the last run, if counted
        self.notices: list[str] = []  # told with the next run's result
        self.next_watch = 0.0  # when the quota is next checked between runs

    def begin_run(self, options: dict[str, Any]) -> None:
        """A run starts with ``options``: the watch between runs holds to them from now on."""
        self.options = options

    def take_notices(self) -> list[str]:
        """What the watch did between runs, for the run's result (told once)."""
        notices, self.notices = self.notices, []
        return notices

    def note_written(self, path: str, size: int, mtime_ns: int) -> None:
        """A file was put in place (an upload, an export): the next run must not report it as a file it changed."""
        self.files[path] = (size, mtime_ns)

    def server_wrote(self, write: Callable[[], None]) -> None:
        """Call ``write``, which writes the server's own files (the history): with the count alone,
        what it took is kept out of the next run's growth."""
        usage = self.usage
        before = quota.reserved_usage() if usage is not None else None
        write()
        after = quota.reserved_usage() if usage is not None else None
        if usage is not None and before is not None and after is not None and self.usage is usage:
            self.usage = (usage[0] + after[0] - before[0], usage[1] + after[1] - before[1])

    # -- after a run ------------------------------------------------------------------------------
    def report_run(self, run: Runner) -> FileReport:
        """The files the run changed, and the run held to the quota. Where the filesystem enforces the
        quota, the hidden directories (snapshot, history, packages) are walked only when a file of the
        user's changed: the filesystem holds whatever a run puts there. With the count alone every run
        is counted whole (the user may write there too), and one that changed no visible file is
        blamed only if the usage grew."""
        options = self.options
        after, visible, unwalked = tree.survey_visible(2000)
        changed = after != self.files or run.reason == "disk_quota"
        quota_matters = changed or options.get("disk_enforced") is not True
        measured = quota.with_held(tree.with_hidden(visible, unwalked)) if quota_matters else None
        over, flooded = quota.quota_state(options, measured=measured) if quota_matters else (None, False)
        blamed = over if changed or flooded else quota.if_grown(over, measured, self.usage)
        self.usage = None if options.get("disk_enforced") is True else measured  # the count's alone
        flood_note = None
        if flooded:
            flood_note = self.flood_response(options, told=True)  # this run says its session restarted
            after, _ = tree.survey(2000)
        changes = tree.changed(self.files, after)
        self.files = after
        blamed = blamed or run.quota_message
        over = over or blamed
        return FileReport(changes, blamed, flood_note, bool(over), None if over or measured is None else measured[0])

    def flood_response(self, options: dict[str, Any], *, told: bool = False) -> str:
        """Past the ceiling: nothing of the session's may keep writing, and /mnt/data goes back under the
        quota. The next run is told its session restarted, unless the run this ends tells it (``told``)."""
        self.worker.stop_between_runs(told=told)
        try:
            removed = quota.shed(options)
        except Exception as exc:  # noqa: BLE001 - the host replaces a container whose wipe failed
            removed = [f"(not all: {exc!r:.200})"]
        shown = ", ".join(removed[:10]) + (f" and {len(removed) - 10} more" if len(removed) > 10 else "")
        return FLOOD_NOTICE.format(ceiling=quota.CEILING, removed=shown or "none")

    # -- between runs -----------------------------------------------------------------------------
    def watched(self) -> bool:
        """Whether the session may have something running between runs that the quota must hold."""
        return self.worker.handle is not None and bool(self.options)

    def watch_when_due(self) -> None:
        """Between runs, every ``quota.CHECK_S``: ``watch_idle``."""
        if time.monotonic() >= self.next_watch:
            self.next_watch = time.monotonic() + quota.CHECK_S
            self.watch_idle()

    def watch_idle(self) -> None:
        """Between runs: when something of the session's may still be writing, hold it to the quota."""
        handle = self.worker.handle
        if handle is None:
            return
        busy = self.supervisor.others_alive(handle) or processes.thread_count(handle.pid) > 1
        if not busy:
            return
        over, flooded = quota.quota_state(self.options)
        if flooded:
            self.notices.append(self.flood_response(self.options))
            self.files, _ = tree.survey(2000)
        elif over:
            self.worker.stop_between_runs()
            self.notices.append(BACKGROUND_NOTICE)
