"""Killing every process of the sandbox user, and watching for ones left running.

The container holds init (pid 1), the supervisor, the zygote and whatever user code started.
``kill(-1)`` with the sandbox user's effective uid signals exactly the processes that user can
signal: all of the sandbox uid, never the root-owned zygote. It walks the task list under the kernel's
lock, so a fork bomb cannot outrun it, and a pending SIGKILL aborts a fork in progress. Whether
anything is left is read from /proc (``kill(-1)`` cannot say: the processes it may not signal
still count as found).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable, Collection

from ..identity import effective_ids
from ..procfs import pids, read_small, stat_fields

# Processes of the container's own that outlive every run (the egress relay, see ``relay``): never
# signalled, never counted as left over by a run.
KEPT_PIDS: set[int] = set()


def live_pids(protected: Collection[int]) -> list[int]:
    """Processes other than ``protected`` that have not exited (zombies are exited)."""
    found = []
    for pid in pids():
        if pid in protected or pid in KEPT_PIDS:
            continue
        fields = stat_fields(pid)
        if fields is not None and fields[0] not in (b"Z", b"X"):
            found.append(pid)
    return found


def kill_every_process_but(protected: Collection[int], reap: Callable[[], None], deadline_s: float = 5.0) -> bool:
    """SIGKILL every process but init, us and ``protected`` until none is left. False if some survive."""
    keep = {1, os.getpid(), *protected}
    deadline = time.monotonic() + deadline_s
    pause = 0.0001
    while True:
        with effective_ids(), contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(-1, signal.SIGKILL)
        reap()
        remaining = live_pids(keep)
        if not remaining:
            return True
        for pid in remaining:  # a worker forked a moment ago may still be root, before its drop
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        left = deadline - time.monotonic()
        if left < 0:
            return False
        # Sleep until one of them has exited instead of polling (a process with a large heap takes
        # milliseconds to tear down); short pauses only while their parents reap the zombies.
        if _await_an_exit(remaining, left):
            pause = 0.0001
        else:
            time.sleep(pause)
            pause = min(pause * 2, 0.002)


def _await_an_exit(pids: list[int], timeout_s: float) -> bool:
    """Block until one of ``pids`` exits; False when none could be watched or one is already gone."""
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except (OSError, AttributeError):  # gone already, or no pidfd (old kernel, gVisor)
                continue
        if not fds:
            return False
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        if poller.poll(0):
            return False
        poller.poll(max(1, int(timeout_s * 1000)))
        return True
    finally:
        for fd in fds:
            os.close(fd)


def thread_count(pid: int) -> int:
    """Threads of a process (0 when it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def oom_kills() -> int | None:
    """The memory cgroup's OOM-kill counter, where the kernel exposes it."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        text = read_small(path, 4096)
        if text is None:
            continue
        for line in text.split(b"\n"):
            name, _, value = line.partition(b" ")
            if name == b"oom_kill":
                try:
                    return int(value)
                except ValueError:
                    break
    return None
