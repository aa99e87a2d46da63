"""``mcp-code-exec bench``: latency and throughput on the real engine, through the real MCP layer.

One run measures the warm path (in-memory MCP client, and a stdio subprocess server) and, in the
same run, the same ``print(1+1)`` done as a ``docker run`` per call and as a ``docker exec`` per
call, so the ratios hold even on a noisy machine. Targets are printed next to each measurement;
missing one does not fail the command (only runs that fail do). See ``bench/README.md``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from mcp import Client, StdioServerParameters
from mcp.types import CallToolResult

from .config import Config
from .mcp_server import build_server
from .runtime.docker import DockerEngine
from .service import SandboxService

PRINT = "print(1+1)"
SCIENCE = (
    "import numpy as np, pandas as pd, matplotlib.pyplot as plt\n"
    "df = pd.DataFrame({'x': np.arange(20), 'y': np.arange(20) ** 2})\n"
    "plt.figure(figsize=(4, 3)); plt.plot(df.x, df.y)\n"
    "int(df.y.sum())"
)
MIB = 1024 * 1024
CLIENTS = 8
# Back-to-back calls overlap each run with the clean-up of the one before (in another warm
# container); a model calling the tool leaves far longer gaps. Both paces are reported.
SPACING_S = 0.03


@dataclass
class Metric:
    name: str
    unit: str
    samples: list[float] = field(default_factory=list)
    value: float | None = None  # a single figure (throughput, memory) instead of samples
    target: float | None = None
    better: str = "lower"  # "lower" or "higher"
    failures: int = 0
    note: str = ""

    def percentile(self, q: float) -> float | None:
        return percentile(self.samples, q)

    @property
    def headline(self) -> float | None:
        return self.value if self.value is not None else self.percentile(50)

    @property
    def met(self) -> bool | None:
        if self.target is None or self.headline is None:
            return None
        return self.headline <= self.target if self.better == "lower" else self.headline >= self.target

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "unit": self.unit,
            "failures": self.failures,
            "target": self.target,
            "better": self.better,
        }
        if self.samples:
            data.update(
                n=len(self.samples),
                p50=self.percentile(50),
                p90=self.percentile(90),
                p99=self.percentile(99),
                mean=sum(self.samples) / len(self.samples),
                min=min(self.samples),
                max=max(self.samples),
            )
        if self.value is not None:
            data["value"] = self.value
        data["met"] = self.met
        if self.note:
            data["note"] = self.note
        return data


def percentile(samples: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None without samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


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
    docker_runs: int
    docker_execs: int

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(3, 30, 10, 5, 30, 3, 3, 3.0, 20, 3, 5)
        return cls(10, 400, 150, 40, 300, 15, 20, 15.0, 200, 20, 40)


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

    # -- the warm path, in memory ------------------------------------------------------------
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
        for _ in range(self.plan.new_sessions):
            await wait_for_spares(service)  # outside the timed region
            started = time.perf_counter()
            result = await client.call_tool("new_session", {})
            elapsed = (time.perf_counter() - started) * 1000
            if result.is_error or not result.structured_content:
                created.failures += 1
                continue
            created.samples.append(elapsed)
            await client.call_tool("close_session", {"session_id": result.structured_content["session_id"]})

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

    async def throughput(self, service: SandboxService, server: Any) -> None:
        metric = self.metric(
            "throughput", f"throughput, {CLIENTS} concurrent clients", unit="runs/s", target=150.0, better="higher"
        )
        await settle(service)
        done = [0]
        failed = [0]
        duration = self.plan.throughput_s

        async def one_client() -> None:
            async with Client(server) as client:
                await run_ok(client, PRINT)  # connect and warm, before the clock starts
                await start.wait()
                while time.perf_counter() < stop_at:
                    if await run_ok(client, PRINT, stdout="2\n"):
                        done[0] += 1
                    else:
                        failed[0] += 1

        start = anyio.Event()
        stop_at = math.inf
        async with anyio.create_task_group() as tg:
            for _ in range(CLIENTS):
                tg.start_soon(one_client)
            await settle(service)
            began = time.perf_counter()
            stop_at = began + duration
            start.set()
        elapsed = time.perf_counter() - began
        metric.value = done[0] / elapsed
        metric.failures = failed[0]
        metric.note = f"{done[0]} runs in {elapsed:.1f} s, pool of {service.config.pool.size}"

    # -- idle memory --------------------------------------------------------------------------
    async def memory(self, service: SandboxService, engine: DockerEngine) -> None:
        await settle(service)
        metric = self.metric("memory", "idle memory per warm container", unit="MiB", target=80.0)
        raw: list[float] = []
        for container_id in sorted(service.stateless.container_ids()):
            usage, without_cache = await engine.memory_usage(container_id)
            metric.samples.append(without_cache / MIB)
            raw.append(usage / MIB)
        if raw:
            raw_p50 = percentile(raw, 50) or 0.0
            metric.note = f"docker stats figure (usage minus page cache); raw cgroup usage p50 {raw_p50:.1f} MiB"

    # -- the stdio transport -----------------------------------------------------------------
    async def stdio(self) -> None:
        metric = self.metric("stdio_print", "stateless print(1+1) over stdio")
        with tempfile.TemporaryDirectory(prefix="mcp-code-exec-bench-") as tmp:
            path = os.path.join(tmp, "config.toml")
            await anyio.Path(path).write_text(to_toml(config_for_subprocess(self.config)))
            params = StdioServerParameters(
                command=sys.executable, args=["-m", "mcp_code_exec", "serve", "--config", path]
            )
            with anyio.fail_after(180):
                async with Client(params) as client:
                    for _ in range(max(3, self.plan.warmup)):
                        await run_ok(client, PRINT)
                    await self.sample(metric, self.plan.stdio_prints, lambda: run_ok(client, PRINT, stdout="2\n"))

    # -- the baselines -----------------------------------------------------------------------
    async def baselines(self, service: SandboxService, engine: DockerEngine) -> None:
        command = ["python3", "-c", PRINT]
        spec = service.spec("stateless")  # the same hardened flags as the warm containers
        run = self.metric("docker_run", "docker run --rm per call (print)")

        async def docker_run() -> bool:
            container_id, stream = await engine.start(dataclasses.replace(spec, command=command))
            try:
                output = await read_all(stream)
            finally:
                await stream.aclose()
                await engine.remove(container_id)  # --rm: the call ends when the container is gone
            return b"2\n" in output

        await self.sample(run, self.plan.docker_runs, docker_run)
        execs = self.metric("docker_exec", "docker exec per call (print)")
        container_id, stream = await engine.start(dataclasses.replace(spec, command=["sleep", "infinity"]))
        try:

            async def docker_exec() -> bool:
                code, output = await engine.exec_once(container_id, command)
                return code == 0 and output.strip() == b"2"

            await docker_exec()  # the first exec pays for page cache warm-up
            await self.sample(execs, self.plan.docker_execs, docker_exec)
        finally:
            await stream.aclose()
            await engine.remove(container_id)

    # -- report ------------------------------------------------------------------------------
    def ratios(self) -> dict[str, dict[str, Any]]:
        warm = self.metrics["print"].percentile(50)
        found: dict[str, dict[str, Any]] = {}
        for key, target in (("docker_run", 40.0), ("docker_exec", 10.0)):
            other = self.metrics[key].percentile(50) if key in self.metrics else None
            value = other / warm if other and warm else None
            met = None if value is None else value >= target
            found[f"{key}_over_warm_p50"] = {"value": value, "target": target, "met": met}
        return found

    def table(self) -> str:
        header = f"{'metric':<44} {'n':>4} {'p50':>9} {'p90':>9} {'p99':>9}  {'target':<14} {''}"
        lines = [header, "-" * len(header)]
        for metric in self.metrics.values():
            if metric.value is not None:
                figures = f"{'':>4} {fmt(metric.value):>9} {'':>9} {'':>9}"
            else:
                figures = (
                    f"{len(metric.samples):>4} {fmt(metric.percentile(50)):>9} {fmt(metric.percentile(90)):>9} "
                    f"{fmt(metric.percentile(99)):>9}"
                )
            target = ""
            if metric.target is not None:
                op = "<=" if metric.better == "lower" else ">="
                target = f"{op} {fmt(metric.target)}"
            mark = mark_of(metric.met)
            extra = f" ({metric.failures} failed)" if metric.failures else ""
            lines.append(f"{metric.name + ' [' + metric.unit + ']':<44} {figures}  {target:<14} {mark}{extra}")
            if key_of(self.metrics, metric) == "print":
                p99 = metric.percentile(99)
                ok = None if p99 is None else p99 <= 25.0
                label = "  (p99 of the same)"
                lines.append(f"{label:<44} {'':>4} {'':>9} {'':>9} {fmt(p99):>9}  {'<= 25':<14} {mark_of(ok)}")
        for name, ratio in self.ratios().items():
            label = name.replace("_over_warm_p50", "").replace("_", " ") + " p50 / warm print p50"
            figure = fmt(ratio["value"]) + "x"
            target = f">= {fmt(ratio['target'])}x"
            lines.append(f"{label:<44} {'':>4} {figure:>9} {'':>9} {'':>9}  {target:<14} {mark_of(ratio['met'])}")
        return "\n".join(lines)


def key_of(metrics: dict[str, Metric], metric: Metric) -> str:
    return next(key for key, value in metrics.items() if value is metric)


def mark_of(ok: bool | None) -> str:
    return {True: "pass", False: "MISS", None: ""}[ok]


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


async def run_ok(
    client: Client, code: str, *, session_id: str | None = None, stdout: str | None = None, images: int = 0
) -> bool:
    arguments: dict[str, Any] = {"code": code}
    if session_id is not None:
        arguments["session_id"] = session_id
    result: CallToolResult = await client.call_tool("run_python", arguments)
    structured = result.structured_content or {}
    if result.is_error or structured.get("status") != "ok":
        return False
    if stdout is not None and structured.get("stdout") != stdout:
        return False
    return sum(1 for block in result.content if block.type == "image") >= images


def cpu_times() -> list[int] | None:
    """The machine's CPU time counters (Linux /proc/stat, in clock ticks), or None elsewhere."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    return [int(value) for value in fields[1:]] if fields and fields[0] == "cpu" else None


