"""The supervisor: talks to the host over stdin/stdout, never runs user code, never forks a worker.

It runs as root with only CAP_KILL, CAP_SETUID and CAP_SETGID. Workers come from the zygote
(see ``zygote``); the supervisor sends each its cell, enforces deadlines, output caps and the
session's disk quota, and checks every frame a worker sends. After a stateless run it kills every
process of the sandbox user, wipes what they could write, and tells the host whether the
container is clean (only then is it reused).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import sys
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

from . import files, processes, protocol, run, wipe
from .output import Capture, Streamer
from .zygote import Exited, Ready, Spawned, WorkerHandle, Zygote

QUOTA_CHECK_S = 1.0  # how often a session's /mnt/data usage is checked while something may write
SPAWN_WAIT_S = 30.0
AGENT_VERSION = 2
BACKGROUND_NOTICE = (
    "processes left running by an earlier run wrote past the session's disk quota; every process of the "
    "session was stopped (variables were lost, files were kept)"
)


class Supervisor:
    def __init__(self, zygote: Zygote, chan_in: int, chan_out: int) -> None:
        self.zygote = zygote
        self.chan_in = chan_in
        self.chan_out = chan_out
        self.channel = protocol.FrameReader(
            chan_in, max_header=protocol.MAX_REQUEST_HEADER, max_payload=protocol.MAX_REQUEST_PAYLOAD
        )
        self.pending: deque[tuple[dict[str, Any], bytes]] = deque()
        self.exits: dict[int, int] = {}  # wait statuses the zygote reported, by pid
        self.spare: WorkerHandle | None = None
        self.spare_ordered = False
        self.session_worker: WorkerHandle | None = None
        self.session_files: dict[str, tuple[int, int]] = {}
        self.session_options: dict[str, Any] = {}
        self.notices: list[str] = []  # told with the next run's result
        self.session_lost = False  # the session's worker was stopped between runs
        self.next_idle_check = 0.0
        self.oom_baseline: int | None = None
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)

    # -- host channel ----------------------------------------------------------------------------
    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        protocol.send(self.chan_out, header, payload)

    def serve(self) -> int:
        self.await_zygote()
        self.oom_baseline = processes.oom_kills()
        self.send({"ev": "ready", "agent_version": AGENT_VERSION, "python": sys.version.split()[0]})
        self.order_spare()
        while (item := self.next_request()) is not None:
            request, payload = item
            rid = request.get("id")
            try:
                self.dispatch(request, payload)
            except files.FileError as exc:
                self.send({"ev": "error", "id": rid, "message": str(exc)})
            except (OSError, KeyError, TypeError, ValueError) as exc:
                self.send({"ev": "error", "id": rid, "message": f"bad request: {type(exc).__name__}: {exc}"[:500]})
        self.kill_all()
        return 0

    def await_zygote(self) -> None:
        """Wait until the zygote has loaded the libraries (the host waits for our "ready")."""
        while True:
            select.select([self.zygote.fileno()], [], [])
            news = self.zygote.receive()
            if news is None:
                sys.stderr.write("mcpx_agent: the zygote exited while loading the libraries\n")
                os._exit(1)
            if any(isinstance(item, Ready) for item in news):
                return

    def next_request(self) -> tuple[dict[str, Any], bytes] | None:
        while not self.pending:
            self.pending.extend(self.channel.frames())
            if self.pending:
                break
            if self.channel.eof:
                return None
            watch = self.session_worker is not None and bool(self.session_options)
            ready, _, _ = select.select(
                [self.chan_in, self.zygote.fileno(), self.wake_r], [], [], QUOTA_CHECK_S if watch else None
            )
            self.take_zygote_news()
            if watch and time.monotonic() >= self.next_idle_check:
                self.next_idle_check = time.monotonic() + QUOTA_CHECK_S
                self.watch_idle_session()
            if self.chan_in in ready:
                self.channel.fill()
        return self.pending.popleft()

    def dispatch(self, request: dict[str, Any], payload: bytes) -> None:
        op, rid = request.get("op"), request.get("id")
        if op == "ping":
            self.send({"ev": "pong", "id": rid, "oom_kills": processes.oom_kills()})
        elif op == "exec":
            self.execute(request, payload)
        elif op == "list_files":
            listing = files.list_files(str(request["path"]), int(request["limit"]))
            self.send({"ev": "listing", "id": rid, **listing})
        elif op == "read_file":
            meta, data = files.read_file(str(request["path"]), int(request["max_bytes"]))
            self.send({"ev": "file", "id": rid, **meta}, data)
        elif op == "write_file":
            over = files.quota_error(request, extra_bytes=len(payload))
            if over:
                raise files.FileError(f"nothing was written: {over}")
            meta = files.write_file(str(request["path"]), payload)
            # Known now, so the next run does not report it as a file it changed.
            self.session_files[meta["path"]] = (meta["size"], meta.pop("mtime_ns"))
            self.send({"ev": "written", "id": rid, **meta})
        elif op == "interrupt":
            pass  # the run it meant has already finished
        else:
            self.send({"ev": "error", "id": rid, "message": f"unknown op {str(op)[:40]!r}"})

    # -- workers ---------------------------------------------------------------------------------
    def take_zygote_news(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 4096):
                pass
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # our own children: the IPC helper
                pass
        news = self.zygote.receive()
        if news is None:
            sys.stderr.write("mcpx_agent: the zygote is gone; the container cannot run code\n")
            os._exit(1)
        for item in news:
            if isinstance(item, Spawned):
                self.spare_ordered = False
                if self.spare is not None:
                    close_pipes(self.spare)
                self.spare = item.handle
            elif isinstance(item, Exited):
                self.exits[item.pid] = item.status

    def order_spare(self) -> None:
        if self.spare is None and not self.spare_ordered:
            self.zygote.order()
            self.spare_ordered = True

    def take_worker(self) -> WorkerHandle:
        """The spare worker (forked ahead, off the request path), waiting for it if need be."""
        deadline = time.monotonic() + SPAWN_WAIT_S
        while True:
            spare = self.spare
            if spare is not None and spare.pid not in self.exits:
                self.spare = None
                return spare
            if spare is not None:
                close_pipes(spare)
                self.spare = None
            self.order_spare()
            left = deadline - time.monotonic()
            if left <= 0:
                sys.stderr.write("mcpx_agent: the zygote did not deliver a worker\n")
                os._exit(1)
            select.select([self.zygote.fileno(), self.wake_r], [], [], left)
            self.take_zygote_news()

    def kill_all(self) -> bool:
        """Kill every process of the sandbox user (spare and session worker included)."""
        killed = processes.kill_all({self.zygote.pid}, self.take_zygote_news)
        for handle in (self.spare, self.session_worker):
            if handle is not None:
                close_pipes(handle)
        self.spare = self.session_worker = None
        return killed

    def watch_idle_session(self) -> None:
        """Between runs: when something of the session's may still be writing, hold it to the quota."""
        handle = self.session_worker
        if handle is None:
            return
        quiet = {1, os.getpid(), self.zygote.pid, handle.pid, *([self.spare.pid] if self.spare else [])}
        busy = processes.live_pids(quiet) or processes.thread_count(handle.pid) > 1
        if busy and files.quota_error(self.session_options):
            self.kill_all()
            self.session_lost = True
            self.notices.append(BACKGROUND_NOTICE)

    # -- running code ----------------------------------------------------------------------------
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
            if self.session_worker is None or self.session_worker.pid in self.exits:
                restarted = self.session_worker is not None or self.session_lost
                self.session_lost = False
                if self.session_worker is not None:
                    close_pipes(self.session_worker)
                self.session_worker = self.take_worker()
            handle = self.session_worker
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
        header: dict[str, Any] = {
            "ev": "done",
            "id": rid,
            "status": status,
            "result": (state.done or {}).get("result"),
            "error": error,
            "stdout": state.stdout.text(),
            "stderr": state.stderr.text(),
            "truncated": sorted(
                {*state.truncated, *(name for name in ("stdout", "stderr") if getattr(state, name).truncated)}
            ),
            "session_restarted": restarted or lost,
            "duration_ms": round((time.monotonic() - started) * 1000, 3),
            "notes": self.notices,
            "recycle": status not in ("ok", "error") or state.reason == "violation",
        }
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

    def is_current(self, pid: int) -> bool:
        return any(h is not None and h.pid == pid for h in (self.spare, self.session_worker))

    def report_session_files(self, header: dict[str, Any], options: dict[str, Any], state: run.RunState) -> None:
        after, measured = files.survey(2000)
        header["files"] = files.changed(self.session_files, after)
        self.session_files = after
        quota_matters = header["files"] or state.reason == "disk_quota"
        over = files.quota_error(options, measured=measured) if quota_matters else None
        if over:
            header["status"] = "error"
            header["error"] = {"type": "DiskQuotaExceeded", "message": over, "traceback": ""}

    def reset_after_stateless(self, rid: int, handle: WorkerHandle) -> None:
        """Leave nothing of the run for the next one, and tell the host whether that worked."""
        close_pipes(handle)
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
            ready, _, _ = select.select(list(watched), [], [], self.next_wait(state, now))
            for fd in ready:
                if not self.on_ready(state, watched[fd]):
                    watched.pop(fd, None)
            if state.streamer is not None:
                state.streamer.maybe_flush(time.monotonic())
            self.after_events(state)
        for name in ("stdout", "stderr"):
            run.read_output(state, name)
        if state.streamer is not None:
            state.streamer.flush()

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
        if state.session and "data_quota_bytes" in state.options:
            if now >= state.next_quota_check:
                state.next_quota_check = now + QUOTA_CHECK_S
                if state.reason is None and files.quota_error(state.options):
                    self.stop(state, "disk_quota")
            wait = min(wait, max(0.0, state.next_quota_check - now))
        return max(0.0, wait)

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


def close_pipes(handle: WorkerHandle) -> None:
    for fd in (handle.stdout, handle.stderr, handle.results, handle.control):
        with contextlib.suppress(OSError):
            os.close(fd)


def take_channel() -> tuple[int, int]:
    """Move the host channel off fds 0/1 so nothing else can write to it by accident."""
    chan_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 100)
    chan_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 100)
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # stray prints of ours land in stderr, never in the protocol
    os.set_blocking(chan_in, False)
    return chan_in, chan_out
