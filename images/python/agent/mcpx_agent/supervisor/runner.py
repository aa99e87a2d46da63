"""One run inside the supervisor: feed the worker its cell, move its output, judge how it ended.

``Runner`` drives one run, from the cell's arrival to its outcome, and owns nothing past it: the
worker it is handed is the session's or a fresh one, and what becomes of it after the run is its
owner's (``session_worker.SessionWorker``, or the supervisor's reset after a stateless run). The one
exception is a run that must end by force: it kills every process of the sandbox user, the worker
included, and says so (``killed_sandbox_processes``), so that the worker's owner lets it go. It
uses the supervisor only through ``port.SupervisorPort``. What the worker says on its result pipe
is hostile, and is checked and passed on by ``worker_results``; the host's answers to the cell's
tool calls go through ``tool_calls``. The ``done`` event is built from checked values only.
"""

from __future__ import annotations

import os
import select
import signal
import time
from typing import Any, NamedTuple

from .. import events, meter
from ..handles import WorkerHandle, send_to_worker
from ..output import Capture, Streamer, clip_text
from . import processes, quota
from .port import SupervisorPort
from .tool_calls import ToolCalls
from .worker_results import WorkerResults, option

INTERRUPT_GRACE_S = 1.0
EXIT_STATUS_WAIT_S = 1.0  # how long a worker whose result pipe closed may take to be reported gone
STATUS_OF_REASON = {"timeout": "timeout", "cancelled": "cancelled", "disk_quota": "error", "violation": "error"}


class Cell(NamedTuple):
    """A run the host asked for (``exec``), read before anything is done for it."""

    request_id: int
    session: bool
    options: dict[str, Any]
    timeout: float
    stream: bool
    egress_key: Any  # the relay's alone (``relay.give_key``): taken out of the options no worker may see

    @classmethod
    def of(cls, request: dict[str, Any]) -> Cell:
        options = request["options"] if isinstance(request.get("options"), dict) else {}
        key = options.pop("egress_key", None)  # from the request itself: nothing after this sees it
        session = request["mode"] == "session"
        return cls(request["id"], session, options, float(request["timeout"]), bool(request.get("stream")), key)


