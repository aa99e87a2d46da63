"""The warm path measured through an in-memory MCP client: stateless runs, sessions, files,
throughput and the idle memory of a warm container."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from mcp import Client

from ...config.settings import Config
from ...config.units import MIB
from ...mcp_server import build_server
from ...runtime.docker.engine import DockerEngine
from ...service.facade import SandboxService
from .calls import PRINT, SCIENCE, new_session, run_ok, settle, timed_new_sessions, wait_for_spares
from .cpu import CpuPerRun, CpuWindow
from .report import Metric, percentile

CLIENTS = 8
# Back-to-back calls overlap each run with the clean-up of the one before (in another warm
# container); a model calling the tool leaves far longer gaps. Both paces are reported.
SPACING_S = 0.03


@dataclass(frozen=True)
class Plan:
    """How many samples of each kind (``--quick`` keeps the whole run well under 90 s)."""

    warmup: int
    prints: int
    spaced_prints: int
    science: int
    session_runs: int
    new_sessions: int
    files: int
    throughput_s: float
    stdio_prints: int
    cold_starts: int
    docker_runs: int
    docker_execs: int
    tool_calls: int  # code mode: calls timed each way
    tool_cells: int  # code mode: cells of 50 calls
    paused_sessions: int  # durable sessions: paused sessions whose containers are counted

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(3, 30, 10, 5, 30, 3, 3, 3.0, 20, 1, 3, 5, 45, 3, 20)
        return cls(10, 400, 150, 40, 300, 15, 20, 15.0, 200, 3, 20, 40, 300, 10, 100)


class Bench:
    def __init__(self, config: Config, plan: Plan) -> None:
        self.config = config
        self.plan = plan
        self.metrics: dict[str, Metric] = {}

    def metric(self, key: str, name: str, unit: str = "ms", **kwargs: Any) -> Metric:
        self.metrics[key] = Metric(name=name, unit=unit, **kwargs)
        return self.metrics[key]

    async def sample(
        self, metric: Metric, count: int, call: Callable[[], Awaitable[bool]], *, pause_s: float = 0.0
    ) -> None:
        for _ in range(count):
            if pause_s:
                await anyio.sleep(pause_s)  # pacing the calls (outside the timed region), not synchronisation
            started = time.perf_counter()
            ok = await call()
            elapsed = (time.perf_counter() - started) * 1000
            if ok:
                metric.samples.append(elapsed)
            else:
                metric.failures += 1

    async def in_memory(self, service: SandboxService) -> None:
        server = build_server(service)
        async with Client(server) as client:
            for _ in range(self.plan.warmup):
                await run_ok(client, PRINT)
            await settle(service)
            await self.sample(
                self.metric("print", "stateless print(1+1)", target=5.0),
                self.plan.prints,
                lambda: run_ok(client, PRINT, stdout="2\n"),
            )
            await self.sample(
                self.metric("print_spaced", f"  the same, one call every {SPACING_S * 1000:.0f} ms"),
                self.plan.spaced_prints,
                lambda: run_ok(client, PRINT, stdout="2\n"),
                pause_s=SPACING_S,
            )
            await self.sample(
                self.metric("science", "stateless numpy+pandas+matplotlib plot", target=60.0),
                self.plan.science,
                lambda: run_ok(client, SCIENCE, images=1),
            )
            await self.sessions(service, client)
            await self.files(client)
        await self.throughput(service, server)

    async def sessions(self, service: SandboxService, client: Client) -> None:
        session_id = await new_session(client)
        try:
            await run_ok(client, "x = 0", session_id=session_id)
            # The session took a warm spare, and its replacement's start (about a second of CPU
            # while it imports the libraries) would otherwise be measured as slow session runs.
            await wait_for_spares(service)
            runs = self.metric("session", "session run x += 1", target=3.0)
            await self.sample(runs, self.plan.session_runs, lambda: run_ok(client, "x += 1", session_id=session_id))
            final = await client.call_tool("run_python", {"code": "x", "session_id": session_id})
            expected = str(len(runs.samples) + runs.failures)
            if (final.structured_content or {}).get("result") != expected:
                runs.failures += 1
                runs.note = f"x ended as {(final.structured_content or {}).get('result')}, expected {expected}"
        finally:
            await client.call_tool("close_session", {"session_id": session_id})
        created = self.metric("new_session", "new_session (warm spare ready)", target=10.0)
        created.samples, created.failures = await timed_new_sessions(client, service, self.plan.new_sessions)

    async def files(self, client: Client) -> None:
        data = (b"0123456789abcdef" * 64 + b"\n")[:1024] * 1024  # 1 MiB of text
        content = data.decode()
        session_id = await new_session(client)
        both = self.metric("files", "write_file + read_file 1 MiB")
        writes = self.metric("write_file", "  write_file 1 MiB")
        reads = self.metric("read_file", "  read_file 1 MiB")
        try:
            for index in range(self.plan.files):
                path = f"bench/blob-{index}.txt"
                started = time.perf_counter()
                arguments = {"session_id": session_id, "path": path, "content": content}
                written = await client.call_tool("write_file", arguments)
                middle = time.perf_counter()
                read = await client.call_tool("read_file", {"session_id": session_id, "path": path})
                ended = time.perf_counter()
                text = getattr(read.content[0], "text", None) if read.content else None
                if written.is_error or read.is_error or text != content:
                    both.failures += 1
                    continue
                writes.samples.append((middle - started) * 1000)
                reads.samples.append((ended - middle) * 1000)
                both.samples.append((ended - started) * 1000)
        finally:
            await client.call_tool("close_session", {"session_id": session_id})

    async def throughput(
        self, service: SandboxService, server: Any, clients: int = CLIENTS, *, key: str | None = None, label: str = ""
    ) -> Metric:
        """Completed stateless runs per second with ``clients`` in-memory clients calling in a loop."""
        key = key or ("throughput" if clients == CLIENTS else f"throughput_{clients}")
        metric = self.metric(
            key, f"{label}throughput, {clients} concurrent clients", unit="runs/s", target=150.0, better="higher"
        )
        await settle(service)
        done = [0]
        failed = [0]
        start = anyio.Event()
        stop_at = math.inf

        async def one_client() -> None:
            async with Client(server) as client:
                await run_ok(client, PRINT)  # connect and warm, before the clock starts
                await start.wait()
                while time.perf_counter() < stop_at:
                    if await run_ok(client, PRINT, stdout="2\n"):
                        done[0] += 1
                    else:
                        failed[0] += 1

        async with anyio.create_task_group() as tg:
            for _ in range(clients):
                tg.start_soon(one_client)
            await settle(service)
            window = await CpuWindow.begin(service)
            began = time.perf_counter()
            stop_at = began + self.plan.throughput_s
            start.set()
        elapsed = time.perf_counter() - began
        metric.value = done[0] / elapsed
        metric.failures = failed[0]
        metric.note = f"{done[0]} runs in {elapsed:.1f} s, pool of {service.config.pool.size}"
        await settle(service)  # the last runs' clean-up and their workers' forks are theirs
        self.cpu_per_run(await window.end(service, done[0]), key)
        return metric

    def cpu_per_run(self, cpu: CpuPerRun, key: str) -> None:
        """CPU per stateless run over the throughput window (host process + containers' cgroups)."""
        total = self.metric(f"{key}_cpu", "  CPU per run, host + containers", unit="ms")
        total.value = cpu.total_ms
        machine = "-" if cpu.machine_ms is None else f"{cpu.machine_ms:.1f}"
        total.note = (
            f"{cpu.containers} containers' cgroups ({cpu.replaced} replaced, left out); the whole machine's "
            f"busy time per run {machine} ms (with dockerd, the shims and anything else running)"
        )
        self.metric(f"{key}_cpu_host", "    the service's process", unit="ms").value = cpu.host_ms
        self.metric(f"{key}_cpu_containers", "    the containers (cgroup)", unit="ms").value = cpu.containers_ms

    async def memory(self, service: SandboxService, engine: DockerEngine) -> None:
        await settle(service)
        metric = self.metric("memory", "idle memory per warm container", unit="MiB", target=80.0)
        # The image's page cache is charged to whichever container read a page first, so docker
        # stats' figure moves with what the host happens to have cached; the container's own does not.
        own = self.metric("memory_own", "  the same, less all page cache", unit="MiB")
        raw: list[float] = []
        for container_id in sorted(service.stateless_pool.container_ids()):
            memory = await engine.memory_usage(container_id)
            metric.samples.append(memory.docker_stats / MIB)
            own.samples.append(memory.own / MIB)
            raw.append(memory.usage / MIB)
        if raw:
            raw_p50 = percentile(raw, 50) or 0.0
            metric.note = (
                f"docker stats figure (usage less inactive page cache); raw cgroup usage p50 {raw_p50:.1f} MiB"
            )
            own.note = "anonymous memory, tmpfs and kernel memory: what the container holds of its own"
