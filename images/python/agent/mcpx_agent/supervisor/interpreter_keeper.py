"""The keeper of a container's session interpreter: its cells, and everything that outlives one of its runs.

``InterpreterKeeper`` runs the session's cells (``execute``) and holds the parts that outlive a run,
each the one owner of what it keeps:
- ``worker`` (``session_worker.SessionWorker``): the session's worker, a fresh one when it is gone;
- ``disk`` (``disk_watch.DiskWatch``): the files the last run left and the disk quota, held after
  each run and between runs;
- ``idle`` (``idle_writes.IdleWrites``): the history and the snapshot, written once the session is idle;
- ``requests`` (``session_requests.SessionRequests``): the host's session requests.

Each cell runs through a ``runner.Runner``, which owns nothing past the run.
"""

from __future__ import annotations

from .disk_watch import DiskWatch
from .idle_writes import IdleWrites
from .port import SupervisorPort
from .runner import Cell, Runner
from .session_requests import SessionRequests
from .session_worker import SessionWorker


class InterpreterKeeper:
    """A session's cells, run in its worker; and the parts of the session that outlive them."""

    def __init__(self, supervisor: SupervisorPort) -> None:
        self.supervisor = supervisor
        self.worker = SessionWorker(supervisor)
        self.disk = DiskWatch(supervisor, self.worker)
        self.idle = IdleWrites(supervisor, self.worker, self.disk)
        self.requests = SessionRequests(supervisor, self.worker, self.idle, self.disk)

    def execute(self, cell: Cell, code: bytes, *, started: float, oom_before: int | None) -> None:
        """Run a cell in the session's worker, send its result, hold it for the history and the next snapshot."""
        self.supervisor.forget_exits(keep=self.worker.handle)
        self.disk.begin_run(cell.options)
        self.idle.drop_snapshot_order()
        handle, restarted = self.worker.live()
        run = Runner(self.supervisor, cell, handle, started=started)
        run.run(code, oom_before)
        if run.killed_sandbox_processes:  # the worker went with every other process: the next run gets a fresh one
            self.worker.let_go()
        notes = self.disk.take_notices()
        report = self.disk.report_run(run)
        done = run.done_event(
            restarted=restarted or run.worker_died or report.flood_note is not None,
            notes=notes,
            files=report.files,
            later_notes=(report.flood_note,) if report.flood_note else (),
            quota_error=report.quota_error,
        )
        self.supervisor.send(done)
        self.idle.after_run(code, done, run, over=report.over, used=report.used)
