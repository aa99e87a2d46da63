"""Running one cell: hand it to a worker, move its output and results, judge how it ended.

A mixin of the supervisor (it uses the supervisor's channel, zygote and process control); kept
apart so the request loop and the life of a run can each be read on their own.
"""

from __future__ import annotations

import select
import time
from typing import TYPE_CHECKING, Any

from .. import protocol
from ..output import Capture, Streamer
from . import files, processes, quota, run, tree, wipe

if TYPE_CHECKING:
    from ..zygote.zygote import WorkerHandle, Zygote

QUOTA_CHECK_S = 1.0  # how often a session's /mnt/data usage is checked while something may write
FLOOD_NOTICE = (
    "/mnt/data grew past {ceiling} times the session's disk quota: every process of the session was "
    "stopped (variables were lost) and the largest files were removed until it fit: {removed}"
)


class Cells:
    """The supervisor's side of a run (see ``supervisor.Supervisor`` for the attributes it uses)."""

    chan_in: int
    wake_r: int
    zygote: Zygote
    channel: protocol.FrameReader
    pending: Any
    exits: dict[int, int]
    spare: WorkerHandle | None
    session_worker: WorkerHandle | None
    session_files: dict[str, tuple[int, int]]
    session_options: dict[str, Any]
    notices: list[str]
    session_lost: bool
    oom_baseline: int | None

    # Provided by the supervisor:
    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        raise NotImplementedError

    def take_worker(self) -> WorkerHandle:
        raise NotImplementedError

    def take_zygote_news(self) -> None:
        raise NotImplementedError

    def kill_all(self) -> bool:
        raise NotImplementedError

    def order_spare(self) -> None:
        raise NotImplementedError

    def execute(self, request: dict[str, Any], payload: bytes) -> None:
        started = time.monotonic()
        rid = request["id"]
        session = request["mode"] == "session"
        options = request["options"] if isinstance(request.get("options"), dict) else {}
        timeout = float(request["timeout"])
        self.exits = {pid: status for pid, status in self.exits.items() if self.is_current(pid)}
        restarted = False
        if session:
            self.session_options = options
            handle, restarted = self.live_session_worker()
        else:
            handle = self.take_worker()
        cap = run.option(options, "max_output_bytes")
        state = run.RunState(
            rid,
            handle,
            session=session,
            deadline=started + timeout,
            options=options,
            stdout=Capture(cap),
            stderr=Capture(cap),
            streamer=Streamer(self.send, rid) if request.get("stream") else None,
            next_quota_check=started + QUOTA_CHECK_S,
        )
        oom_before = self.oom_baseline
        if not run.send_cell(handle, {"options": options, "once": not session}, payload, state.deadline):
            state.exited = self.exits.get(handle.pid, -1)
        self.pump(state)
        status, error, lost = self.outcome(state, oom_before)
        header = done_header(state, status, error, restarted=restarted or lost, started=started, notes=self.notices)
        self.notices = []
        files_payload = b""
        if session:
            self.report_session_files(header, options, state)
        else:
            header["files"], files_payload = files.collect(options)
        self.send(header, files_payload)
        if not session:
            self.reset_after_stateless(rid, handle)
        self.oom_baseline = processes.oom_kills()

    def live_session_worker(self) -> tuple[WorkerHandle, bool]:
        """The session's worker, a fresh one if it is gone; and whether it had to be replaced."""
        if self.session_worker is not None and self.session_worker.pid not in self.exits:
            return self.session_worker, False
        restarted = self.session_worker is not None or self.session_lost
        self.session_lost = False
        if self.session_worker is not None:
            self.session_worker.close()
        self.session_worker = self.take_worker()
        return self.session_worker, restarted

    def is_current(self, pid: int) -> bool:
        return any(h is not None and h.pid == pid for h in (self.spare, self.session_worker))

    def report_session_files(self, header: dict[str, Any], options: dict[str, Any], state: run.RunState) -> None:
        after, measured = tree.survey(2000)
        quota_matters = after != self.session_files or state.reason == "disk_quota"
        measured = quota.with_held(measured) if quota_matters else measured
        over, flooded = quota.quota_state(options, measured=measured) if quota_matters else (None, False)
        if flooded:
            header["notes"] = [*header["notes"], self.flood_response(options)]
            header["session_restarted"] = True
            after, _ = tree.survey(2000)
        header["files"] = tree.changed(self.session_files, after)
        self.session_files = after
        over = over or state.quota_message
        if over:
            header["status"] = "error"
            header["error"] = {"type": "DiskQuotaExceeded", "message": over, "traceback": ""}

    def flood_response(self, options: dict[str, Any]) -> str:
        """Past the ceiling: nothing of the session's may keep writing, and /mnt/data goes back under the quota."""
        self.kill_all()
        self.session_lost = True
        try:
            removed = quota.shed(options)
        except Exception as exc:  # noqa: BLE001 - the host replaces a container whose wipe failed
            removed = [f"(not all: {exc!r:.200})"]
        shown = ", ".join(removed[:10]) + (f" and {len(removed) - 10} more" if len(removed) > 10 else "")
        return FLOOD_NOTICE.format(ceiling=quota.CEILING, removed=shown or "none")

    def reset_after_stateless(self, rid: int, handle: WorkerHandle) -> None:
        """Leave nothing of the run for the next one, and tell the host whether that worked."""
        handle.close()
        problems = [] if self.kill_all() else ["processes of the sandbox user survived"]
        problems += wipe.wipe()
        self.send({"ev": "clean", "id": rid, "ok": not problems, "problems": problems[:10]})
        self.order_spare()

    def pump(self, state: run.RunState) -> None:
        """Move output and results until the cell is done or the worker is gone."""
        watched = {self.chan_in: "channel", self.wake_r: "wake", self.zygote.fileno(): "zygote"}
        watched.update({state.handle.stdout: "stdout", state.handle.stderr: "stderr", state.handle.results: "results"})
        while not state.finished:
            now = time.monotonic()
            if self.deadline_passed(state, now):
                self.on_deadline(state)
                continue
            if self.quota_check_due(state, now) and self.hold_to_quota(state):
                continue
            ready, _, _ = select.select(list(watched), [], [], self.next_wait(state, now))
            for fd in ready:
                if not self.on_ready(state, watched[fd]):
                    watched.pop(fd, None)
            if state.streamer is not None:
                state.streamer.maybe_flush(time.monotonic())
            self.after_events(state)
        for name in ("stdout", "stderr"):
            run.read_output(state, name)
        # No last flush of the streamer: the done header carries the whole output, and a frame less
        # per run is a wake-up less for the shim, the engine and the host (a run is a few ms).

    def deadline(self, state: run.RunState) -> float:
        """When the run must next be acted on: its time limit, an interrupt's grace, an exit status due."""
        at = state.deadline if state.interrupted_at is None else state.interrupted_at + run.INTERRUPT_GRACE_S
        if state.results_closed_at is not None:
            at = min(at, state.results_closed_at + run.EXIT_STATUS_WAIT_S)
        return at

    def deadline_passed(self, state: run.RunState, now: float) -> bool:
        return now >= self.deadline(state)

    def next_wait(self, state: run.RunState, now: float) -> float:
        """How long select may wait: until the deadline, the next output flush or the next quota check."""
        wait = self.deadline(state) - now
        if state.streamer is not None:
            wait = min(wait, state.streamer.next_flush(now))
        if self.quota_check_due(state, None):
            wait = min(wait, max(0.0, state.next_quota_check - now))
        return max(0.0, wait)

    def quota_check_due(self, state: run.RunState, now: float | None) -> bool:
        """Whether this run's session has a quota to check (``now``: and a check is due now)."""
        watched = state.session and "data_quota_bytes" in state.options and state.reason is None
        return watched and (now is None or now >= state.next_quota_check)

    def hold_to_quota(self, state: run.RunState) -> bool:
        """Stop the run when /mnt/data is over the quota; True when its worker was killed."""
        state.next_quota_check = time.monotonic() + QUOTA_CHECK_S
        over, flooded = quota.quota_state(state.options)
        if over:
            state.quota_message = over  # what was seen: stopping the run may free what was counted
            self.stop(state, "disk_quota")
        if flooded:
            self.kill_run(state)  # no interrupt, no grace: it is writing as fast as it can
        return flooded

    def on_ready(self, state: run.RunState, what: str) -> bool:
        """Handle one readable descriptor; False to stop watching it."""
        if what == "channel":
            self.channel.fill()
            for request, payload in self.channel.frames():
                if request.get("op") == "interrupt" and request.get("id") == state.request_id:
                    self.stop(state, "cancelled")
                else:
                    self.pending.append((request, payload))
            if self.channel.eof:
                state.reason = state.reason or "cancelled"
                self.kill_run(state)
                return False
        elif what in ("wake", "zygote"):
            self.take_zygote_news()
        elif what in ("stdout", "stderr"):
            return run.read_output(state, what)
        else:
            run.read_results(state, self.send)
            return not state.results.eof
        return True

    def after_events(self, state: run.RunState) -> None:
        if state.reason == "violation" and state.exited is None:
            self.kill_run(state)
        elif state.handle.pid in self.exits and not state.finished:
            run.read_results(state, self.send)  # it may have finished just before dying
            if state.done is None:
                state.exited = self.exits[state.handle.pid]

    def stop(self, state: run.RunState, reason: str) -> None:
        state.reason = state.reason or reason
        if state.session and state.interrupted_at is None and run.interrupt(state):
            return
        self.kill_run(state)

    def on_deadline(self, state: run.RunState) -> None:
        if state.results_closed_at is not None and time.monotonic() >= state.results_closed_at + run.EXIT_STATUS_WAIT_S:
            self.kill_run(state)  # the worker closed its result channel and did not exit
        elif state.interrupted_at is not None:
            self.kill_run(state)  # the interrupt was ignored or caught
        else:
            self.stop(state, "timeout")

    def kill_run(self, state: run.RunState) -> None:
        self.kill_all()
        state.exited = self.exits.get(state.handle.pid, -1)

    def outcome(self, state: run.RunState, oom_before: int | None) -> tuple[str, dict[str, Any] | None, bool]:
        """(status, error, session_restarted) for a finished run."""
        if state.done is not None and state.reason != "violation":
            status, error = run.done_status(state)
            return status, error, False
        if state.session:
            self.kill_all()  # the session's worker is gone or must go; the next run gets a fresh one
            self.order_spare()
        status, error = run.worker_status(state, oom_before, processes.oom_kills())
        return status, error, state.session


def done_header(
    state: run.RunState, status: str, error: Any, *, restarted: bool, started: float, notes: list[str]
) -> dict[str, Any]:
    """The ``done`` event for the host, built from checked values only."""
    cut = {name for name in ("stdout", "stderr") if getattr(state, name).truncated}
    return {
        "ev": "done",
        "id": state.request_id,
        "status": status,
        "result": (state.done or {}).get("result"),
        "error": error,
        "stdout": state.stdout.text(),
        "stderr": state.stderr.text(),
        "truncated": sorted({*state.truncated, *cut}),
        "session_restarted": restarted,
        "duration_ms": round((time.monotonic() - started) * 1000, 3),
        "notes": notes,
        "recycle": status not in ("ok", "error") or state.reason == "violation",
    }
