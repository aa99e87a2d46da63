"""Running cells: hand each to a worker, move its output and results, judge how it ended.

``Cells`` owns the run's and the session's state (the session's worker, files, options and
quota notices, the OOM-kill count). The supervisor owns the host channel, the zygote and the
spare worker; a run uses them only through ``Host``, so the request loop (``supervisor``) and the
life of a run (here and in ``run``) can each be read on their own.
"""

from __future__ import annotations

import select
import time
from typing import TYPE_CHECKING, Any, Protocol

from ..output import Capture, Streamer
from . import files, processes, quota, run, tree, wipe
from .sessionops import SessionOps

if TYPE_CHECKING:
    from ..zygote.zygote import WorkerHandle

QUOTA_CHECK_S = 1.0  # how often a session's /mnt/data usage is checked while something may write
FLOOD_NOTICE = (
    "/mnt/data grew past {ceiling} times the session's disk quota: every process of the session was "
    "stopped (variables were lost) and the largest files were removed until it fit: {removed}"
)
BACKGROUND_NOTICE = (
    "processes left running by an earlier run wrote past the session's disk quota; every process of the "
    "session was stopped (variables were lost, files were kept)"
)


class Host(Protocol):
    """What a run needs of the supervisor, and all it may use of it."""

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        """Send one frame to the host."""

    def watched_fds(self) -> dict[int, str]:
        """Descriptors a run waits on besides its worker's: ``"channel"`` (the host) or ``"news"`` (the zygote)."""

    def read_channel(self, request_id: int) -> tuple[int, bool]:
        """Read what the host sent: (interrupts of run ``request_id``, whether the channel closed).
        Other requests wait for the request loop."""

    def take_zygote_news(self) -> None:
        """Take the workers the zygote spawned and the exits it reported."""

    # The host's answers to the running cell's tool calls, and pauses of its clock, read so far.
    def take_tool_messages(self) -> list[tuple[dict[str, Any], bytes]]: ...

    def exit_status(self, pid: int) -> int | None:
        """The wait status the zygote reported for worker ``pid``; None while it is not known gone."""

    def forget_exits(self, keep: WorkerHandle | None) -> None:
        """Drop the exit statuses of workers that are neither the spare nor ``keep``."""

    def take_worker(self) -> WorkerHandle:
        """A fresh worker (the spare)."""

    def order_spare(self) -> None:
        """Have the zygote fork the next spare worker, unless one is there or on its way."""

    def kill_all(self) -> bool:
        """Kill every process of the sandbox user and drop the spare; False if some survive."""

    def others_alive(self, worker: WorkerHandle) -> bool:
        """Whether a process of the sandbox user runs besides ``worker`` and the spare."""


