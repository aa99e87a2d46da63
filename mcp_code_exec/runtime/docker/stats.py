"""What a container's one-shot stats say of its CPU and memory, as its cgroup on the engine's host
counts them (under runc the container's cgroup; under gVisor the sandbox's, its own kernel included)."""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ..base import ContainerMemory

CGROUPS = Path("/sys/fs/cgroup")
# Where Docker puts a container's cgroup (runc's, or gVisor's sandbox's): the cgroupfs and the systemd
# drivers, under cgroup v1 (cpuacct.usage, ns) and v2 (cpu.stat's usage_usec).
_V1 = ("cpuacct/docker/{id}", "cpuacct/system.slice/docker-{id}.scope", "cpu,cpuacct/docker/{id}",
       "cpu,cpuacct/system.slice/docker-{id}.scope")  # fmt: skip
_V2 = ("docker/{id}", "system.slice/docker-{id}.scope")
_COUNTERS = [(where, "cpuacct.usage") for where in _V1] + [(where, "cpu.stat") for where in _V2]
_FULL_ID = re.compile(r"[0-9a-f]{64}")


def cpu_s(stats: dict[str, Any]) -> float | None:
    """CPU seconds used since the container started; None for one not running (it reads 0)."""
    total = ((stats.get("cpu_stats") or {}).get("cpu_usage") or {}).get("total_usage")
    return total / 1e9 if isinstance(total, int) and total > 0 else None


class HostCpuCounters:
    """Containers' CPU seconds read from their cgroups' counters on this host (the counter the engine's
    stats report, without their wait for the stats collector's next tick, about a second).

    Each counter is opened once (``open_counter``, in a worker thread: the path's lookup takes the
    kernel's cgroup locks, which the engine holds while it creates and removes containers) and read
    again from its start each time (``read``, on the event loop): the kernel writes the figure out
    anew, in a microsecond or two, where a worker thread's hop costs a few hundred microseconds of
    CPU. The ``keep`` most recently read stay open."""

    def __init__(self, root: Path = CGROUPS, keep: int = 64) -> None:
        self.root = root
        self.keep = keep
        self._open: OrderedDict[str, tuple[int, bool]] = OrderedDict()  # id -> (descriptor, is cgroup v2)
        self._closed = False

    async def figure(self, container_id: str) -> float | None:
        """``read``, the counter opened first where none is held (None where it cannot be)."""
        if container_id not in self._open:
            opened = await anyio.to_thread.run_sync(self.open_counter, container_id)
            if opened is not None:
                self.hold(container_id, opened)
        return self.read(container_id)

    def open_counter(self, container_id: str) -> tuple[int, bool] | None:
        """A descriptor on the container's counter, and whether it is cgroup v2's ``cpu.stat``; None
        where this host has no such cgroup (a remote engine, a layout not known here, a container gone)."""
        if not _FULL_ID.fullmatch(container_id):  # only a full id names a path (no ../ from anyone)
            return None
        for where, counter in _COUNTERS:
            try:
                fd = os.open(self.root / where.format(id=container_id) / counter, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            return fd, counter == "cpu.stat"
        return None

    def hold(self, container_id: str, opened: tuple[int, bool]) -> None:
        """Keep ``open_counter``'s descriptor for ``read`` (closed at once when one is held already, or
        the counters were closed)."""
        if self._closed or container_id in self._open:
            os.close(opened[0])
            return
        self._open[container_id] = opened
        while len(self._open) > self.keep:
            os.close(self._open.popitem(last=False)[1][0])

    def read(self, container_id: str) -> float | None:
        """CPU seconds used since the container started, from its held counter; None where none is
        held, or it can no longer be read (its cgroup went with it: the descriptor is let go)."""
        held = self._open.get(container_id)
        if held is None:
            return None
        self._open.move_to_end(container_id)
        try:
            return _seconds(os.pread(held[0], 4096, 0), held[1])
        except (OSError, ValueError):
            self.forget(container_id)
            return None

    def forget(self, container_id: str) -> None:
        held = self._open.pop(container_id, None)
        if held is not None:
            os.close(held[0])

    def close(self) -> None:
        self._closed = True
        while self._open:
            os.close(self._open.popitem()[1][0])


def _seconds(text: bytes, v2: bool) -> float | None:
    """A v1 ``cpuacct.usage`` (ns) or a v2 ``cpu.stat`` (its ``usage_usec``) in seconds; None for 0."""
    if not v2:
        ns = int(text) if text.strip().isdigit() else 0
        return ns / 1e9 if ns > 0 else None
    usec = next((int(line.split()[1]) for line in text.splitlines() if line.startswith(b"usage_usec ")), 0)
    return usec / 1e6 if usec > 0 else None


def memory(stats: dict[str, Any]) -> ContainerMemory:
    memory = stats.get("memory_stats") or {}
    usage, detail = int(memory.get("usage") or 0), memory.get("stats") or {}
    # cgroup v1 names its totals total_*, v2 has no such prefix; tmpfs (shmem) is the container's own
    inactive = _stat(detail, "total_inactive_file", "inactive_file")
    file_cache = _stat(detail, "total_cache", "file", "cache") - _stat(detail, "total_shmem", "shmem")
    return ContainerMemory(usage, max(0, usage - inactive), max(0, usage - file_cache))


def _stat(detail: dict[str, Any], *names: str) -> int:
    return next((int(detail[name] or 0) for name in names if name in detail), 0)
