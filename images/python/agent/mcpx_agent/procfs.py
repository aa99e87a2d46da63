"""The kernel's small files: what every process of the container says of itself in ``/proc``.

Plain ``os`` calls: these are read at both ends of every run, and a file object costs several
times as much. Shared by the meter (every process's CPU account, under gVisor) and the supervisor
(which processes are left after a kill).
"""

from __future__ import annotations

import os

STAT_LIMIT = 1024  # a stat line is a few hundred bytes, the command name 64 at most


def read_small(path: str, limit: int = 4096) -> bytes | None:
    """Up to ``limit`` bytes of a small kernel file, or None if it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def pids() -> list[int]:
    """The processes in ``/proc`` now, the exited ones not yet reaped (zombies) included."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def stat_fields(pid: int) -> list[bytes] | None:
    """A process's ``/proc/PID/stat`` after its command name, from its state (field 3) on; None
    when it is gone (reaped since it was listed)."""
    stat = read_small(f"/proc/{pid}/stat", STAT_LIMIT)
    if not stat:
        return None
    fields = stat.rpartition(b")")[2].split()  # the command name may hold spaces or parens
    return fields or None
