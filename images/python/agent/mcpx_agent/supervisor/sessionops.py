"""A session's requests beyond its runs: snapshots and history after runs, restore, sync, variables, export.

The supervisor never unpickles, never calls a user's ``__repr__`` and never parses a snapshot:
those happen in the session's worker (``worker/background.py``, ``worker/state.py``), as the sandbox
user, and what comes back on its result pipe is checked like any frame of user code
(``protocol.worker_frame``). Every request to a worker is bounded in time; a worker that does not
answer in time, dies, or answers with a forged frame is killed, and the session goes on with a fresh
one (the answer says so). The history is the supervisor's own (``journal``): it sees every outcome.
Both the snapshot and the history are written once the session is idle; the history also before
any request of the host but a run (``supervisor.dispatch``): those read or copy the session's state
(a pause, a fork and a stop begin with ``snapshot_sync``; the notebook view reads the history).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from typing import TYPE_CHECKING, Any

from .. import protocol
from ..identity import effective_ids
from ..output import clip_text
from . import files, notebook, quota, run, transfer, tree
from .journal import Journal
from .tree import RESERVED

if TYPE_CHECKING:
    from ..zygote.zygote import WorkerHandle
    from .cells import Cells

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


class SessionOps:
    def __init__(self, cells: Cells) -> None:
        self.cells = cells
        self.host = cells.host
        self.journal = Journal()
        # (when, cap, quota bytes, bytes in use if the run counted them) of the next snapshot order
        self.snapshot_due: tuple[float, int, int, int | None] | None = None
        self.history_due: float | None = None  # when the held runs' history is written

    # -- after a session run ------------------------------------------------------------------------
    def after_run(
        self, code: bytes, header: dict[str, Any], state: run.RunState, *, over: bool, used: int | None
    ) -> None:
        """Hold the run for the history and order the next snapshot, both for when the session is idle
        (the result has gone out). ``over``: the run left /mnt/data over the quota; ``used``: the bytes
        in use, if the run counted them (else they are counted when the snapshot is ordered)."""
        history_cap = state.options.get("history_max_bytes")
        if isinstance(history_cap, int) and history_cap > 0:
            self.journal.hold(code, header, state.kept or [], history_cap)
            self.history_due = time.monotonic() + SNAPSHOT_IDLE_S
        cap = state.options.get("snapshot_max_bytes")
        worker = self.cells.session_worker
        if not isinstance(cap, int) or cap <= 0 or worker is not state.handle or self.gone(worker):
            return
        if over:
            return  # no room left for a snapshot
        quota_bytes, _ = quota.limits(state.options)
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
        if not self.journal.held.held:
            return
        usage = self.cells.session_usage
        before = reserved_usage() if usage is not None else None
        self.journal.flush()
        after = reserved_usage() if usage is not None else None
        if usage is not None and before is not None and after is not None and self.cells.session_usage is usage:
            # The count alone: what the history took is the server's, not the next run's growth.
            self.cells.session_usage = (usage[0] + after[0] - before[0], usage[1] + after[1] - before[1])

    def on_channel_closed(self) -> None:
        """The host closed the channel (its server stopped or was killed, or it removes the container):
        the snapshot due (or being written) is finished, then the held history written. In that order
        a history line is on the volume only once the variables it shows are: a container killed in
        between loses the line with the variables, never the variables alone."""
        worker = self.cells.session_worker
        if worker is not None and not self.gone(worker):
            self.order_snapshot(now=True)
            request = {"op": "sync", "timeout": CLOSE_SNAPSHOT_S}
            self.ask(worker, request, "snapshot", CLOSE_SNAPSHOT_S + SYNC_GRACE_S)
        self.write_history()

    def order_snapshot(self, *, now: bool = False) -> None:
        """Send the worker the snapshot order once the session has been idle for ``SNAPSHOT_IDLE_S``
        (``now``: whenever one is waiting). A run that starts first drops the order: it orders its own."""
        due = self.snapshot_due
        if due is None or (not now and time.monotonic() < due[0]):
            return
        self.snapshot_due = None
        worker = self.cells.session_worker
        if worker is None or self.gone(worker):
            return
        _, cap, quota_bytes, used = due
        if quota_bytes and used is None:
            _, measured = tree.survey(2000)  # now, off the runs' path
            if measured is None:
                return  # the room left cannot be known; no snapshot rather than one that floods the quota
            used = measured[0]
        room = quota_bytes - (used or 0) if quota_bytes else cap
        run.send_cell(worker, {"op": "snapshot", "max_bytes": max(0, min(cap, room))}, b"", time.monotonic() + 1)

    # -- requests -----------------------------------------------------------------------------------
    def dispatch(self, op: str, request: dict[str, Any]) -> dict[str, Any]:
        """The event answering ``op`` (without its id)."""
        if op == "restore":
            return self.restore()
        if op == "snapshot_sync":
            return self.sync(float(request["timeout"]))
        if op == "variables":
            return self.variables(int(request["limit"]), int(request["repr_chars"]))
        return self.export(request)

    def restore(self) -> dict[str, Any]:
        worker, _ = self.cells.live_session_worker()
        reply, why = self.ask(worker, {"op": "restore"}, "restored", RESTORE_MAX_S)
        if reply is None:
            self.replace(worker)
            note = f"the snapshot could not be loaded ({why}); the session goes on with empty variables"
            return {"ev": "restored", "found": True, "restored": 0, "skipped": [], "note": note, "taken_at": None}
        return restored_event(reply)

    def sync(self, timeout: float) -> dict[str, Any]:
        timeout = max(0.0, min(timeout, 3600.0))
        worker = self.cells.session_worker
        if worker is None or self.gone(worker):
            return {"ev": "snapshot", "complete": True, **self.stored()}
        self.order_snapshot(now=True)
        reply, _ = self.ask(worker, {"op": "sync", "timeout": timeout}, "snapshot", timeout + SYNC_GRACE_S)
        if reply is None:
            self.replace(worker)
            return {"ev": "snapshot", "complete": True, **self.stored()}
        return snapshot_event(reply)

    def stored(self) -> dict[str, Any]:
        """The snapshot file's time and size, from its stat alone (the supervisor never reads it)."""
        with contextlib.suppress(OSError, files.FileError), _as_user():
            dir_fd = files._open_dir([RESERVED, "snapshot"])
            try:
                st = os.stat("ns.pkl", dir_fd=dir_fd, follow_symlinks=False)
                return {"taken_at": st.st_mtime, "size": st.st_size}
            finally:
                os.close(dir_fd)
        return {"taken_at": None, "size": None}

    def variables(self, limit: int, repr_chars: int) -> dict[str, Any]:
        worker = self.cells.session_worker
        if worker is None or self.gone(worker):
            return {"ev": "variables", "variables": [], "truncated": False}
        request = {"op": "variables", "limit": max(0, limit), "repr_chars": max(0, repr_chars)}
        reply, why = self.ask(worker, request, "variables", VARIABLES_MAX_S)
        if reply is None:
            self.replace(worker)
            self.cells.session_lost = True
            raise files.FileError(f"the session's interpreter did not list its variables ({why}); it was restarted")
        return variables_event(reply, limit)

    def export(self, request: dict[str, Any]) -> dict[str, Any]:
        parts = files.split_path(str(request["path"]))
        if parts[0] in (RESERVED, transfer.STAGING):
            raise files.FileError(f"{parts[0]} is reserved for the server")
        reply = notebook.export_notebook(request.get("read_max"))
        if reply["error"]:
            raise files.FileError(f"the notebook could not be written: {reply['error']}")
        options = {key: request.get(key) for key in ("data_quota_bytes", "data_quota_files")}
        over = quota.quota_error(options)
        if over:
            self.discard_temp()
            raise transfer.QuotaError(f"the notebook was not written: {over}")
        written = self.put_in_place(parts)
        self.cells.note_written(written["path"], written["size"], written.pop("mtime_ns"))
        return written

    # -- helpers --------------------------------------------------------------------------------------
    def put_in_place(self, parts: list[str]) -> dict[str, Any]:
        with _as_user():
            source = files._open_dir([RESERVED])
            try:
                target = files._open_dir(parts[:-1], create=True)
                try:
                    transfer._check_target(target, parts[-1], "/".join(parts))
                    os.rename(notebook.EXPORT_TEMP, parts[-1], src_dir_fd=source, dst_dir_fd=target)
                    os.fsync(target)
                    st = os.stat(parts[-1], dir_fd=target, follow_symlinks=False)
                finally:
                    os.close(target)
            except OSError as exc:
                raise files._oserror(exc, "/".join(parts)) from exc
            finally:
                os.close(source)
        return {"ev": "written", "path": "/".join(parts), "size": st.st_size, "modified": st.st_mtime,
                "mtime_ns": st.st_mtime_ns}  # fmt: skip

    def discard_temp(self) -> None:
        with contextlib.suppress(OSError, files.FileError), _as_user():
            source = files._open_dir([RESERVED])
            try:
                os.unlink(notebook.EXPORT_TEMP, dir_fd=source)
            finally:
                os.close(source)

    def ask(
        self, worker: WorkerHandle, header: dict[str, Any], kind: str, limit_s: float
    ) -> tuple[dict[str, Any] | None, str]:
        """Send a request to ``worker`` and wait for the frame of ``kind``: (frame, "") or (None, why)."""
        deadline = time.monotonic() + limit_s
        if not run.send_cell(worker, header, b"", deadline):
            return None, "its interpreter is gone"
        results = protocol.FrameReader(worker.results, max_header=protocol.MAX_WORKER_HEADER, max_payload=0)
        # The zygote's news, not the host's channel: a request waits for the loop, and a closed channel
        # (readable for good) would turn this wait into a spin.
        news = [fd for fd, what in self.host.watched_fds().items() if what == "news"]
        watched = [worker.results, worker.stdout, worker.stderr, *news]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, f"no answer within {limit_s:.0f} s"
            ready, _, _ = select.select(watched, [], [], left)
            for fd in ready:
                if fd in (worker.stdout, worker.stderr):
                    with contextlib.suppress(OSError):
                        os.read(fd, 1 << 16)  # what unpickling or a repr printed goes nowhere
                elif fd == worker.results:
                    try:
                        results.fill()
                        for frame, payload in results.frames():
                            checked = protocol.worker_frame(frame, payload, 0)
                            if checked["kind"] == kind:
                                return checked, ""
                    except protocol.ProtocolError as exc:
                        return None, f"it answered with a malformed frame: {str(exc)[:100]}"
                else:
                    self.host.take_zygote_news()
            if self.gone(worker) or results.eof:
                return None, "its interpreter stopped"

    def gone(self, worker: WorkerHandle) -> bool:
        return self.host.exit_status(worker.pid) is not None

    def end(self, worker: WorkerHandle) -> None:
        """Kill one worker (by the pid the zygote gave), as the sandbox user; its exit is the zygote's to reap."""
        if not self.gone(worker):
            with effective_ids(), contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(worker.pid, signal.SIGKILL)
        worker.close()

    def replace(self, worker: WorkerHandle) -> None:
        """The session's worker failed a request: it goes, and a fresh one takes its place."""
        self.end(worker)
        if self.cells.session_worker is worker:
            self.cells.session_worker = self.host.take_worker()
            self.host.order_spare()