def steal_percent(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of the elapsed CPU time a virtual machine's host gave to other guests (the 8th
    counter): on a busy host every figure is inflated, whatever the load average says."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return None
    total = sum(after[:8]) - sum(before[:8])
    return 100.0 * (after[7] - before[7]) / total if total > 0 else None


async def new_session(client: Client) -> str:
    result = await client.call_tool("new_session", {})
    if result.is_error or not result.structured_content:
        raise RuntimeError(f"new_session failed: {result.content}")
    return str(result.structured_content["session_id"])


async def wait_for_spares(service: SandboxService, timeout_s: float = 120.0) -> None:
    """Until the session pool holds its warm spares again (polled: the pool has no event for it)."""
    with anyio.fail_after(timeout_s):
        while service.spares.idle < service.config.pool.session_spares:  # noqa: ASYNC110 - no event to wait on
            await anyio.sleep(0.02)


async def settle(service: SandboxService, timeout_s: float = 120.0) -> None:
    """Until every pool is full and idle, so a measurement does not include container starts."""
    with anyio.fail_after(timeout_s):
        while service.stateless.idle < service.config.pool.size:  # noqa: ASYNC110 - no event to wait on
            await anyio.sleep(0.02)
    await wait_for_spares(service, timeout_s)


async def read_all(stream: Any, limit: int = 1 << 20) -> bytes:
    """What a short-lived container printed, from its attached stream, until it exits."""
    data = bytearray()
    with anyio.fail_after(60):
        while len(data) < limit:
            try:
                data += await stream.receive(1 << 16)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                break
    return bytes(data)


