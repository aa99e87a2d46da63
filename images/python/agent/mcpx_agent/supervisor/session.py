"""The session of a container: its worker and everything that outlives one of its runs.

``Session`` owns
- the session's worker (a fresh one when it is gone; ``lost`` when it was stopped between runs),
  the files the last run left (the next reports only what it changed), the last run's options and
  the notices told with the next result;
- the disk quota: each run is held to it once it ended (``report_files``), and so is what a run left
  running (``watch_idle``); past the flood ceiling every process is stopped and files are removed
  until /mnt/data fits;
- the snapshot and the history (``history_writer``), due once the session is idle; the history is
  also written before any request of the host but a run (``supervisor.dispatch``), since those read
  or copy the session's state (a pause, a fork and a stop begin with ``snapshot_sync``);
- the host's session requests (``SESSION_OPS``): restore and variables answered by asking its worker
  (``worker_requests``): a worker that does not answer in time, dies or answers with a forged frame
  is killed, and the session goes on with a fresh one (the answer says so); the export written by
  the supervisor itself (``notebook``), then put in place (``transfer``).

Each cell runs through a ``runner.Runner``, which owns nothing past the run.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, NamedTuple

from .. import events
from ..handles import WorkerHandle, send_to_worker
from ..identity import as_sandbox_user
from . import files, notebook, processes, quota, transfer, tree
from .history_writer import HistoryWriter
from .port import SupervisorPort
from .runner import Cell, Runner
from .tree import RESERVED
from .worker_requests import ask, end, gone, restored_event, snapshot_event, variables_event

FLOOD_NOTICE = (
    "/mnt/data grew past {ceiling} times the session's disk quota: every process of the session was "
    "stopped (variables were lost) and the largest files were removed until it fit: {removed}"
)
BACKGROUND_NOTICE = (
    "processes left running by an earlier run wrote past the session's disk quota; every process of the "
    "session was stopped (variables were lost, files were kept)"
)
RESTORE_MAX_S = 120.0  # the worker cuts each record at seconds; this ends one that blocks its own alarm
VARIABLES_MAX_S = 15.0
SYNC_GRACE_S = 5.0
# The snapshot starts, and the history of the runs since the last idle moment is written, once the
# session has been idle this long: runs in quick succession (an agent's loop) then pay for no fork and
# no file writes, and share no CPU with a writer. The cost: a container lost within this time of a run
# loses that run's changes and its history line too (every host request but a run writes the history
# first, so a pause, a fork, a stop, an export or the notebook view loses none of it; a server killed
# closes the channel, which writes the snapshot, then the history: see ``on_channel_closed``).
SNAPSHOT_IDLE_S = 0.5
CLOSE_SNAPSHOT_S = 60.0  # the host is gone: how long the snapshot due may take before the history goes alone
SESSION_OPS = ("restore", "snapshot_sync", "variables", "export_notebook")  # the host's requests handled here


class FileReport(NamedTuple):
    """What a session run did to /mnt/data, as its result says it."""

    files: list[dict[str, Any]]  # the files it changed
    quota_error: str | None  # it is to blame for the quota: the run is an error
    flood_note: str | None  # it flooded /mnt/data: everything was stopped and files removed
    over: bool  # /mnt/data is over the quota after it
    used: int | None  # the bytes in use, where they were counted


class Session:
    """The session's worker, files and quota watch; its snapshots, history and requests."""

    def __init__(self, supervisor: SupervisorPort) -> None:
        self.supervisor = supervisor
        self.worker: WorkerHandle | None = None
        self.files: dict[str, tuple[int, int]] = {}  # what the last run left, to report changes
        self.options: dict[str, Any] = {}  # the last run's, for the watch between runs
        self.usage: tuple[int, int] | None = None  # (bytes, entries) after the last run, if counted
        self.lost = False  # the worker was stopped between runs
        self.notices: list[str] = []  # told with the next run's result
        self.next_watch = 0.0  # when the quota is next checked between runs
        self.history = HistoryWriter()
        # (when, cap, quota bytes, bytes in use if the run counted them) of the next snapshot order
        self.snapshot_due: tuple[float, int, int, int | None] | None = None
        self.history_due: float | None = None  # when the held runs' history is written

    # -- runs -------------------------------------------------------------------------------------
    def execute(self, cell: Cell, code: bytes, *, started: float, oom_before: int | None) -> None:
        """Run a cell in the session's worker, send its result, hold it for the history and the next snapshot."""
        self.supervisor.forget_exits(keep=self.worker)
        self.options = cell.options
        self.snapshot_due = None  # this run orders its own
        handle, restarted = self.live_worker()
        run = Runner(self.supervisor, cell, handle, started=started)
        run.run(code, oom_before)
        if run.killed_all:  # the worker went with every other process: the next run gets a fresh one
            self.let_worker_go()
        notes, self.notices = self.notices, []
        report = self.report_files(run)
        done = run.done_event(
            restarted=restarted or run.lost or report.flood_note is not None,
            notes=notes,
            files=report.files,
            later_notes=(report.flood_note,) if report.flood_note else (),
            quota_error=report.quota_error,
        )
        self.supervisor.send(done)
        self.after_run(code, done, run, over=report.over, used=report.used)

    def live_worker(self) -> tuple[WorkerHandle, bool]:
        """The session's worker, a fresh one if it is gone; and whether it had to be replaced."""
        if self.worker is not None and self.supervisor.exit_status(self.worker.pid) is None:
            return self.worker, False
        restarted = self.worker is not None or self.lost
        self.lost = False
        self.let_worker_go()
        self.worker = self.supervisor.take_worker()
        return self.worker, restarted

    def kill_all(self) -> bool:
        """Kill every process of the sandbox user, the session's worker and the spare included."""
        killed = self.supervisor.kill_all()
        self.let_worker_go()
        return killed

    def let_worker_go(self) -> None:
        """The session's worker was killed: its handle is closed, and the next run gets a fresh one."""
        if self.worker is not None:
            self.worker.close()
        self.worker = None

    def note_written(self, path: str, size: int, mtime_ns: int) -> None:
        """A file was put in place (an upload, an export): the next run must not report it as a file it changed."""
        self.files[path] = (size, mtime_ns)

    # -- the quota --------------------------------------------------------------------------------
    def report_files(self, run: Runner) -> FileReport:
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
            flood_note = self.flood_response(options)
            after, _ = tree.survey(2000)
        changes = tree.changed(self.files, after)
        self.files = after
        blamed = blamed or run.quota_message
        over = over or blamed
        return FileReport(changes, blamed, flood_note, bool(over), None if over or measured is None else measured[0])

    def flood_response(self, options: dict[str, Any]) -> str:
        """Past the ceiling: nothing of the session's may keep writing, and /mnt/data goes back under the quota."""
        self.kill_all()
        self.lost = True
        try:
            removed = quota.shed(options)
        except Exception as exc:  # noqa: BLE001 - the host replaces a container whose wipe failed
            removed = [f"(not all: {exc!r:.200})"]
        shown = ", ".join(removed[:10]) + (f" and {len(removed) - 10} more" if len(removed) > 10 else "")
        return FLOOD_NOTICE.format(ceiling=quota.CEILING, removed=shown or "none")

    def watched(self) -> bool:
        """Whether the session may have something running between runs that the quota must hold."""
        return self.worker is not None and bool(self.options)

    def watch_when_due(self) -> None:
        """Between runs, every ``quota.CHECK_S``: ``watch_idle``."""
        if time.monotonic() >= self.next_watch:
            self.next_watch = time.monotonic() + quota.CHECK_S
            self.watch_idle()

    def watch_idle(self) -> None:
        """Between runs: when something of the session's may still be writing, hold it to the quota."""
        handle = self.worker
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
            self.kill_all()
            self.lost = True
            self.notices.append(BACKGROUND_NOTICE)

    # -- the snapshot and the history, once idle --------------------------------------------------
    def after_run(self, code: bytes, done: dict[str, Any], run: Runner, *, over: bool, used: int | None) -> None:
        """Hold the run for the history and order the next snapshot, both for when the session is idle
        (the result has gone out). ``over``: the run left /mnt/data over the quota; ``used``: the bytes
        in use, if the run counted them (else they are counted when the snapshot is ordered)."""
        history_cap = run.options.get("history_max_bytes")
        if isinstance(history_cap, int) and history_cap > 0:
            self.history.hold(code, done, run.results.kept or [], history_cap)
            self.history_due = time.monotonic() + SNAPSHOT_IDLE_S
        cap = run.options.get("snapshot_max_bytes")
        worker = self.worker
        if not isinstance(cap, int) or cap <= 0 or worker is not run.handle or gone(self.supervisor, worker):
            return
        if over:
            return  # no room left for a snapshot
        quota_bytes, _ = quota.limits(run.options)
        self.snapshot_due = (time.monotonic() + SNAPSHOT_IDLE_S, cap, quota_bytes, used)

    def idle_wait(self) -> float | None:
        """Seconds until the history or the ordered snapshot is due (None: neither is)."""
        snapshot_at = None if self.snapshot_due is None else self.snapshot_due[0]
        due = [at for at in (self.history_due, snapshot_at) if at is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def on_idle(self) -> None:
        """The session is idle: write the history and order the snapshot, whichever is due."""
        if self.history_due is not None and time.monotonic() >= self.history_due:
            self.write_history()
        self.order_snapshot()

    def write_history(self) -> None:
        """Write the held runs' history now (before anything reads or copies the session's state)."""
        self.history_due = None
        if not self.history.held.held:
            return
        usage = self.usage
        before = quota.reserved_usage() if usage is not None else None
        self.history.flush()
        after = quota.reserved_usage() if usage is not None else None
        if usage is not None and before is not None and after is not None and self.usage is usage:
            # The count alone: what the history took is the server's, not the next run's growth.
            self.usage = (usage[0] + after[0] - before[0], usage[1] + after[1] - before[1])

    def on_channel_closed(self) -> None:
        """The host closed the channel (its server stopped or was killed, or it removes the container):
        the snapshot due (or being written) is finished, then the held history written. In that order
        a history line is on the volume only once the variables it shows are: a container killed in
        between loses the line with the variables, never the variables alone."""
        worker = self.worker
        if worker is not None and not gone(self.supervisor, worker):
            self.order_snapshot(now=True)
            request = events.sync_request(CLOSE_SNAPSHOT_S)
            ask(self.supervisor, worker, request, "snapshot", CLOSE_SNAPSHOT_S + SYNC_GRACE_S)
        self.write_history()

    def order_snapshot(self, *, now: bool = False) -> None:
        """Send the worker the snapshot order once the session has been idle for ``SNAPSHOT_IDLE_S``
        (``now``: whenever one is waiting). A run that starts first drops the order: it orders its own."""
        due = self.snapshot_due
        if due is None or (not now and time.monotonic() < due[0]):
            return
        self.snapshot_due = None
        worker = self.worker
        if worker is None or gone(self.supervisor, worker):
            return
        _, cap, quota_bytes, used = due
        if quota_bytes and used is None:
            _, measured = tree.survey(2000)  # now, off the runs' path
            if measured is None:
                return  # the room left cannot be known; no snapshot rather than one that floods the quota
            used = measured[0]
        room = quota_bytes - (used or 0) if quota_bytes else cap
        send_to_worker(worker, events.snapshot_order(max(0, min(cap, room))), b"", time.monotonic() + 1)

    # -- the host's requests ----------------------------------------------------------------------
    def dispatch(self, op: str, rid: Any, request: dict[str, Any]) -> dict[str, Any]:
        """The event answering ``op``."""
        if op == "restore":
            return self.restore(rid)
        if op == "snapshot_sync":
            return self.sync(rid, float(request["timeout"]))
        if op == "variables":
            return self.variables(rid, int(request["limit"]), int(request["repr_chars"]))
        return self.export(rid, request)

    def restore(self, rid: Any) -> dict[str, Any]:
        worker, _ = self.live_worker()
        reply, why = ask(self.supervisor, worker, events.restore_request(), "restored", RESTORE_MAX_S)
        if reply is None:
            self.replace(worker)
            note = f"the snapshot could not be loaded ({why}); the session goes on with empty variables"
            return events.restored(rid, "failed", 0, [], note, None)
        return restored_event(rid, reply)

    def sync(self, rid: Any, timeout: float) -> dict[str, Any]:
        timeout = max(0.0, min(timeout, 3600.0))
        worker = self.worker
        if worker is None or gone(self.supervisor, worker):
            return events.snapshot(rid, True, *stored_snapshot())
        self.order_snapshot(now=True)
        reply, _ = ask(self.supervisor, worker, events.sync_request(timeout), "snapshot", timeout + SYNC_GRACE_S)
        if reply is None:
            self.replace(worker)
            return events.snapshot(rid, True, *stored_snapshot())
        return snapshot_event(rid, reply)

    def variables(self, rid: Any, limit: int, repr_chars: int) -> dict[str, Any]:
        worker = self.worker
        if worker is None or gone(self.supervisor, worker):
            return events.variables(rid, [], truncated=False)
        request = events.variables_request(max(0, limit), max(0, repr_chars))
        reply, why = ask(self.supervisor, worker, request, "variables", VARIABLES_MAX_S)
        if reply is None:
            self.replace(worker)
            self.lost = True
            raise files.FileError(f"the session's interpreter did not list its variables ({why}); it was restarted")
        return variables_event(rid, reply, limit)

    def export(self, rid: Any, request: dict[str, Any]) -> dict[str, Any]:
        parts = files.split_path(str(request["path"]))
        if parts[0] in (RESERVED, transfer.STAGING):
            raise files.FileError(f"{parts[0]} is reserved for the server")
        reply = notebook.export_notebook(request.get("read_max"))
        if reply["error"]:
            raise files.FileError(f"the notebook could not be written: {reply['error']}")
        options = {key: request.get(key) for key in ("data_quota_bytes", "data_quota_files")}
        over = quota.quota_error(options)
        if over:
            transfer.discard_export()
            raise transfer.QuotaError(f"the notebook was not written: {over}")
        placed = transfer.place_export(parts)
        self.note_written(placed.path, placed.stat.st_size, placed.stat.st_mtime_ns)
        return events.written(rid, placed.path, placed.stat.st_size, placed.stat.st_mtime)

    def replace(self, worker: WorkerHandle) -> None:
        """The session's worker failed a request: it goes, and a fresh one takes its place."""
        end(self.supervisor, worker)
        if self.worker is worker:
            self.worker = self.supervisor.take_worker()
            self.supervisor.order_spare()


def stored_snapshot() -> tuple[float | None, int | None]:
    """The snapshot file's time and size, from its stat alone (the supervisor never reads it)."""
    with contextlib.suppress(OSError, files.FileError), as_sandbox_user():
        dir_fd = files.open_dir([RESERVED, "snapshot"])
        try:
            st = os.stat("ns.pkl", dir_fd=dir_fd, follow_symlinks=False)
            return st.st_mtime, st.st_size
        finally:
            os.close(dir_fd)
    return None, None
