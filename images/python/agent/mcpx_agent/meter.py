"""What a run costs, read from the kernel: the container's CPU time, an interpreter's peak memory.

CPU comes from the container's cgroup where the sandbox has one (cgroup v2 ``cpu.stat``, v1
``cpuacct``): every process of the container, those the run started and left behind included.
gVisor shows no cgroup inside the sandbox; there it is the sum of every process's own account in
``/proc`` (``utime + cutime``, ``stime + cstime``): a process that ends is counted in the one that
reaps it, and all of them end under init, so what the sandbox used between two readings is their
difference. A process reaped while the accounts are read moves from its own account to its reaper's
and may be missed in both (its reaper read before the reap, itself gone by its turn: a process the
cell forked, ending as the run is measured), so a reading in which a listed process went away is
taken again. The supervisor reads both ends of a run; nothing user code writes is consulted.

Peak memory is an interpreter's high-water mark of resident memory: ``VmHWM``, which the worker
resets as its cell begins (``clear_refs``), or, where the kernel keeps no resettable mark (gVisor),
its ``ru_maxrss`` (a fresh worker's for a stateless run; for a session's, its peak since it started).
Plain ``os`` calls: a run reads these twice, and a file object costs several times as much.

``RunMeter`` puts a run's usage together in the supervisor: the CPU between the cell's arrival and
its end, the worker's peak as its kernel kept it (the ``done`` frame's, bounded), the files it left,
the wheels the host shipped for it and its tool calls.
"""

from __future__ import annotations

import os
import resource
from typing import Any

from . import events
from .procfs import pids, read_small, stat_fields

CGROUP_V2 = "/sys/fs/cgroup/cpu.stat"
CGROUP_V1 = (
    "/sys/fs/cgroup/cpuacct/cpuacct.usage",
    "/sys/fs/cgroup/cpuacct/cpuacct.usage_user",
    "/sys/fs/cgroup/cpuacct/cpuacct.usage_sys",
)
TICK_US = 1_000_000 // (os.sysconf("SC_CLK_TCK") or 100)
WHEELHOUSE = "/mnt/data/.wheelhouse"  # the worker's packages.WHEELHOUSE
MAX_PEAK_KIB = 1 << 40
WALK_TRIES = 8  # readings of /proc while processes are reaped under it (a fork loop's churn never settles)
_source: list[str] = []  # the way that worked, found at the first reading


def _cgroup_v2() -> tuple[int, int] | None:
    text = read_small(CGROUP_V2)
    if text is None:
        return None
    found = dict(line.split(b" ", 1) for line in text.split(b"\n") if line.count(b" ") == 1)
    try:
        return int(found[b"user_usec"]), int(found[b"system_usec"])
    except (KeyError, ValueError):
        return None


def _cgroup_v1() -> tuple[int, int] | None:
    """cgroup v1 counts the total exactly and splits it by timer ticks: the exact total, split in
    the ticks' proportion (as cgroup v2's ``cpu.stat`` does)."""
    try:
        total, user, system = (int(read_small(path, 64) or b"") for path in CGROUP_V1)
    except ValueError:
        return None
    share = user / (user + system) if user + system else 1.0
    return round(total * share) // 1000, round(total * (1 - share)) // 1000


def _processes() -> tuple[int, int]:
    """Every process's account, read again (a few times at most: each is a few hundred microseconds)
    while a process listed at its start is gone by its end: it was reaped, and counted twice or not at all."""
    user = system = 0
    for _ in range(WALK_TRIES):
        listed = pids()
        user = system = 0
        for pid in listed:
            fields = stat_fields(pid)
            if fields is not None and len(fields) > 14:  # utime, stime, cutime, cstime: fields 14 to 17
                user += int(fields[11]) + int(fields[13])
                system += int(fields[12]) + int(fields[14])
        if set(listed).issubset(pids()):
            break
    return user * TICK_US, system * TICK_US


READERS = {"cgroup2": _cgroup_v2, "cgroup1": _cgroup_v1}


def cpu_us() -> tuple[int, int]:
    """(user, system) microseconds the container has used so far."""
    if not _source:
        _source.append(next((name for name, read in READERS.items() if read() is not None), "proc"))
    read = READERS.get(_source[0])
    found = read() if read is not None else None
    return found if found is not None else _processes()


def cpu_source() -> str:
    cpu_us()
    return _source[0]


def reset_peak() -> bool:
    """Start this process's high-water mark of resident memory afresh (False where the kernel cannot)."""
    try:
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
    except OSError:
        return False
    try:
        os.write(fd, b"5")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def peak_kib(pid: int | str = "self") -> int | None:
    """A process's high-water mark of resident memory (VmHWM), in KiB; None where there is none."""
    text = read_small(f"/proc/{pid}/status", 4096)
    for line in (text or b"").split(b"\n"):
        if line.startswith(b"VmHWM:"):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def own_peak_kib() -> tuple[int, int]:
    """(this process's peak, the largest peak of the children it waited for), in KiB: VmHWM where it
    is kept, else ``ru_maxrss``."""
    mark = peak_kib()
    own = mark if mark is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss


def shipped_wheels() -> int:
    try:
        return sum(1 for name in os.listdir(WHEELHOUSE) if name.endswith(".whl"))
    except OSError:
        return 0


class RunMeter:
    """One run's usage: started as its cell arrives, read as its ``done`` event is built."""

    def __init__(self) -> None:
        self.cpu_before = cpu_us()
        self.wheels = shipped_wheels()  # what the host copied in for this run

    def usage(self, done: dict[str, Any] | None, files: list[dict[str, Any]], tool_calls: int) -> dict[str, Any]:
        """``done``: the worker's checked ``done`` frame (None: it said none); its peaks are the
        worker's word, so only a plausible one counts, never the CPU."""
        user, system = cpu_us()
        peaks = [(done or {}).get(name) for name in ("peak_kib", "children_peak_kib")]
        peak = max((p for p in peaks if isinstance(p, int) and 0 < p < MAX_PEAK_KIB), default=None)
        return events.run_usage(
            cpu_user_s=round(max(0, user - self.cpu_before[0]) / 1e6, 6),
            cpu_system_s=round(max(0, system - self.cpu_before[1]) / 1e6, 6),
            peak_memory_bytes=None if peak is None else peak * 1024,
            data_written_bytes=sum(entry["size"] for entry in files),
            packages_installed=self.wheels,
            tool_calls=tool_calls,
        )
