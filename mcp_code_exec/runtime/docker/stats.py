"""What a container's one-shot stats say of its CPU and memory, as its cgroup on the engine's host
counts them (under runc the container's cgroup; under gVisor the sandbox's, its own kernel included)."""

from __future__ import annotations

from typing import Any

from ..base import ContainerMemory


def cpu_s(stats: dict[str, Any]) -> float | None:
    """CPU seconds used since the container started; None for one not running (it reads 0)."""
    total = ((stats.get("cpu_stats") or {}).get("cpu_usage") or {}).get("total_usage")
    return total / 1e9 if isinstance(total, int) and total > 0 else None


def memory(stats: dict[str, Any]) -> ContainerMemory:
    memory = stats.get("memory_stats") or {}
    usage, detail = int(memory.get("usage") or 0), memory.get("stats") or {}
    # cgroup v1 names its totals total_*, v2 has no such prefix; tmpfs (shmem) is the container's own
    inactive = _stat(detail, "total_inactive_file", "inactive_file")
    file_cache = _stat(detail, "total_cache", "file", "cache") - _stat(detail, "total_shmem", "shmem")
    return ContainerMemory(usage, max(0, usage - inactive), max(0, usage - file_cache))


def _stat(detail: dict[str, Any], *names: str) -> int:
    return next((int(detail[name] or 0) for name in names if name in detail), 0)
