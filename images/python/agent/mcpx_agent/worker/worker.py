"""A worker: a child of the zygote that drops to the sandbox user and runs user code.

File descriptors in the worker: 0 /dev/null, 1 and 2 pipes to the supervisor (never the host
channel), 3 the result pipe (frames), 4 the control pipe (requests from the supervisor: a cell's
options in the header, its code in the payload). Everything else is closed before any user code
runs. A request marked ``once`` ends the worker after its cell (a stateless run).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import select
import signal
import sys
import time
from typing import Any

from .. import events, meter, protocol
from ..handles import WorkerHandle
from ..identity import LIBC, SANDBOX_GID, SANDBOX_UID
from ..output import clip_text
from . import egress, mcp_tools, packages
from .figures import flush_figures
from .shell import LeanResult, SandboxShell, cell_taken_back, lean_eligible, run_lean
from .sink import SINK
from .snapshots import Snapshots
from .tracebacks import error_info

RESULT_FD = 3
CONTROL_FD = 4
PR_SET_DUMPABLE = 4
# Looked up once, in the zygote: the lookup allocates, and a forked child copies every page it writes.
_PRCTL = LIBC.prctl
# signal's own functions convert every signal and handler to and from its enums, which writes
# (and so copies) pages a fresh fork would not otherwise touch; the C module's take plain numbers.
# With the pipe ends lifted in one step, a worker takes ~25 fewer page faults a run (1045 -> 1020).
_SIGNAL: Any = importlib.import_module("_signal")
DEFAULT_SIGNALS = tuple(int(sig) for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1))
SIGINT = int(signal.SIGINT)
HIGH_FD = 200  # where the pipe ends wait while 0-4 are set up

SANDBOX_ENV = {
    "HOME": "/tmp",
    "PATH": f"/usr/local/bin:/usr/bin:/bin:{packages.USER_BASE}/bin",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "USER": "sandbox",
    "MPLBACKEND": "Agg",
    "MPLCONFIGDIR": "/tmp/.matplotlib",
    "PYTHONUNBUFFERED": "1",
    "PLOTLY_RENDERER": "png",  # fig.show() and a figure as a cell's value come back as PNG images
    "TERM": "dumb",
    **packages.PIP_ENV,  # pip, from user code too, installs offline into the session's own directory
}
# Set by the server for the container (thread pools sized to its CPU quota); user code and the
# processes it starts see them too.
INHERITED_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
NPROC_LIMIT = 0  # RLIMIT_NPROC for workers (gVisor only), read by prepare_environment
SNAPSHOTS = Snapshots()  # a session worker's background snapshots (see snapshots.py)


def prepare_environment() -> None:
    """Give the zygote the environment user code gets, once, before the first fork.

    Workers then inherit it as it is; rebuilding it in every child cost about 130 page copies a
    run (setenv reallocates libc's environment, and Python's mapping is rebuilt). The libraries
    read what they need of the container's environment while being imported, before this.
    """
    global NPROC_LIMIT
    NPROC_LIMIT = int(os.environ.get("MCPX_NPROC", "0") or 0)
    inherited = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
    outward = egress.static(os.environ)
    os.environ.clear()
    os.environ.update(SANDBOX_ENV)
    os.environ.update(inherited)
    if outward:
        os.environ.update(outward)
        for name in egress.DROPPED:
            os.environ.pop(name, None)


def spawn(shell: SandboxShell) -> WorkerHandle:
    """Fork a worker (called in the zygote only). It warms up, then serves cells from its control
    pipe. The warm-up rehearses a printing cell, so the pages a cell touches are already copied
    when the real one comes (a forked CPython pays a copy-on-write fault per page it writes)."""
    made: list[int] = []
    try:
        for _ in range(4):
            made.extend(os.pipe())
        reseed()  # here, not in the child: the child then does not copy the generator's pages
        pid = os.fork()
    except OSError:  # no pid, memory or descriptor to be had now: the zygote tries again
        for fd in made:
            os.close(fd)
        raise
    out_r, out_w, err_r, err_w, res_r, res_w, ctl_r, ctl_w = made
    if pid == 0:  # the child
        code = 1
        try:
            arrange_fds(out_w, err_w, res_w, ctl_r)
            drop_privileges()
            code = serve_forever(shell)
        except BaseException:  # noqa: BLE001 - nothing may escape a forked child
            code = 70
        finally:
            os._exit(code)
    for fd in (out_w, err_w, res_w, ctl_r):
        os.close(fd)
    return WorkerHandle(pid=pid, stdout=out_r, stderr=err_r, results=res_r, control=ctl_w)


def arrange_fds(out_w: int, err_w: int, res_w: int, ctl_r: int) -> None:
    # Lift the sources out of the way first so no dup2 clobbers a source not yet moved.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, HIGH_FD) for fd in (out_w, err_w, res_w, ctl_r)]
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    for target, fd in zip((1, 2, RESULT_FD, CONTROL_FD), high, strict=True):
        os.dup2(fd, target)
    os.closerange(CONTROL_FD + 1, 1 << 16)
    _SIGNAL.set_wakeup_fd(-1)
    for sig in DEFAULT_SIGNALS:
        _SIGNAL.signal(sig, _SIGNAL.SIG_DFL)
    _SIGNAL.signal(SIGINT, _SIGNAL.default_int_handler)


def drop_privileges() -> None:
    try:  # os-level calls: a file object would write (copy) far more of the forked heap
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, b"1000")  # the kernel's OOM killer takes user code, never the supervisor
        finally:
            os.close(fd)
    except OSError:
        pass
    if NPROC_LIMIT:  # set only under gVisor, whose kernel counts just the sandbox's processes
        import resource

        resource.setrlimit(resource.RLIMIT_NPROC, (NPROC_LIMIT, NPROC_LIMIT))
    os.setgroups([])
    os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
    os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
    if os.getuid() != SANDBOX_UID or os.geteuid() != SANDBOX_UID:
        raise SystemExit(71)
    # Changing credentials made us non-dumpable, which hides /proc/self from our own user;
    # user code legitimately reads it (and there is nothing of the supervisor's to protect here).
    try:  # noqa: SIM105 - plain try on the post-fork path: every object touched costs a page copy
        _PRCTL(PR_SET_DUMPABLE, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    os.umask(0o022)
    os.chdir("/mnt/data")
    # What ``python -m`` gives a script, and a notebook its kernel: the user's own modules in the
    # working directory import. Only here, after the fork: the agent runs with -P, so the zygote
    # (root) never imports a session's file in place of a library.
    sys.path.insert(0, "/mnt/data")


def reseed() -> None:
    """New random state for the next worker, drawn in the zygote just before the fork (so each
    worker gets its own). CPython reseeds ``random`` at fork, but numpy's global generator would
    otherwise be the zygote's: every run would draw the same numbers."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()


