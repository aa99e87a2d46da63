"""The supervisor: talks to the host over stdin/stdout, never runs user code, never forks a worker.

It runs as root with only CAP_KILL, CAP_SETUID and CAP_SETGID. Workers come from the zygote
(see ``zygote``); the supervisor sends each its cell, enforces deadlines, output caps and the
session's disk quota, and checks every frame a worker sends. After a stateless run it kills every
process of the sandbox user, wipes what they could write, and tells the host whether the
container is clean (only then is it reused). Each run is a ``runner.Runner``'s, and a session's
cells, worker, files, snapshot, history and requests are ``interpreter_keeper.InterpreterKeeper``'s
and its parts': the supervisor is the ``port.SupervisorPort`` they run on, and dispatches each
request of the host to one of them.

It is forked off the zygote once the libraries are loaded, so it shares their pages and copies
only those it writes (under gVisor it is forked before them; see ``__main__.main``). A stateless
cell that needs none of the data libraries gets its worker from the lean zygote (``zygote.lean``,
``routing``); a session's worker always comes from the full one.
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
from typing import Any

from .. import events, protocol, relay
from ..handles import WorkerHandle
from ..zygote.zygote import Exited, Ready, Spawned, Zygote
from . import files, history_page, processes, quota, routing, transfer, wipe
from .interpreter_keeper import InterpreterKeeper
from .runner import Cell, Runner
from .session_requests import SESSION_OPS
from .spares import Spares

SPAWN_WAIT_S = 30.0
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class Supervisor:
    def __init__(self, zygote: Zygote, lean: Zygote | None, chan_in: int, chan_out: int) -> None:
        self.zygote = zygote
        self.lean = lean  # the lean zygote (``zygote.lean``), where there is one
        self.chan_in = chan_in
        self.chan_out = chan_out
        self.channel = protocol.FrameReader(
            chan_in, max_header=protocol.MAX_REQUEST_HEADER, max_payload=protocol.MAX_REQUEST_PAYLOAD
        )
        self.pending: deque[tuple[dict[str, Any], bytes]] = deque()
        self.tool_messages: list[tuple[dict[str, Any], bytes]] = []  # for the running cell (``take_tool_messages``)
        self.exits: dict[int, int] = {}  # wait statuses the zygote reported, by pid
        self.spares = Spares(zygote, lean)
        self.keeper = InterpreterKeeper(self)
        self.oom_baseline: int | None = None  # the cgroup's OOM kills when the next run starts
        self.uploads = transfer.Uploads()
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)

    # -- host channel ----------------------------------------------------------------------------
    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        protocol.send(self.chan_out, header, payload)

    def serve(self) -> int:
        close_posix_queues()
        wipe.settle_tops()
        self.await_zygote()
        self.oom_baseline = processes.oom_kills()  # those before the zygote was ready were no run's
        transfer.purge_staging()
        self.send(events.ready(protocol.AGENT_VERSION, sys.version.split()[0]))
        self.order_spare()
        while (item := self.next_request()) is not None:
            request, payload = item
            rid = request.get("id")
            try:
                self.dispatch(request, payload)
            except (transfer.QuotaError, transfer.TooLargeError) as exc:
                kind = "quota" if isinstance(exc, transfer.QuotaError) else "too_large"
                self.send(events.failure(rid, str(exc), kind))
            except files.FileError as exc:
                self.send(events.failure(rid, str(exc)))
            except (OSError, KeyError, TypeError, ValueError) as exc:
                self.send(events.failure(rid, f"bad request: {type(exc).__name__}: {exc}"[:500]))
        self.keeper.idle.on_channel_closed()  # its container goes next: what is due is written first
        self.uploads.abort_all()
        self.keeper.worker.kill_sandbox_processes()
        return 0

    def await_zygote(self) -> None:
        """Wait until the zygotes have loaded the libraries (the host waits for our "ready")."""
        waiting = {zygote.fileno(): zygote for zygote in self.zygotes()}
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [])
            for fd in ready:
                news = waiting[fd].receive()
                if news is None:
                    sys.stderr.write("mcpx_agent: a zygote exited while loading the libraries\n")
                    os._exit(1)
                if any(isinstance(item, Ready) for item in news):
                    del waiting[fd]

    def zygotes(self) -> list[Zygote]:
        return [self.zygote] if self.lean is None else [self.zygote, self.lean]

    def next_request(self) -> tuple[dict[str, Any], bytes] | None:
        while not self.pending:
            self.pending.extend(self.channel.frames())
            if self.pending:
                break
            if self.channel.eof:
                return None
            watch = self.keeper.disk.watched()
            due = self.keeper.idle.due_in()
            waits = [wait for wait in (quota.CHECK_S if watch else None, due) if wait is not None]
            watched = [self.chan_in, self.wake_r, *(zygote.fileno() for zygote in self.zygotes())]
            ready, _, _ = select.select(watched, [], [], min(waits) if waits else None)
            self.take_zygote_news()
            if self.chan_in not in ready:  # idle: the history or a snapshot ordered after the last run may be due
                self.keeper.idle.on_idle()
            if watch:
                self.keeper.disk.watch_when_due()
            if self.chan_in in ready:
                self.channel.fill()
        return self.pending.popleft()

    def dispatch(self, request: dict[str, Any], payload: bytes) -> None:
        op, rid = request.get("op"), request.get("id")
        if op != "exec":  # it may read or copy the session's state: its history first (a run only adds to it)
            self.keeper.idle.write_history()
        if op == "ping":
            self.send(events.pong(rid, processes.oom_kills()))
        elif op == "exec":
            self.execute(request, payload)
        elif op == "list_files":
            listing = files.list_files(str(request["path"]), int(request["limit"]))
            self.send(events.listing(rid, **listing))
        elif op == "read_chunk":
            meta, data = transfer.read_chunk(str(request["path"]), int(request["offset"]), int(request["length"]))
            self.send(events.chunk(rid, **meta), data)
        elif op == "write_chunk":
            stored = self.uploads.chunk(request, payload)
            if isinstance(stored, int):
                self.send(events.staged(rid, str(request["upload"]), stored))
            else:  # known now, so the next run does not report it as a file it changed
                self.keeper.disk.note_written(stored.path, stored.stat.st_size, stored.stat.st_mtime_ns)
                self.send(events.written(rid, stored.path, stored.stat.st_size, stored.stat.st_mtime))
        elif op == "abort_upload":
            self.uploads.abort(str(request["upload"]))
            self.send(events.dropped(rid, str(request["upload"])[:64]))
        elif op == "history_page":
            self.send(history_page.history_page(rid, request))
        elif op in SESSION_OPS:
            self.send(self.keeper.requests.dispatch(op, rid, request))
        elif op in ("interrupt", "tool_result", "tool_pause"):
            pass  # the run it meant has already finished
        else:
            self.send(events.failure(rid, f"unknown op {str(op)[:40]!r}"))

    # -- runs ---------------------------------------------------------------------------------------
    def execute(self, request: dict[str, Any], payload: bytes) -> None:
        """Run a cell: in the session's worker, or in a fresh one that leaves nothing for the next run."""
        started = time.monotonic()
        cell = Cell.of(request)
        relay.give_key(cell.egress_key)
        if cell.session:
            self.keeper.execute(cell, payload, started=started, oom_before=self.oom_baseline)
        else:
            self.execute_stateless(cell, payload, started)
        self.oom_baseline = processes.oom_kills()

    def execute_stateless(self, cell: Cell, code: bytes, started: float) -> None:
        self.forget_exits(keep=None)
        handle = self.take_worker(lean=self.lean is not None and not routing.needs_libraries(code))
        run = Runner(self, cell, handle, started=started)
        run.run(code, self.oom_baseline)
        listing, files_payload = files.collect(cell.options)
        self.send(run.done_event(restarted=run.worker_died, notes=[], files=listing), files_payload)
        self.reset_after_stateless(cell.request_id, handle)

    def reset_after_stateless(self, rid: int, handle: WorkerHandle) -> None:
        """Leave nothing of the run for the next one, and tell the host whether that worked."""
        handle.close()
        problems = [] if self.kill_sandbox_processes() else ["processes of the sandbox user survived"]
        problems += wipe.wipe()
        self.send(events.clean(rid, not problems, problems[:10]))
        self.order_spare()

    # -- what a run and the session need (``port.SupervisorPort``) -------------------------------------------
    def watched_fds(self) -> dict[int, str]:
        return {self.chan_in: "channel", self.wake_r: "news", **{zygote.fileno(): "news" for zygote in self.zygotes()}}

    def read_channel(self, request_id: int) -> tuple[int, bool]:
        self.channel.fill()
        interrupts = 0
        for request, payload in self.channel.frames():
            if request.get("op") == "interrupt" and request.get("id") == request_id:
                interrupts += 1
            elif request.get("op") in ("tool_result", "tool_pause") and request.get("id") == request_id:
                self.tool_messages.append((request, payload))  # the running cell's tool calls
            else:
                self.pending.append((request, payload))
        return interrupts, self.channel.eof

    def take_tool_messages(self) -> list[tuple[dict[str, Any], bytes]]:
        taken, self.tool_messages = self.tool_messages, []
        return taken

    def exit_status(self, pid: int) -> int | None:
        return self.exits.get(pid)

    def forget_exits(self, keep: WorkerHandle | None) -> None:
        current = self.spares.pids() | ({keep.pid} if keep is not None else set())
        self.exits = {pid: status for pid, status in self.exits.items() if pid in current}

    def take_zygote_news(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 4096):
                pass
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # our own children: the IPC helper
                pass
        for zygote in self.zygotes():
            news = zygote.receive()
            if news is None:
                sys.stderr.write("mcpx_agent: a zygote is gone; the container cannot run code\n")
                os._exit(1)
            for item in news:
                if isinstance(item, Spawned):
                    self.spares.delivered(item.handle, zygote)
                elif isinstance(item, Exited):
                    self.exits[item.pid] = item.status

    def order_spare(self) -> None:
        self.spares.order()

    def take_worker(self, *, lean: bool = False) -> WorkerHandle:
        """The spare worker (forked ahead, off the request path), waiting for it if need be; a
        ``lean`` cell may take the lean zygote's (see ``spares``)."""
        deadline = time.monotonic() + SPAWN_WAIT_S
        self.spares.cell(lean=lean)
        while (handle := self.spares.take(lean=lean, gone=self.exits.__contains__)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                sys.stderr.write("mcpx_agent: the zygote did not deliver a worker\n")
                os._exit(1)
            select.select([self.wake_r, *(zygote.fileno() for zygote in self.zygotes())], [], [], left)
            self.take_zygote_news()
        return handle

    def kill_sandbox_processes(self) -> bool:
        """Kill every process of the sandbox user, the spare included (``SessionWorker`` drops its own)."""
        killed = processes.kill_every_process_but({zygote.pid for zygote in self.zygotes()}, self.take_zygote_news)
        self.spares.forget()
        return killed

    def others_alive(self, worker: WorkerHandle) -> bool:
        quiet = {1, os.getpid(), worker.pid, *(zygote.pid for zygote in self.zygotes()), *self.spares.pids()}
        return bool(processes.live_pids(quiet))


def close_posix_queues() -> None:
    """No POSIX message queues for the sandbox user: their bytes are counted per uid across the
    whole host (a uid shared by chance, or a future one, must not let one tenant refuse another). The
    queue filesystem's root is ours (uid 0): without write on it, neither mq_open nor open(2)
    can make a queue. (gVisor has none to close: its queues are the sandbox's own.)"""
    with contextlib.suppress(FileNotFoundError):
        os.chmod("/dev/mqueue", 0o755)  # noqa: S103 - narrower than its 1777: nobody but us may write


def take_channel() -> tuple[int, int]:
    """Move the host channel off fds 0/1 so nothing else can write to it by accident."""
    chan_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 100)
    chan_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 100)
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # stray prints of ours land in stderr, never in the protocol
    os.set_blocking(chan_in, False)
    for fd in (chan_in, chan_out):  # 1 MiB pipes: a file chunk crosses in one read, not sixteen
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, F_SETPIPE_SZ, 1 << 20)
    return chan_in, chan_out
