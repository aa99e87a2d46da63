"""A session worker's snapshots, taken off the call's path (their restore is ``namespace.restore``).

After a session cell the supervisor orders a snapshot (with the most it may weigh: the run's
``snapshot_max_bytes``, or less when the session's disk quota has less room). The worker forks a
child that writes it (``snapshot_format.write``) from its copy-on-write view of the namespace, so the next
cell runs at once; the child is niced, has its standard streams on /dev/null and none of the
worker's pipes, and ends itself after ``CHILD_MAX_S``. One child at a time: an order that comes
while one writes marks the namespace dirty, and the next snapshot starts when that child is done.
The child reports on a pipe whose end of file also tells the worker it is gone (which works where
pidfds do not, under gVisor). The worker's parent is the zygote; the child is the worker's, and the
supervisor's ``kill_sandbox_processes`` ends it with every other process of the sandbox user.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from typing import Any

from . import snapshot_format

CHILD_MAX_S = 300  # a child still pickling after this is stuck (a lock a user thread held at the fork)
STATUS_MAX = 64 << 10
NOTE_MAX = 600


def user_names(shell: Any) -> list[str]:
    """The namespace's user variables: not IPython's own (``In``, ``Out``, ``exit``...), not hidden ones."""
    hidden = shell.user_ns_hidden
    missing = object()
    return [
        name
        for name, value in list(shell.user_ns.items())
        if isinstance(name, str) and not name.startswith("_") and hidden.get(name, missing) is not value
    ]


class Snapshots:
    """The worker's side: at most one child writing, an order waiting, what the last one left."""

    def __init__(self) -> None:
        self.child: int | None = None
        self.status_fd: int | None = None
        self.status = bytearray()
        self.waiting: int | None = None  # the max_bytes of an order that came while a child wrote
        self.taken_at: float | None = None
        self.size: int | None = None
        self.notes: list[str] = []  # for the next cell's result

    def snapshot_order(self, shell: Any, max_bytes: int) -> None:
        """Start a snapshot, or have it start when the one being written is done."""
        if self.child is not None:
            self.waiting = max_bytes
            return
        self.start(shell, max_bytes)

    def start(self, shell: Any, max_bytes: int) -> None:
        read_end, write_end = os.pipe()
        try:
            pid = os.fork()
        except OSError as exc:  # the pids limit: the user's processes come first
            os.close(read_end)
            os.close(write_end)
            self.notes.append(f"no snapshot of the variables was taken ({exc.strerror}); the last one stays")
            return
        if pid == 0:
            code = 1
            try:
                os.close(read_end)
                code = _child(shell, max_bytes, write_end)
            finally:
                os._exit(code)
        os.close(write_end)
        os.set_blocking(read_end, False)
        self.child, self.status_fd, self.status = pid, read_end, bytearray()

    def on_readable(self, shell: Any) -> None:
        """Read the child's report; once it is gone, reap it and start what waits."""
        assert self.status_fd is not None
        try:
            chunk = os.read(self.status_fd, STATUS_MAX)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk and len(self.status) < STATUS_MAX:
            self.status += chunk
            return
        os.close(self.status_fd)
        with contextlib.suppress(ChildProcessError):  # user code may have reaped it (os.wait)
            os.waitpid(self.child or -1, 0)
        self.child = self.status_fd = None
        self.take_report(bytes(self.status))
        if self.waiting is not None:
            max_bytes, self.waiting = self.waiting, None
            self.start(shell, max_bytes)

    def take_report(self, raw: bytes) -> None:
        try:
            report = json.loads(raw) if raw else None
        except ValueError:
            report = None
        if not isinstance(report, dict):
            self.notes.append("the snapshot of the variables stopped before it was complete; the last one stays")
        elif report.get("over"):
            largest = ", ".join(str(item)[:80] for item in report.get("largest", [])[:5])
            limit = report.get("limit", "")
            self.notes.append(
                f"the variables were not snapshotted: they pickle to more than {limit}; largest: {largest}"[:NOTE_MAX]
            )
        elif isinstance(report.get("taken_at"), float) and isinstance(report.get("size"), int):
            self.taken_at, self.size = report["taken_at"], report["size"]

    def snapshot_sync(self, shell: Any, timeout: float) -> bool:
        """Until no child writes and none waits (True), or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while self.status_fd is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.status_fd], [], [], left)
            if ready:
                self.on_readable(shell)
        return True

    def take_notes(self) -> list[str]:
        """What the snapshots since the last cell could not do, once (for this cell's result)."""
        notes, self.notes = self.notes, []
        return notes

    def last(self) -> tuple[float | None, int | None]:
        """When the last complete snapshot was taken, and its size (read from the file if not ours)."""
        if self.taken_at is None:
            with contextlib.suppress(OSError, snapshot_format.Damaged, ValueError, OverflowError):
                with open(f"{snapshot_format.DIR}/{snapshot_format.FILE}", "rb") as stream:
                    size = os.fstat(stream.fileno()).st_size
                    manifest, _ = snapshot_format.manifest_of(stream, size)
                self.taken_at, self.size = manifest["taken_at"], size
        return self.taken_at, self.size


def _child(shell: Any, max_bytes: int, report_fd: int) -> int:
    """The writer: away from the worker's pipes, niced, bounded in time; reports as one JSON object."""
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    for fd in (3, 4):  # the result and control pipes are the worker's
        with contextlib.suppress(OSError):
            os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt of the next cell is not ours
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(CHILD_MAX_S)
    with contextlib.suppress(OSError):
        os.nice(10)
    from ..protocol import AGENT_VERSION, write_all

    context = {"cwd": os.getcwd(), "python": snapshot_format.python_version(), "agent_version": AGENT_VERSION}
    try:
        outcome = snapshot_format.write(shell.user_ns, user_names(shell), max_bytes, context)
    except Exception as exc:  # noqa: BLE001 - a full disk, a directory the user broke
        outcome = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
    outcome["limit"] = f"{max_bytes / 2**20:.0f} MB"
    write_all(report_fd, json.dumps(outcome).encode())
    return 0