def serve_forever(shell: SandboxShell) -> int:
    warm_up(shell)
    os.set_blocking(CONTROL_FD, True)
    reader = protocol.FrameReader(
        CONTROL_FD, max_header=protocol.MAX_REQUEST_HEADER, max_payload=protocol.MAX_REQUEST_PAYLOAD
    )
    mcp_tools.CHANNEL.listen(reader)  # tool calls read their answers here, during a cell
    while True:
        frames = reader.frames()
        if not frames:
            if SNAPSHOTS.status_fd is not None:  # a snapshot being written: hear when it ends
                ready, _, _ = select.select([CONTROL_FD, SNAPSHOTS.status_fd], [], [])
                if SNAPSHOTS.status_fd in ready:
                    SNAPSHOTS.on_readable(shell)
                if CONTROL_FD not in ready:
                    continue
            reader.fill()
            if reader.eof:
                return 0
            continue
        for request, code in frames:
            if request.get("kind") == "tool_result":
                continue  # the answer to a call its cell no longer waits for
            op = request.get("op")
            if op is not None:
                answer(shell, request)
            else:
                execute(shell, code.decode("utf-8", "replace"), request.get("options", {}))
            if request.get("once"):
                os.close(RESULT_FD)  # the supervisor reads our done, then the end of our results
                wait_to_be_let_go()
                return 0


def wait_to_be_let_go() -> None:
    """After a stateless cell: wait until the supervisor closes our control pipe, which it does once
    the run's done event has left for the host (then it kills us). Exiting at once would tear our
    address space down (about a millisecond of the kernel's time) while the supervisor is woken
    for our done frame: on a small machine that put 1.4-2.3 ms on one run in ten."""
    with contextlib.suppress(OSError):
        while os.read(CONTROL_FD, 1 << 16):
            pass


def answer(shell: SandboxShell, request: dict[str, Any]) -> None:
    """A session request from the supervisor (not a cell): snapshot_order, snapshot_sync, restore, variables."""
    from . import namespace

    op = request["op"]
    if op == "snapshot_order":
        SNAPSHOTS.snapshot_order(shell, int(request["max_bytes"]))
        return
    if op == "snapshot_sync":
        complete = SNAPSHOTS.snapshot_sync(shell, float(request["timeout"]))
        taken_at, size = SNAPSHOTS.last()
        reply = events.worker_snapshot_synced(complete, taken_at, size)
    elif op == "restore":
        reply = namespace.restore(shell.user_ns)
    else:
        reply = namespace.variables(shell, int(request["limit"]), int(request["repr_chars"]))
    protocol.send(RESULT_FD, reply)