def reserved_usage() -> tuple[int, int] | None:
    """(bytes, entries) of /mnt/data/.mcpx, itself included; None when it cannot all be counted."""
    try:
        with _as_user():
            top = os.lstat(f"{quota.ROOT}/{RESERVED}")
    except FileNotFoundError:
        return (0, 0)
    except OSError:
        return None
    below = tree.with_hidden((0, 0), [RESERVED])
    return None if below is None else (below[0] + top.st_blocks * 512, below[1] + 1)


def restored_event(reply: dict[str, Any]) -> dict[str, Any]:
    """The host's ``restored`` event from a checked worker frame, within the host's bounds."""
    taken_at = reply["taken_at"]
    return {
        "ev": "restored",
        "found": reply["found"],
        "restored": reply["restored"],
        "skipped": [clip_text(item, 1000)[0] for item in reply["skipped"][:1000]],
        "note": clip_text(reply["note"], 4000)[0],
        "taken_at": float(taken_at) if taken_at is not None else None,
    }


def snapshot_event(reply: dict[str, Any]) -> dict[str, Any]:
    taken_at = reply["taken_at"]
    return {
        "ev": "snapshot",
        "complete": reply["complete"],
        "taken_at": float(taken_at) if taken_at is not None else None,
        "size": reply["size"],
    }


def variables_event(reply: dict[str, Any], limit: int) -> dict[str, Any]:
    items = [
        {**item, "name": item["name"][:4096], "type": item["type"][:4096], "repr": item["repr"][:4096]}
        for item in reply["variables"][: max(0, limit)]
    ]
    truncated = reply["truncated"] or len(items) < len(reply["variables"])
    return {"ev": "variables", "variables": items, "truncated": truncated}


def _as_user() -> Any:
    from ..identity import as_sandbox_user

    return as_sandbox_user()
