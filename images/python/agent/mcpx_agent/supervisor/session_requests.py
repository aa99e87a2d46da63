"""The host's session requests (``SESSION_OPS``), each answered with one event.

Restore, sync and variables are answered by asking the session's worker (``worker_requests``): a
worker that does not answer in time, dies or answers with a forged frame is killed, and the session
goes on with a fresh one (the answer says so). The export is written by the supervisor itself
(``notebook``), then put in place (``transfer``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from .. import events
from ..identity import as_sandbox_user
from . import files, notebook, quota, transfer
from .disk_watch import DiskWatch
from .idle_writes import IdleWrites
from .port import SupervisorPort
from .session_worker import SessionWorker
from .tree import RESERVED
from .worker_requests import ask, restored_event, snapshot_event, variables_event

RESTORE_MAX_S = 120.0  # the worker cuts each record at seconds; this ends one that blocks its own alarm
VARIABLES_MAX_S = 15.0
SESSION_OPS = ("restore", "snapshot_sync", "variables", "export_notebook")  # the host's requests handled here


class SessionRequests:
    """Answers the host's session requests, on the session's worker, snapshot and files."""

    def __init__(self, supervisor: SupervisorPort, worker: SessionWorker, idle: IdleWrites, disk: DiskWatch) -> None:
        self.supervisor = supervisor
        self.worker = worker
        self.idle = idle
        self.disk = disk

    def dispatch(self, op: str, rid: Any, request: dict[str, Any]) -> dict[str, Any]:
        """The event answering ``op``."""
        if op == "restore":
            return self.restore(rid)
        if op == "snapshot_sync":
            return self.snapshot_sync(rid, float(request["timeout"]))
        if op == "variables":
            return self.variables(rid, int(request["limit"]), int(request["repr_chars"]))
        return self.export(rid, request)

    def restore(self, rid: Any) -> dict[str, Any]:
        worker, _ = self.worker.live()
        reply, why = ask(self.supervisor, worker, events.restore_request(), "restored", RESTORE_MAX_S)
        if reply is None:
            self.worker.replace(worker, told=True)  # the answer says the variables are gone
            note = f"the snapshot could not be loaded ({why}); the session goes on with empty variables"
            return events.restored(rid, "failed", 0, [], note, None)
        return restored_event(rid, reply)

    def snapshot_sync(self, rid: Any, timeout: float) -> dict[str, Any]:
        timeout = max(0.0, min(timeout, 3600.0))
        worker = self.worker.running()
        if worker is None:
            return events.snapshot(rid, True, *stored_snapshot())
        reply = self.idle.snapshot_sync(worker, timeout)
        if reply is None:
            self.worker.replace(worker)
            return events.snapshot(rid, True, *stored_snapshot())
        return snapshot_event(rid, reply)

    def variables(self, rid: Any, limit: int, repr_chars: int) -> dict[str, Any]:
        worker = self.worker.running()
        if worker is None:
            return events.variables(rid, [], truncated=False)
        request = events.variables_request(max(0, limit), max(0, repr_chars))
        reply, why = ask(self.supervisor, worker, request, "variables", VARIABLES_MAX_S)
        if reply is None:
            self.worker.replace(worker)
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
        self.disk.note_written(placed.path, placed.stat.st_size, placed.stat.st_mtime_ns)
        return events.written(rid, placed.path, placed.stat.st_size, placed.stat.st_mtime)


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