WARM_UP_CELL = "print(end='')"


def warm_up(shell: SandboxShell) -> None:
    """Rehearse a cell (``execute`` itself, on a plain cell that prints nothing) into /dev/null,
    then take back what it left in the shell: not stored, not counted, not seen by the user's cell.

    It writes (and so copies) the pages that a cell's run writes (its name and source cached, its
    input stored, the cell run, its streams flushed, its done frame) before the user's cell is even
    sent: a stateless ``print(1+1)`` then takes ~15 page faults of its own instead of ~130, and its
    reply leaves ~0.6 ms sooner. The pages are written once either way, so the worker's CPU stays
    the same. Only on the lean path, whose traces ``cell_taken_back`` knows (warming IPython's
    run_cell would cost about 5 ms of CPU per run for the rarer magic cells). SIGINT waits until
    the rehearsal is over: an interrupt, which only a cell can be meant for, then lands where it
    would have without a rehearsal, never inside it.
    """
    if not lean_eligible(shell, WARM_UP_CELL):
        return
    try:
        nowhere = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    held = _SIGNAL.pthread_sigmask(_SIGNAL.SIG_BLOCK, (SIGINT,))
    try:
        with contextlib.suppress(Exception), cell_taken_back(shell):  # an optimisation only
            execute(shell, WARM_UP_CELL, {}, result_fd=nowhere, rehearsal=True)
    finally:
        SINK.fd = None  # the request's cell points it at the result pipe
        os.close(nowhere)
        _SIGNAL.pthread_sigmask(_SIGNAL.SIG_SETMASK, held)


def execute(
    shell: SandboxShell, code: str, options: dict[str, Any], *, result_fd: int = RESULT_FD, rehearsal: bool = False
) -> None:
    """Run a cell and send its frames to ``result_fd``. A rehearsal (``warm_up``) leaves alone what
    belongs to the next real cell: the session's packages (put on the path, or copied in for it),
    a snapshot's notes."""
    SINK.reset(result_fd, options)
    _, children_before = meter.own_peak_kib()
    meter.reset_peak()  # this cell's peak, not the session's worker's since it started
    started = time.perf_counter()
    status = "ok"
    try:
        egress.before_cell(options.get("egress_proxy"))
        mcp_tools.before_cell(options.get("tools"), options.get("max_tool_calls"))
        refused = None
        if rehearsal:  # the site dir's look alone: the real cell adds it, and reads its .pth files then
            packages.site_dir_waiting()
        else:
            refused = packages.before_cell(options.get("install"))  # run_python's packages; the site dir
        # Plain Python takes the lean path (under half the pages written); the rest is IPython's.
        outcome = LeanResult(error_before_exec=refused) if refused is not None else run_lean(shell, code)
        if outcome is None:
            outcome = shell.run_cell(code, store_history=True, silent=False)
        flush_figures()
        error = outcome.error_before_exec or outcome.error_in_exec
        if not isinstance(error, KeyboardInterrupt):
            mcp_tools.CHANNEL.drain()  # tool calls the cell submitted and never awaited finish with it
        if error is not None:
            status = "error"
            SINK.raised_unshown(error_info(type(error), error, ""))
            if isinstance(error, KeyboardInterrupt):
                status = "interrupted"
            elif isinstance(error, MemoryError):
                status = "memory_limit"
    except KeyboardInterrupt as exc:  # an interrupt that landed outside the cell itself
        status = "interrupted"
        SINK.raised(error_info(type(exc), exc, ""))
    finally:
        if not rehearsal:
            packages.after_cell()
        for stream in (sys.stdout, sys.stderr):
            try:  # noqa: SIM105 - plain try on the post-fork path: every object touched costs a page copy
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - user code may have replaced or closed the stream
                pass
    notes = [] if rehearsal else SNAPSHOTS.take_notes()[:4]  # what the last snapshot could not do
    for note in notes:
        SINK.send(events.worker_note(note))
    error = capped_error(SINK.error, SINK.cap("max_result_bytes"))
    exec_ms = round((time.perf_counter() - started) * 1000, 3)
    peak, children = meter.own_peak_kib()
    children = children if children > children_before else 0  # a child of this cell's, not an earlier one
    SINK.send(events.worker_done(status, SINK.result_text, error, exec_ms, sorted(SINK.truncated), peak, children))


def capped_error(error: dict[str, Any] | None, cap: int) -> dict[str, Any] | None:
    """The error within the caps: a traceback of a deep recursion runs to megabytes."""
    if error is None:
        return None
    capped = dict(error)
    for name in ("message", "traceback"):
        capped[name] = clip_text(str(capped.get(name, "")), cap, "traceback")[0]
    capped["type"] = str(capped.get("type", "Error"))[:200]
    return capped
