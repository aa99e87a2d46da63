"""What a container's one-shot stats say of its CPU and memory, as its cgroup on the engine's host
counts them (under runc the container's cgroup; under gVisor the sandbox's, its own kernel included)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..base import ContainerMemory

CGROUPS = Path("/sys/fs/cgroup")
# Where Docker puts a container's cgroup (runc's, or gVisor's sandbox's): the cgroupfs and the systemd
# drivers, under cgroup v1 (cpuacct.usage, ns) and v2 (cpu.stat's usage_usec).
_V1 = ("cpuacct/docker/{id}", "cpuacct/system.slice/docker-{id}.scope", "cpu,cpuacct/docker/{id}",
       "cpu,cpuacct/system.slice/docker-{id}.scope")  # fmt: skip
_V2 = ("docker/{id}", "system.slice/docker-{id}.scope")
_FULL_ID = re.compile(r"[0-9a-f]{64}")


def cpu_s(stats: dict[str, Any]) -> float | None:
    """CPU seconds used since the container started; None for one not running (it reads 0)."""
    total = ((stats.get("cpu_stats") or {}).get("cpu_usage") or {}).get("total_usage")
    return total / 1e9 if isinstance(total, int) and total > 0 else None


def host_cpu_s(container_id: str, root: Path = CGROUPS) -> float | None:
    """The container's CPU seconds read from its cgroup's counter on this host (the counter the engine's
    stats report, without their wait for the stats collector's next tick, about a second); None where
    this host has no such cgroup (a remote engine, a layout not known here, a container gone)."""
    if not _FULL_ID.fullmatch(container_id):
        return None
    for where in _V1:
        try:
            ns = int((root / where.format(id=container_id) / "cpuacct.usage").read_text())
        except (OSError, ValueError):
            continue
        return ns / 1e9 if ns > 0 else None
    for where in _V2:
        try:
            text = (root / where.format(id=container_id) / "cpu.stat").read_text()
        except OSError:
            continue
        usec = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("usage_usec ")), 0)
        return usec / 1e6 if usec > 0 else None
    return None


def memory(stats: dict[str, Any]) -> ContainerMemory:
    memory = stats.get("memory_stats") or {}
    usage, detail = int(memory.get("usage") or 0), memory.get("stats") or {}
    # cgroup v1 names its totals total_*, v2 has no such prefix; tmpfs (shmem) is the container's own
    inactive = _stat(detail, "total_inactive_file", "inactive_file")
    file_cache = _stat(detail, "total_cache", "file", "cache") - _stat(detail, "total_shmem", "shmem")
    return ContainerMemory(usage, max(0, usage - inactive), max(0, usage - file_cache))


def _stat(detail: dict[str, Any], *names: str) -> int:
    return next((int(detail[name] or 0) for name in names if name in detail), 0)
