"""Asking a worker something that is not a cell (restore, sync, variables), and ending one.

The supervisor never unpickles, never calls a user's ``__repr__`` and never parses a snapshot:
those happen in the worker, as the sandbox user, and what comes back on its result pipe is checked
like any frame of user code (``protocol.worker_frame``). Every request is bounded in time; what to
do with a worker that does not answer in time, dies, or answers with a forged frame is the asker's
(``session_requests`` has ``session_worker.SessionWorker`` replace it with a fresh one). What a
worker answered goes to the host within the host's bounds (``restored_event`` and the like).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from typing import Any

from .. import events, protocol
from ..handles import WorkerHandle, send_to_worker
from ..identity import effective_ids
from ..output import clip_text
from .port import SupervisorPort


def ask(
    supervisor: SupervisorPort, worker: WorkerHandle, header: dict[str, Any], kind: str, limit_s: float
) -> tuple[dict[str, Any] | None, str]:
    """Send a request to ``worker`` and wait for the frame of ``kind``: (frame, "") or (None, why)."""
    deadline = time.monotonic() + limit_s
    if not send_to_worker(worker, header, b"", deadline):
        return None, "its interpreter is gone"
    results = protocol.FrameReader(worker.results, max_header=protocol.MAX_WORKER_HEADER, max_payload=0)
    # The zygote's news, not the host's channel: a request waits for the loop, and a closed channel
    # (readable for good) would turn this wait into a spin.
    news = [fd for fd, what in supervisor.watched_fds().items() if what == "news"]
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
                supervisor.take_zygote_news()
        if gone(supervisor, worker) or results.eof:
            return None, "its interpreter stopped"


def gone(supervisor: SupervisorPort, worker: WorkerHandle) -> bool:
    return supervisor.exit_status(worker.pid) is not None


def end(supervisor: SupervisorPort, worker: WorkerHandle) -> None:
    """Kill one worker (by the pid the zygote gave), as the sandbox user; its exit is the zygote's to reap."""
    if not gone(supervisor, worker):
        with effective_ids(), contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(worker.pid, signal.SIGKILL)
    worker.close()


def restored_event(rid: Any, reply: dict[str, Any]) -> dict[str, Any]:
    """The host's ``restored`` event from a checked worker frame, within the host's bounds."""
    taken_at = reply["taken_at"]
    skipped = [clip_text(item, 1000)[0] for item in reply["skipped"][:1000]]
    note = clip_text(reply["note"], 4000)[0]
    return events.restored(rid, reply["outcome"], reply["restored"], skipped, note, _time(taken_at))


def snapshot_event(rid: Any, reply: dict[str, Any]) -> dict[str, Any]:
    """The host's ``snapshot`` event from a checked worker frame."""
    return events.snapshot(rid, reply["complete"], _time(reply["taken_at"]), reply["size"])


def variables_event(rid: Any, reply: dict[str, Any], limit: int) -> dict[str, Any]:
    """The host's ``variables`` event from a checked worker frame: at most ``limit``, within the host's bounds."""
    items = [
        {**item, "name": item["name"][:4096], "type": item["type"][:4096], "repr": item["repr"][:4096]}
        for item in reply["variables"][: max(0, limit)]
    ]
    return events.variables(rid, items, reply["truncated"] or len(items) < len(reply["variables"]))


def _time(taken_at: float | None) -> float | None:
    return float(taken_at) if taken_at is not None else None