def config_for_subprocess(config: Config) -> dict[str, Any]:
    data = config.model_dump(mode="json", exclude={"http"}, exclude_none=True)
    data["log_level"] = "warning"
    return data


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """A TOML file for a config dump (scalars, lists of scalars, nested tables)."""
    lines: list[str] = []
    tables: list[str] = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append(f"\n[{prefix}{key}]\n" + to_toml(value, f"{prefix}{key}."))
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n" + "".join(tables)


async def bench(config: Config, quick: bool, json_path: str | None) -> int:
    plan = Plan.make(quick)
    runner = Bench(config, plan)
    load_before = os.getloadavg()
    cpu_before = cpu_times()
    began = time.perf_counter()
    kind = "quick" if quick else "full"
    print(f"mcp-code-exec bench ({kind}): {os.cpu_count()} cores, load {load_before[0]:.2f}", flush=True)
    engine = await DockerEngine.connect(config.docker_host)
    async with SandboxService.start(config, engine=engine) as service:  # closes the engine at the end
        await service.wait_ready()
        await runner.in_memory(service)
        await runner.memory(service, engine)
        await runner.baselines(service, engine)
    await runner.stdio()
    load_after = os.getloadavg()
    steal = steal_percent(cpu_before, cpu_times())
    print()
    print(runner.table())
    print(f"\nwall time {time.perf_counter() - began:.1f} s; load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
    if steal is not None:
        print(f"CPU time taken by the hypervisor for other guests (steal): {steal:.1f}% of the run")
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "load_average": {"before": load_before, "after": load_after},
        "cpu_steal_percent": steal,
        "quick": quick,
        "plan": dataclasses.asdict(plan),
        "config": config_for_subprocess(config),
        "metrics": {key: metric.as_json() for key, metric in runner.metrics.items()},
        "ratios": runner.ratios(),
        "code": {"print": PRINT, "science": SCIENCE},
    }
    if json_path:
        await anyio.Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"JSON written to {json_path}")
    failures = sum(metric.failures for metric in runner.metrics.values())
    if failures:
        print(f"mcp-code-exec: {failures} benchmark calls failed", file=sys.stderr)
        return 1
    return 0


__all__ = ["bench", "percentile"]