class Runner:
    """One run, from the cell's arrival to its outcome (a plain class: see ``handles.WorkerHandle``).

    A run that must end by force kills every process of the sandbox user (``killed_sandbox_processes`` says so
    afterwards: a session then lets its worker go)."""

    def __init__(self, supervisor: SupervisorPort, cell: Cell, handle: WorkerHandle, *, started: float) -> None:
        self.supervisor = supervisor
        self.killed_sandbox_processes = False  # every process of the sandbox user was killed (the worker with them)
        self.request_id = cell.request_id
        self.handle = handle
        self.session = cell.session
        self.started = started
        self.deadline = started + cell.timeout
        self.options = options = cell.options
        cap = option(options, "max_output_bytes")
        self.stdout = Capture(cap)
        self.stderr = Capture(cap)
        self.streamer = Streamer(supervisor.send, cell.request_id) if cell.stream else None
        self.next_quota_check = started + quota.CHECK_S
        self.exited: int | None = None  # wait status once the worker is known to be gone
        self.interrupted_at: float | None = None
        self.reason: str | None = None  # "timeout", "cancelled", "disk_quota" or "violation" once we stop it
        self.quota_message: str | None = None  # why the quota stopped it, as measured then
        self.results = WorkerResults(handle.results, cell.request_id, options, supervisor.send)
        self.calls = ToolCalls(handle.control)
        self.meter = meter.RunMeter()
        # How it ended, once ``run`` returns: the worker's status and error, whether the session's
        # worker died with it (or was killed: it ended without saying the cell was done), and how long it took.
        self.status = ""
        self.error: dict[str, Any] | None = None
        self.worker_died = False
        self.duration_ms = 0.0

    @property
    def finished(self) -> bool:
        return self.results.done is not None or self.exited is not None

    def run(self, code: bytes, oom_before: int | None) -> None:
        """Send the cell, move its output and results until it ends, and judge how it ended."""
        if not send_to_worker(self.handle, events.cell_request(self.options, not self.session), code, self.deadline):
            self.exited = self.exit_status_or_lost()
        self.pump()
        self.status, self.error, self.worker_died = self.outcome(oom_before)
        self.duration_ms = round((time.monotonic() - self.started) * 1000, 3)

    def done_event(
        self,
        *,
        restarted: bool,
        notes: list[str],
        files: list[dict[str, Any]],
        later_notes: tuple[str, ...] = (),
        quota_error: str | None = None,
    ) -> dict[str, Any]:
        """The ``done`` event for the host, built from checked values only. ``notes`` come first, then
        the worker's (16 in all); ``later_notes`` after them; ``quota_error`` makes the run an error."""
        cut = {name for name in ("stdout", "stderr") if getattr(self, name).truncated}
        results = self.results
        status, error = self.status, self.error
        if quota_error:
            status, error = "error", events.run_error("DiskQuotaExceeded", quota_error)
        return events.done(
            self.request_id,
            status=status,
            result=(results.done or {}).get("result"),
            error=error,
            stdout=self.stdout.text(),
            stderr=self.stderr.text(),
            truncated=sorted({*results.truncated, *cut}),
            session_restarted=restarted,
            duration_ms=self.duration_ms,
            notes=[*[*notes, *(f"(from the session's sandbox) {note}" for note in results.notes)][:16], *later_notes],
            recycle=self.status not in ("ok", "error") or self.reason == "violation",
            files=files,
            usage=self.meter.usage(results.done, files, results.calls),
        )

    # -- the pump ---------------------------------------------------------------------------------
    def pump(self) -> None:
        """Move output and results until the cell is done or the worker is gone."""
        watched = self.supervisor.watched_fds()
        watched.update({self.handle.stdout: "stdout", self.handle.stderr: "stderr", self.handle.results: "results"})
        while not self.finished:
            now = time.monotonic()
            if now >= self.deadline_at():
                self.on_deadline()
                continue
            if self.quota_check_due(now) and self.hold_to_quota():
                continue
            writers = [self.handle.control] if self.calls.out else []  # tool answers still to write
            ready, writable, _ = select.select(list(watched), writers, [], self.next_wait(now))
            if writable:
                self.calls.flush()
            for fd in ready:
                if not self.on_ready(watched[fd]):
                    watched.pop(fd, None)
            if self.streamer is not None:
                self.streamer.maybe_flush(time.monotonic())
            self.after_events()
        for name in ("stdout", "stderr"):
            self.read_output(name)
        # No last flush of the streamer: the done header carries the whole output, and a frame less
        # per run is a wake-up less for the shim, the engine and the host (a run is a few ms).

    def on_ready(self, what: str) -> bool:
        """Handle one readable descriptor; False to stop watching it."""
        if what == "channel":
            interrupts, closed = self.supervisor.read_channel(self.request_id)
            self.deadline += self.calls.take(self.supervisor.take_tool_messages())
            for _ in range(interrupts):
                self.stop("cancelled")  # a second interrupt kills what caught the first
            if closed:
                self.reason = self.reason or "cancelled"
                self.kill_run()
                return False
        elif what == "news":
            self.supervisor.take_zygote_news()
        elif what in ("stdout", "stderr"):
            return self.read_output(what)
        else:
            self.read_results()
            return not self.results.eof
        return True

    def after_events(self) -> None:
        if self.reason == "violation" and self.exited is None:
            self.kill_run()
        elif (status := self.supervisor.exit_status(self.handle.pid)) is not None and not self.finished:
            self.read_results()  # it may have finished just before dying
            if self.results.done is None:
                self.exited = status

    # -- deadlines, the quota, stopping -----------------------------------------------------------
    def deadline_at(self) -> float:
        """When the run must next be acted on: its time limit, an interrupt's grace, an exit status due."""
        at = self.deadline if self.interrupted_at is None else self.interrupted_at + INTERRUPT_GRACE_S
        at = self.calls.held_deadline(at, interrupted=self.interrupted_at is not None)  # a human is asked
        if self.results.closed_at is not None:
            at = min(at, self.results.closed_at + EXIT_STATUS_WAIT_S)
        return at

    def next_wait(self, now: float) -> float:
        """How long select may wait: until the deadline, the next output flush or the next quota check."""
        wait = self.deadline_at() - now
        if self.streamer is not None:
            wait = min(wait, self.streamer.next_flush(now))
        if self.quota_check_due(None):
            wait = min(wait, max(0.0, self.next_quota_check - now))
        return max(0.0, wait)

    def quota_check_due(self, now: float | None) -> bool:
        """Whether this run's session has a quota to check (``now``: and a check is due now)."""
        watched = self.session and "data_quota_bytes" in self.options and self.reason is None
        return watched and (now is None or now >= self.next_quota_check)

    def hold_to_quota(self) -> bool:
        """Stop the run when /mnt/data is over the quota; True when its worker was killed."""
        self.next_quota_check = time.monotonic() + quota.CHECK_S
        over, flooded = quota.quota_state(self.options)
        if over:
            self.quota_message = over  # what was seen: stopping the run may free what was counted
            self.stop("disk_quota")
        if flooded:
            self.kill_run()  # no interrupt, no grace: it is writing as fast as it can
        return flooded

    def on_deadline(self) -> None:
        closed_at = self.results.closed_at
        if closed_at is not None and time.monotonic() >= closed_at + EXIT_STATUS_WAIT_S:
            self.kill_run()  # the worker closed its result channel and did not exit
        elif self.interrupted_at is not None:
            self.kill_run()  # the interrupt was ignored or caught
        else:
            self.stop("timeout")

    def stop(self, reason: str) -> None:
        self.reason = self.reason or reason
        if self.session and self.interrupted_at is None and self.interrupt():
            return
        self.kill_run()

    def interrupt(self) -> bool:
        """SIGINT to a session's worker (it keeps its state if the cell honours it); False if gone."""
        self.interrupted_at = time.monotonic()
        try:
            os.kill(self.handle.pid, signal.SIGINT)
        except ProcessLookupError:
            return False
        return True

    def kill_sandbox_processes(self) -> None:
        """Kill every process of the sandbox user, this run's worker with them, and say so afterwards."""
        self.supervisor.kill_sandbox_processes()
        self.killed_sandbox_processes = True

    def kill_run(self) -> None:
        self.kill_sandbox_processes()
        self.exited = self.exit_status_or_lost()

    def exit_status_or_lost(self) -> int:
        """The worker's wait status; -1 when the zygote has not reported it (it is gone all the same)."""
        status = self.supervisor.exit_status(self.handle.pid)
        return -1 if status is None else status

    # -- the worker's pipes -----------------------------------------------------------------------
    def read_output(self, name: str) -> bool:
        """Move what the worker printed to ``name`` into its capture; False once the pipe is closed."""
        fd = getattr(self.handle, name)
        capture: Capture = getattr(self, name)
        for _ in range(64):  # bounded, so one chatty stream cannot starve the deadline check
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not chunk:
                return False
            capture.add(chunk)
            if self.streamer is not None:
                self.streamer.add(name, chunk)
        return True

    def read_results(self) -> None:
        """Read and forward the worker's frames; a violation marks the run to be stopped."""
        if self.results.read():
            self.reason = "violation"

    # -- the outcome ------------------------------------------------------------------------------
    def outcome(self, oom_before: int | None) -> tuple[str, dict[str, Any] | None, bool]:
        """(status, error, worker_died) for a finished run: ``worker_died``, the session's worker went with it."""
        if self.results.done is not None and self.reason != "violation":
            status, error = self.done_status()
            return status, error, False
        if self.session:
            self.kill_sandbox_processes()  # the session's worker is gone or must go; the next run gets a fresh one
            self.supervisor.order_spare()
        status, error = self.worker_status(oom_before, processes.oom_kills())
        return status, error, self.session

    def done_status(self) -> tuple[str, dict[str, Any] | None]:
        """(status, error) of a run whose worker said it was done."""
        done = self.results.done
        assert done is not None
        status = done["status"]
        if status == "interrupted":
            status = STATUS_OF_REASON.get(self.reason or "", "error")
        error = done["error"]
        if error is not None:
            cap = option(self.options, "max_result_bytes")
            error = {
                **error,
                **{name: clip_text(error[name], cap, "traceback")[0] for name in ("message", "traceback")},
            }
        return status, error

    def worker_status(self, oom_before: int | None, oom_after: int | None) -> tuple[str, dict[str, Any] | None]:
        """(status, error) of a run whose worker ended without saying it was done."""
        if self.reason == "violation":
            message = (
                "the run wrote data that is not a valid result frame to the sandbox's result channel (fd 3): "
                f"{self.results.violation}; its interpreter was stopped"
            )
            return "error", events.run_error("SandboxProtocolError", message)
        if self.reason is not None:
            return STATUS_OF_REASON.get(self.reason, "error"), None
        wait_status = self.exited if self.exited is not None and self.exited >= 0 else 0
        signalled = os.WIFSIGNALED(wait_status)
        signum = os.WTERMSIG(wait_status) if signalled else None
        oom = (oom_before is not None and oom_after is not None and oom_after > oom_before) or (
            oom_after is None and signum == signal.SIGKILL
        )
        if oom:
            message = "the run exceeded the sandbox's memory limit and was killed"
            return "memory_limit", events.run_error("MemoryLimit", message)
        if signum:
            message = f"the Python process died with signal {signal.Signals(signum).name}"
        elif self.exited is None or self.exited < 0:
            message = "the Python process closed its result channel and was stopped"
        else:
            message = f"the Python process exited with code {os.WEXITSTATUS(wait_status)}"
        return "crashed", events.run_error("Crashed", message)
