"""The supervisor: talks to the host over stdin/stdout and never runs user code.

It runs as root with only CAP_KILL, CAP_SETUID and CAP_SETGID, preloads the scientific stack and
the notebook shell once, and forks a worker per stateless run (or one persistent worker for a
session). It enforces deadlines and output caps, and after a stateless run kills every other
process and wipes the writable directories so the next run sees nothing of this one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from . import files, protocol, sandbox_user, worker
from .output import Capture, Streamer
from .shell import SandboxShell

INTERRUPT_GRACE_S = 1.0
QUOTA_CHECK_S = 1.0  # how often a session run's /mnt/data usage is checked against its quota
STATUS_OF_REASON = {"timeout": "timeout", "cancelled": "cancelled", "disk_quota": "error"}
AGENT_VERSION = 1


@dataclass
class RunState:
    request_id: int
    handle: worker.WorkerHandle
    session: bool
    deadline: float
    stdout: Capture
    stderr: Capture
    streamer: Streamer | None
    done: dict[str, Any] | None = None
    exited: int | None = None  # wait status once the worker is gone
    interrupted_at: float | None = None
    reason: str | None = None  # "timeout", "cancelled" or "disk_quota" once we started stopping it
    options: dict[str, Any] = field(default_factory=dict)
    next_quota_check: float = 0.0
    killed_by_us: bool = False
    results: protocol.FrameReader = field(init=False)

    def __post_init__(self) -> None:
        self.results = protocol.FrameReader(self.handle.results, max_payload=64 << 20)


class Supervisor:
    def __init__(self, shell: SandboxShell, chan_in: int, chan_out: int) -> None:
        self.shell = shell
        self.chan_in = chan_in
        self.chan_out = chan_out
        self.channel = protocol.FrameReader(chan_in)
        self.pending: list[tuple[dict[str, Any], bytes]] = []
        self.session_worker: worker.WorkerHandle | None = None
        self.session_files: dict[str, tuple[int, int]] = {}
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        self.exits: dict[int, int] = {}
        # A worker forked (and warmed) ahead of the next request, after the previous run's
        # processes are all gone: the fork is then off the request path. kill(-1) takes it too.
        self.spare: worker.WorkerHandle | None = None
        self.oom_baseline: int | None = None  # the OOM-kill counter when the last run ended

    # -- channel -------------------------------------------------------------------------
    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        protocol.send(self.chan_out, header, payload)

    def next_request(self) -> tuple[dict[str, Any], bytes] | None:
        while not self.pending:
            self.pending.extend(self.channel.frames())
            if self.pending:
                break
            if self.channel.eof:
                return None
            selector = selectors.DefaultSelector()
            selector.register(self.chan_in, selectors.EVENT_READ)
            selector.select()
            selector.close()
            self.channel.fill()
        return self.pending.pop(0)

    def serve(self) -> None:
        self.oom_baseline = sandbox_user.oom_kills()
        self.send({"ev": "ready", "agent_version": AGENT_VERSION, "python": sys.version.split()[0]})
        self.prefork()
        while True:
            item = self.next_request()
            if item is None:
                break
            request, payload = item
            try:
                self.dispatch(request, payload)
            except files.FileError as exc:
                self.send({"ev": "error", "id": request.get("id"), "message": str(exc)})
            except OSError as exc:
                self.send({"ev": "error", "id": request.get("id"), "message": f"{exc.strerror or exc}"})
        self.kill_all()

    def dispatch(self, request: dict[str, Any], payload: bytes) -> None:
        op = request.get("op")
        rid = request.get("id")
        if op == "ping":
            self.send({"ev": "pong", "id": rid, "oom_kills": sandbox_user.oom_kills()})
        elif op == "exec":
            self.execute(request)
        elif op == "list_files":
            self.send(
                {
                    "ev": "reply",
                    "id": rid,
                    **files.list_files(request.get("path", "."), int(request.get("limit", 1000))),
                }
            )
        elif op == "read_file":
            meta, data = files.read_file(request["path"], int(request["max_bytes"]))
            self.send({"ev": "reply", "id": rid, **meta}, data)
        elif op == "write_file":
            over = files.quota_error(request, extra_bytes=len(payload))
            if over:
                raise files.FileError(f"nothing was written: {over}")
            meta = files.write_file(request["path"], payload)
            # Known now, so the next run does not report it as a file it changed.
            self.session_files[meta["path"]] = (meta["size"], meta.pop("mtime_ns"))
            self.send({"ev": "reply", "id": rid, **meta})
        elif op == "interrupt":
            pass  # the run it meant has already finished
        else:
            self.send({"ev": "error", "id": rid, "message": f"unknown op {op!r}"})

    # -- children ------------------------------------------------------------------------
    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exits[pid] = status

    def drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 4096):
                pass
        self.reap()

    # -- running code --------------------------------------------------------------------
    def execute(self, request: dict[str, Any]) -> None:
        started = time.monotonic()
        self.reap()
        session = request.get("mode") == "session"
        options = request.get("options", {})
        restarted = False
        if session:
            if self.session_worker is None or self.session_worker.pid in self.exits:
                restarted = self.session_worker is not None
                self.start_session_worker()
            assert self.session_worker is not None
            handle = self.session_worker
            protocol.send(handle.control, {"code": request["code"], "options": options})
        else:
            handle = self.take_worker()
            try:
                protocol.send(handle.control, {"code": request["code"], "options": options, "once": True})
            except OSError:  # the spare died since we reaped: fork one for this run
                self.close_pipes(handle)
                handle = worker.spawn(self.shell, {"code": request["code"], "options": options})
        cap = int(options.get("max_output_bytes", 65536))
        state = RunState(
            request_id=request["id"],
            handle=handle,
            session=session,
            deadline=started + float(request.get("timeout", 30.0)),
            stdout=Capture(cap),
            stderr=Capture(cap),
            streamer=Streamer(self.send, request["id"]) if request.get("stream") else None,
            options=options,
            next_quota_check=started + QUOTA_CHECK_S,
        )
        oom_before = self.oom_baseline  # nothing runs between runs, so this is the count at start
        self.pump(state)
        status, error, restarted_now = self.outcome(state, oom_before)
        restarted = restarted or restarted_now
        header: dict[str, Any] = {
            "ev": "done",
            "id": state.request_id,
            "status": status,
            "result": (state.done or {}).get("result"),
            "error": error,
            "stdout": state.stdout.text(),
            "stderr": state.stderr.text(),
            "truncated": [
                name for name, cap_ in (("stdout", state.stdout), ("stderr", state.stderr)) if cap_.truncated
            ],
            "session_restarted": restarted,
            "duration_ms": round((time.monotonic() - started) * 1000, 3),
        }
        payload = b""
        if session:
            after, measured = files.survey(2000)
            header["files"] = files.changed(self.session_files, after)
            self.session_files = after
            quota_matters = header["files"] or state.reason == "disk_quota"
            over = files.quota_error(options, measured=measured) if quota_matters else None
            if over:
                header["status"] = "error"
                header["error"] = {"type": "DiskQuotaExceeded", "message": over, "traceback": ""}
        else:
            header["files"], payload = self.collect_files(options)
        header["recycle"] = status not in ("ok", "error")
        self.send(header, payload)
        if not session:
            self.close_pipes(handle)
            self.kill_all()
            sandbox_user.wipe()
            self.exits.clear()
        self.oom_baseline = sandbox_user.oom_kills()
        if not session:
            self.prefork()

    def start_session_worker(self) -> None:
        if self.session_worker is not None:
            self.close_pipes(self.session_worker)
        self.session_worker = self.take_worker()

    def prefork(self) -> None:
        """Fork the next worker now, while nothing runs (every process of the last run is gone)."""
        if self.spare is None:
            self.spare = worker.spawn(self.shell, None, warm=True)

    def take_worker(self) -> worker.WorkerHandle:
        """The pre-forked worker if it is still there, else a new one (it serves its control pipe)."""
        spare, self.spare = self.spare, None
        if spare is not None and spare.pid not in self.exits:
            return spare
        if spare is not None:
            self.close_pipes(spare)
        return worker.spawn(self.shell, None)

    def kill_all(self) -> None:
        """Kill every process but init and us (the spare too: it is forked again when needed)."""
        sandbox_user.kill_everything(self.reap)
        if self.spare is not None:
            self.close_pipes(self.spare)
            self.spare = None

    def close_pipes(self, handle: worker.WorkerHandle) -> None:
        for fd in (handle.stdout, handle.stderr, handle.results, handle.control):
            with contextlib.suppress(OSError):
                os.close(fd)

    def pump(self, state: RunState) -> None:
        """Move output and results until the cell is done or the worker is gone."""
        selector = selectors.DefaultSelector()
        selector.register(self.chan_in, selectors.EVENT_READ, "channel")
        selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        selector.register(state.handle.stdout, selectors.EVENT_READ, "stdout")
        selector.register(state.handle.stderr, selectors.EVENT_READ, "stderr")
        selector.register(state.handle.results, selectors.EVENT_READ, "results")
        try:
            while state.done is None and state.exited is None:
                now = time.monotonic()
                wait = state.deadline - now
                if state.interrupted_at is not None:
                    wait = state.interrupted_at + INTERRUPT_GRACE_S - now
                if state.streamer is not None:
                    wait = min(wait, state.streamer.next_flush(now))
                if state.session and "data_quota_bytes" in state.options:
                    if now >= state.next_quota_check:
                        state.next_quota_check = now + QUOTA_CHECK_S
                        if state.reason is None and files.quota_error(state.options):
                            self.begin_interrupt(state, "disk_quota")
                    wait = min(wait, max(0.0, state.next_quota_check - now))
                if wait <= 0:
                    self.on_deadline(state)
                    continue
                for key, _ in selector.select(wait):
                    self.on_ready(state, key.data, selector)
                if state.streamer is not None:
                    state.streamer.maybe_flush(time.monotonic())
                if state.handle.pid in self.exits and state.exited is None and state.done is None:
                    self.read_results(state)  # the worker may have finished just before dying
                    if state.done is None:
                        state.exited = self.exits[state.handle.pid]
        finally:
            selector.close()
        for name in ("stdout", "stderr"):
            self.read_output(state, name)
        if state.streamer is not None:
            state.streamer.flush()

    def on_ready(self, state: RunState, what: str, selector: selectors.BaseSelector) -> None:
        if what == "channel":
            self.channel.fill()
            for request, payload in self.channel.frames():
                if request.get("op") == "interrupt" and request.get("id") == state.request_id:
                    self.begin_interrupt(state, "cancelled")
                else:
                    self.pending.append((request, payload))
            if self.channel.eof:
                selector.unregister(self.chan_in)
                self.kill_all()
                state.killed_by_us = True
                state.reason = state.reason or "cancelled"
        elif what == "wake":
            self.drain_wakeups()
        elif what in ("stdout", "stderr"):
            if not self.read_output(state, what):
                selector.unregister(getattr(state.handle, what))
        else:
            self.read_results(state)
            if state.results.eof:
                selector.unregister(state.handle.results)
                self.reap()
                if state.done is None:
                    state.exited = self.exits.get(state.handle.pid, 0)

    def read_output(self, state: RunState, name: str) -> bool:
        fd = getattr(state.handle, name)
        capture: Capture = getattr(state, name)
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
            if state.streamer is not None:
                state.streamer.add(name, chunk)
        return True

    def read_results(self, state: RunState) -> None:
        try:
            state.results.fill()
            frames = state.results.frames()
        except protocol.ProtocolError:
            state.results.eof = True
            frames = []
        for header, payload in frames:
            kind = header.get("kind")
            if kind == "done":
                state.done = header
            elif kind == "image" and payload:
                self.send({**header, "ev": "image", "id": state.request_id}, payload)
            elif kind == "text":
                self.send({"ev": "text", "id": state.request_id, "text": str(header.get("text", ""))[:65536]})

    def begin_interrupt(self, state: RunState, reason: str) -> None:
        state.reason = state.reason or reason
        if state.session and state.interrupted_at is None:
            state.interrupted_at = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.kill(state.handle.pid, signal.SIGINT)
        else:
            self.kill_run(state)

    def on_deadline(self, state: RunState) -> None:
        if state.interrupted_at is not None:
            self.kill_run(state)  # the interrupt was ignored or caught
        else:
            self.begin_interrupt(state, "timeout")

    def kill_run(self, state: RunState) -> None:
        state.killed_by_us = True
        self.kill_all()
        self.reap()
        state.exited = self.exits.get(state.handle.pid, -1)

    def outcome(self, state: RunState, oom_before: int | None) -> tuple[str, dict[str, Any] | None, bool]:
        """(status, error, session_restarted) for a finished run."""
        done = state.done
        if done is not None:
            status = done.get("status", "error")
            if status == "interrupted":
                status = STATUS_OF_REASON.get(state.reason or "", "error")
            return status, done.get("error"), False
        restarted = state.session
        if state.session:
            self.close_pipes(state.handle)
            self.kill_all()
            self.start_session_worker()
        if state.reason is not None:
            return STATUS_OF_REASON.get(state.reason, "error"), None, restarted
        wait_status = state.exited or 0
        oom_after = sandbox_user.oom_kills()
        signalled = os.WIFSIGNALED(wait_status)
        signum = os.WTERMSIG(wait_status) if signalled else None
        oom = (oom_before is not None and oom_after is not None and oom_after > oom_before) or (
            oom_after is None and signum == signal.SIGKILL
        )
        if oom:
            message = "the run exceeded the sandbox's memory limit and was killed"
            return "memory_limit", {"type": "MemoryLimit", "message": message, "traceback": ""}, restarted
        if signalled:
            name = signal.Signals(signum).name if signum else "?"
            message = f"the Python process died with signal {name}"
        else:
            message = f"the Python process exited with code {os.WEXITSTATUS(wait_status)}"
        return "crashed", {"type": "Crashed", "message": message, "traceback": ""}, restarted

    def collect_files(self, options: dict[str, Any]) -> tuple[list[dict[str, Any]], bytes]:
        """Files a stateless run left in /mnt/data, with their bytes (within the caps)."""
        budget = int(options.get("collect_bytes", 0))
        per_file = int(options.get("collect_file_bytes", 0))
        listing = files.snapshot(limit=int(options.get("collect_files", 100)))
        entries: list[dict[str, Any]] = []
        chunks: list[bytes] = []
        offset = 0
        for path, (size, mtime_ns) in sorted(listing.items()):
            entry: dict[str, Any] = {"path": path, "size": size, "modified": mtime_ns / 1e9, "new": True}
            if size <= per_file and size <= budget:
                try:
                    _, data = files.read_file(path, per_file)
                except files.FileError as exc:
                    entry["note"] = str(exc)
                else:
                    entry["offset"], entry["length"] = offset, len(data)
                    chunks.append(data)
                    offset += len(data)
                    budget -= len(data)
            else:
                entry["note"] = "not kept: over the size cap for stateless files"
            entries.append(entry)
        return entries, b"".join(chunks)


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
