"""The session's snapshot and history, written once the session is idle.

``IdleWrites`` owns
- the history of the runs since the last idle moment (``history_writer``), held after each run and
  written once the session is idle; it is also written before any request of the host but a run
  (``supervisor.dispatch``), since those read or copy the session's state;
- the snapshot each run orders, sent to the worker once the session is idle (a run that starts
  first drops it: it orders its own), or at once when the host asks for the snapshot to be finished
  (``snapshot_sync``: a pause, a fork and a stop begin with it) or closes the channel.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .. import events
from ..handles import WorkerHandle, send_to_worker
from . import quota, tree
from .disk_watch import DiskWatch
from .history_writer import HistoryWriter
from .port import SupervisorPort
from .session_worker import SessionWorker
from .worker_requests import ask

if TYPE_CHECKING:
    from .runner import Runner

SYNC_GRACE_S = 5.0
# The snapshot starts, and the history of the runs since the last idle moment is written, once the
# session has been idle this long: runs in quick succession (an agent's loop) then pay for no fork and
# no file writes, and share no CPU with a writer. The cost: a container lost within this time of a run
# loses that run's changes and its history line too (every host request but a run writes the history
# first, so a pause, a fork, a stop, an export or the notebook view loses none of it; a server killed
# closes the channel, which writes the snapshot, then the history: see ``on_channel_closed``).
SNAPSHOT_IDLE_S = 0.5
CLOSE_SNAPSHOT_S = 60.0  # the host is gone: how long the snapshot due may take before the history goes alone


class IdleWrites:
    """The held runs' history and the ordered snapshot, and when each is due."""

    def __init__(self, supervisor: SupervisorPort, worker: SessionWorker, disk: DiskWatch) -> None:
        self.supervisor = supervisor
        self.worker = worker
        self.disk = disk
        self.history = HistoryWriter()
        # (when, cap, quota bytes, bytes in use if the run counted them) of the next snapshot order
        self.snapshot_due: tuple[float, int, int, int | None] | None = None
        self.history_due: float | None = None  # when the held runs' history is written

    def drop_snapshot_order(self) -> None:
        """A run starts: the snapshot ordered after the last one is not sent (this run orders its own)."""
        self.snapshot_due = None

    def after_run(self, code: bytes, done: dict[str, Any], run: Runner, *, over: bool, used: int | None) -> None:
        """Hold the run for the history and order the next snapshot, both for when the session is idle
        (the result has gone out). ``over``: the run left /mnt/data over the quota; ``used``: the bytes
        in use, if the run counted them (else they are counted when the snapshot is ordered)."""
        history_cap = run.options.get("history_max_bytes")
        if isinstance(history_cap, int) and history_cap > 0:
            if self.history.hold(code, done, run.results.kept or [], history_cap):
                self.write_history()  # the held runs reached their bound
            else:
                self.history_due = time.monotonic() + SNAPSHOT_IDLE_S
        cap = run.options.get("snapshot_max_bytes")
        if not isinstance(cap, int) or cap <= 0 or self.worker.running() is not run.handle:
            return
        if over:
            return  # no room left for a snapshot
        quota_bytes, _ = quota.limits(run.options)
        self.snapshot_due = (time.monotonic() + SNAPSHOT_IDLE_S, cap, quota_bytes, used)

    def due_in(self) -> float | None:
        """Seconds until the history or the ordered snapshot is due (None: neither is)."""
        snapshot_at = None if self.snapshot_due is None else self.snapshot_due[0]
        due = [at for at in (self.history_due, snapshot_at) if at is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def on_idle(self) -> None:
        """The session is idle: write the history and order the snapshot, whichever is due."""
        if self.history_due is not None and time.monotonic() >= self.history_due:
            self.write_history()
        self.snapshot_order()

    def write_history(self) -> None:
        """Write the held runs' history now (before anything reads or copies the session's state)."""
        self.history_due = None
        if self.history.holding:
            self.disk.server_wrote(self.history.flush)

    def on_channel_closed(self) -> None:
        """The host closed the channel (its server stopped or was killed, or it removes the container):
        the snapshot due (or being written) is finished, then the held history written. In that order
        a history line is on the volume only once the variables it shows are: a container killed in
        between loses the line with the variables, never the variables alone."""
        worker = self.worker.running()
        if worker is not None:
            self.snapshot_sync(worker, CLOSE_SNAPSHOT_S)
        self.write_history()

    def snapshot_sync(self, worker: WorkerHandle, timeout: float) -> dict[str, Any] | None:
        """Finish the snapshot: the one due is ordered now, and ``worker`` answers once the snapshot
        being written is (or ``timeout`` passed). Its checked answer; None when it gave none."""
        self.snapshot_order(now=True)
        request = events.snapshot_sync_request(timeout)
        reply, _ = ask(self.supervisor, worker, request, "snapshot_synced", timeout + SYNC_GRACE_S)
        return reply

    def snapshot_order(self, *, now: bool = False) -> None:
        """Send the worker the snapshot order once the session has been idle for ``SNAPSHOT_IDLE_S``
        (``now``: whenever one is waiting). A run that starts first drops the order: it orders its own."""
        due = self.snapshot_due
        if due is None or (not now and time.monotonic() < due[0]):
            return
        self.snapshot_due = None
        worker = self.worker.running()
        if worker is None:
            return
        _, cap, quota_bytes, used = due
        if quota_bytes and used is None:
            _, measured = tree.survey(2000)  # now, off the runs' path
            if measured is None:
                return  # the room left cannot be known; no snapshot rather than one that floods the quota
            used = measured[0]
        room = quota_bytes - (used or 0) if quota_bytes else cap
        send_to_worker(worker, events.snapshot_order(max(0, min(cap, room))), b"", time.monotonic() + 1)