class Cells:
    """The runs of one container, stateless or of its session, one at a time."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.session_worker: WorkerHandle | None = None
        self.session_files: dict[str, tuple[int, int]] = {}  # what the last run left, to report changes
        self.session_options: dict[str, Any] = {}  # the last session run's, for the watch between runs
        self.session_usage: tuple[int, int] | None = None  # (bytes, entries) after the last run, if counted
        self.session_lost = False  # the session's worker was stopped between runs
        self.notices: list[str] = []  # told with the next run's result
        self.oom_baseline: int | None = None  # the cgroup's OOM kills when the next run starts
        self.ops = SessionOps(self)  # snapshots, history, restore, variables, export

    def count_oom_kills_from_now(self) -> None:
        """Once the zygote is ready: OOM kills before this were no run's."""
        self.oom_baseline = processes.oom_kills()

    def note_written(self, path: str, size: int, mtime_ns: int) -> None:
        """An upload wrote ``path``: the next run must not report it as a file it changed."""
        self.session_files[path] = (size, mtime_ns)

    def kill_all(self) -> bool:
        """Kill every process of the sandbox user, the session's worker and the spare included."""
        killed = self.host.kill_all()
        if self.session_worker is not None:
            self.session_worker.close()
        self.session_worker = None
        return killed

    def execute(self, request: dict[str, Any], payload: bytes) -> None:
        started = time.monotonic()
        rid = request["id"]
        session = request["mode"] == "session"
        options = request["options"] if isinstance(request.get("options"), dict) else {}
        timeout = float(request["timeout"])
        self.host.forget_exits(keep=self.session_worker)
        restarted = False
        if session:
            self.session_options = options
            self.ops.snapshot_due = None  # this run orders its own
            handle, restarted = self.live_session_worker()
        else:
            handle = self.host.take_worker()
        cap = run.option(options, "max_output_bytes")
        state = run.RunState(
            rid,
            handle,
            session=session,
            deadline=started + timeout,
            options=options,
            stdout=Capture(cap),
            stderr=Capture(cap),
            streamer=Streamer(self.host.send, rid) if request.get("stream") else None,
            next_quota_check=started + QUOTA_CHECK_S,
        )
        oom_before = self.oom_baseline
        if not run.send_cell(handle, {"options": options, "once": not session}, payload, state.deadline):
            state.exited = self.exit_status_or_lost(handle)
        self.pump(state)
        status, error, lost = self.outcome(state, oom_before)
        header = run.done_header(state, status, error, restarted=restarted or lost, started=started, notes=self.notices)
        self.notices = []
        files_payload = b""
        over = False
        used = None
        if session:
            over, used = self.report_session_files(header, options, state)
        else:
            header["files"], files_payload = files.collect(options)
        header["usage"] = run.usage(state, header["files"])
        self.host.send(header, files_payload)
        if session:
            self.ops.after_run(payload, header, state, over=over, used=used)
        else:
            self.reset_after_stateless(rid, handle)
        self.oom_baseline = processes.oom_kills()

    def live_session_worker(self) -> tuple[WorkerHandle, bool]:
        """The session's worker, a fresh one if it is gone; and whether it had to be replaced."""
        if self.session_worker is not None and self.host.exit_status(self.session_worker.pid) is None:
            return self.session_worker, False
        restarted = self.session_worker is not None or self.session_lost
        self.session_lost = False
        if self.session_worker is not None:
            self.session_worker.close()
        self.session_worker = self.host.take_worker()
        return self.session_worker, restarted

    def watch_idle_session(self) -> None:
        """Between runs: when something of the session's may still be writing, hold it to the quota."""
        handle = self.session_worker
        if handle is None:
            return
        busy = self.host.others_alive(handle) or processes.thread_count(handle.pid) > 1
        if not busy:
            return
        over, flooded = quota.quota_state(self.session_options)
        if flooded:
            self.notices.append(self.flood_response(self.session_options))
            self.session_files, _ = tree.survey(2000)
        elif over:
            self.kill_all()
            self.session_lost = True
            self.notices.append(BACKGROUND_NOTICE)

    def session_watched(self) -> bool:
        """Whether the session may have something running between runs that the quota must hold."""
        return self.session_worker is not None and bool(self.session_options)

    def report_session_files(
        self, header: dict[str, Any], options: dict[str, Any], state: run.RunState
    ) -> tuple[bool, int | None]:
        """Report the files the run changed and hold it to the quota: whether it is over, and the bytes
        in use where they were counted. Where the filesystem enforces the quota, the hidden directories
        (snapshot, history, packages) are walked only when a file of the user's changed: the filesystem
        holds whatever a run puts there. With the count alone every run is counted whole (the user may
        write there too), and one that changed no visible file is blamed only if the usage grew."""
        after, visible, unwalked = tree.survey_visible(2000)
        changed = after != self.session_files or state.reason == "disk_quota"
        quota_matters = changed or options.get("disk_enforced") is not True
        measured = quota.with_held(tree.with_hidden(visible, unwalked)) if quota_matters else None
        over, flooded = quota.quota_state(options, measured=measured) if quota_matters else (None, False)
        blamed = over if changed or flooded else quota.if_grown(over, measured, self.session_usage)
        self.session_usage = None if options.get("disk_enforced") is True else measured  # the count's alone
        if flooded:
            header["notes"] = [*header["notes"], self.flood_response(options)]
            header["session_restarted"] = True
            after, _ = tree.survey(2000)
        header["files"] = tree.changed(self.session_files, after)
        self.session_files = after
        blamed = blamed or state.quota_message
        if blamed:
            header["status"] = "error"
            header["error"] = {"type": "DiskQuotaExceeded", "message": blamed, "traceback": ""}
        over = over or blamed
        return bool(over), None if over or measured is None else measured[0]

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
        self.host.send({"ev": "clean", "id": rid, "ok": not problems, "problems": problems[:10]})
        self.host.order_spare()

    def pump(self, state: run.RunState) -> None:
        """Move output and results until the cell is done or the worker is gone."""
        watched = self.host.watched_fds()
        watched.update({state.handle.stdout: "stdout", state.handle.stderr: "stderr", state.handle.results: "results"})
        while not state.finished:
            now = time.monotonic()
            if self.deadline_passed(state, now):
                self.on_deadline(state)
                continue
            if self.quota_check_due(state, now) and self.hold_to_quota(state):
                continue
            writers = [state.handle.control] if state.control_out else []  # tool answers still to write
            ready, writable, _ = select.select(list(watched), writers, [], self.next_wait(state, now))
            if writable:
                run.flush_control(state)
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
        at = run.held_deadline(state, at)  # a tool call waits for a human: the clock stands still
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
            interrupts, closed = self.host.read_channel(state.request_id)
            run.tool_messages(state, self.host.take_tool_messages())
            for _ in range(interrupts):
                self.stop(state, "cancelled")  # a second interrupt kills what caught the first
            if closed:
                state.reason = state.reason or "cancelled"
                self.kill_run(state)
                return False
        elif what == "news":
            self.host.take_zygote_news()
        elif what in ("stdout", "stderr"):
            return run.read_output(state, what)
        else:
            run.read_results(state, self.host.send)
            return not state.results.eof
        return True

    def after_events(self, state: run.RunState) -> None:
        if state.reason == "violation" and state.exited is None:
            self.kill_run(state)
        elif (status := self.host.exit_status(state.handle.pid)) is not None and not state.finished:
            run.read_results(state, self.host.send)  # it may have finished just before dying
            if state.done is None:
                state.exited = status

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
        state.exited = self.exit_status_or_lost(state.handle)

    def exit_status_or_lost(self, handle: WorkerHandle) -> int:
        """The worker's wait status; -1 when the zygote has not reported it (it is gone all the same)."""
        status = self.host.exit_status(handle.pid)
        return -1 if status is None else status

    def outcome(self, state: run.RunState, oom_before: int | None) -> tuple[str, dict[str, Any] | None, bool]:
        """(status, error, session_restarted) for a finished run."""
        if state.done is not None and state.reason != "violation":
            status, error = run.done_status(state)
            return status, error, False
        if state.session:
            self.kill_all()  # the session's worker is gone or must go; the next run gets a fresh one
            self.host.order_spare()
        status, error = run.worker_status(state, oom_before, processes.oom_kills())
        return status, error, state.session
