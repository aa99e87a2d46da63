"""CPU per run over a measured window: the service's own process (``os.times``) plus the warm
containers' cgroups (the engine's stats), divided by the runs completed in it.

Both are read before the window and after it has settled (every run's clean-up and the next
worker's fork done, so each run is charged its whole cost). A container replaced during the window
is left out (its start would be charged to the runs); the note says how many were. The machine's
whole busy time over the same window (``/proc/stat``) is given beside it: an upper bound that also
counts dockerd, containerd's shims, the kernel's network work and anything else running.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from ...errors import SandboxError
from ...runtime.base import ContainerEngine
from ...runtime.docker.engine import DockerEngine
from ...service.facade import SandboxService
from .report import cpu_times

BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq in /proc/stat's first line


def process_cpu_s() -> float:
    """This process's CPU time (user + system, every thread; not its children's)."""
    times = os.times()
    return times.user + times.system


def machine_busy_s(ticks: list[int] | None) -> float | None:
    if ticks is None:
        return None
    return sum(ticks[index] for index in BUSY_FIELDS if index < len(ticks)) / os.sysconf("SC_CLK_TCK")


async def containers_cpu_ns(engine: ContainerEngine, container_ids: set[str]) -> dict[str, int]:
    """Each container's cgroup CPU so far (ns); an engine that cannot say gives nothing."""
    if not isinstance(engine, DockerEngine):
        return {}
    found: dict[str, int] = {}
    for container_id in sorted(container_ids):
        with contextlib.suppress(SandboxError):  # gone meanwhile
            stats = await engine.call(engine.client.api.stats, container_id, stream=False, one_shot=True)
            usage = ((stats.get("cpu_stats") or {}).get("cpu_usage") or {}).get("total_usage")
            if usage:
                found[container_id] = int(usage)
    return found


@dataclass
class CpuWindow:
    """Readings at the start of a window; ``end`` gives the CPU per run in ms."""

    process_s: float
    machine_s: float | None
    containers_ns: dict[str, int] = field(default_factory=dict)

    @classmethod
    async def begin(cls, service: SandboxService) -> CpuWindow:
        containers = await containers_cpu_ns(service.engine, service.stateless_pool.container_ids())
        return cls(process_cpu_s(), machine_busy_s(cpu_times()), containers)

    async def end(self, service: SandboxService, runs: int) -> CpuPerRun:
        process_s = process_cpu_s() - self.process_s
        machine = machine_busy_s(cpu_times())
        after = await containers_cpu_ns(service.engine, set(self.containers_ns))
        kept = [key for key in self.containers_ns if key in after]
        containers_s = sum(after[key] - self.containers_ns[key] for key in kept) / 1e9
        per = 1000.0 / max(runs, 1)
        return CpuPerRun(
            host_ms=process_s * per,
            containers_ms=containers_s * per if kept else None,
            machine_ms=None if machine is None or self.machine_s is None else (machine - self.machine_s) * per,
            containers=len(kept),
            replaced=len(self.containers_ns) - len(kept),
        )


@dataclass(frozen=True)
class CpuPerRun:
    host_ms: float
    containers_ms: float | None  # None: the engine's stats were not available
    machine_ms: float | None
    containers: int
    replaced: int

    @property
    def total_ms(self) -> float | None:
        return None if self.containers_ms is None else self.host_ms + self.containers_ms
