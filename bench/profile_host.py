"""Where a stateless run's CPU goes on the host: the service's process, by stage, over many runs.

Starts the service as the bench does (warm pools, the configuration's image), then runs
``print(1+1)`` without a session through an in-memory MCP client (the SDK's ``Client`` on the
server ``build_server`` makes, as the bench's rows do) ``--runs`` times, in ``--clients``
concurrent loops, under ``cProfile`` with a CPU clock. It prints the process's CPU per run
(``os.times``), the warm containers' cgroup CPU per run over the same window, and the profile's
own time grouped by stage (the module a function lives in), then the heaviest functions.

    mcp-code-exec image build
    python bench/profile_host.py --config my.toml --runs 2000 --clients 4

The profiler slows the event loop's Python by about half again: compare the stages' shares, and
take CPU per run from a run without ``--profile``'s cost (``--no-profile``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import defaultdict

import anyio
from mcp import Client

from mcp_code_exec.commands.bench.calls import PRINT, run_ok, settle
from mcp_code_exec.commands.bench.cpu import CpuWindow
from mcp_code_exec.config.settings import load_config
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.observability import logs
from mcp_code_exec.runtime.docker.engine import DockerEngine
from mcp_code_exec.service.facade import SandboxService

# Stages by where the function's code lives, first match wins (a path fragment, the stage's name).
STAGES = [
    ("mcp_code_exec/mcp_server/", "our MCP layer (tools, answers, run results to content)"),
    ("mcp_code_exec/service/", "the service (executor, runs, pools' bookkeeping)"),
    ("mcp_code_exec/sandbox/", "the channel to the container (frames, pool)"),
    ("mcp_code_exec/protocol/", "the channel to the container (frames, pool)"),
    ("mcp_code_exec/runtime/", "the attach stream (runtime)"),
    ("mcp_code_exec/", "the rest of mcp_code_exec (models, observability)"),
    ("/mcp/", "the MCP SDK (JSON-RPC, sessions, in-memory streams)"),
    ("pydantic", "pydantic (validation, serialisation)"),
    ("/anyio/", "anyio and asyncio (tasks, streams, the loop)"),
    ("/asyncio/", "anyio and asyncio (tasks, streams, the loop)"),
    ("/json/", "json"),
    ("opentelemetry", "OpenTelemetry"),
    ("/logging/", "logging"),
    ("/socket.py", "sockets"),
    ("/selectors.py", "anyio and asyncio (tasks, streams, the loop)"),
]


def stage_of(filename: str) -> str:
    if filename.startswith("~") or filename.startswith("<"):
        return "builtins (C calls: socket I/O, json, dict work)"
    return next((stage for fragment, stage in STAGES if fragment in filename), "other Python")


async def measure(config_path: str | None, runs: int, clients: int, profiler: cProfile.Profile | None) -> None:
    config = load_config(config_path)
    logs.setup(config.log_level, config.log_format)  # as the CLI does (else the SDK installs rich's handler)
    config = config.model_copy(update={"sessions": config.sessions.model_copy(update={"durable": False})})
    engine = await DockerEngine.connect(config.docker_host, disk_image=config.image)
    async with SandboxService.start(config, engine=engine) as service:
        await service.wait_ready()
        server = build_server(service)
        left = [runs]
        failed = [0]
        go = anyio.Event()

        async def loop(client: Client) -> None:
            await go.wait()
            while left[0] > 0:
                left[0] -= 1
                if not await run_ok(client, PRINT, stdout="2\n"):
                    failed[0] += 1

        async with Client(server) as first:
            others = [Client(server) for _ in range(clients - 1)]
            for client in others:
                await client.__aenter__()
            try:
                for client in [first, *others]:
                    for _ in range(5):
                        await run_ok(client, PRINT)
                await settle(service)
                window = await CpuWindow.begin(service)
                began = time.perf_counter()
                if profiler is not None:
                    profiler.enable()
                async with anyio.create_task_group() as tg:
                    for client in [first, *others]:
                        tg.start_soon(loop, client)
                    go.set()
                if profiler is not None:
                    profiler.disable()
                elapsed = time.perf_counter() - began
                await settle(service)
                cpu = await window.end(service, runs)
            finally:
                for client in reversed(others):
                    await client.__aexit__(None, None, None)
    print(f"{runs} stateless runs of {PRINT!r}, {clients} clients, {runs / elapsed:.0f} runs/s, {failed[0]} failed")
    print(f"  CPU per run: the service's process {cpu.host_ms:.2f} ms, the containers {cpu.containers_ms or 0:.2f} ms")
    print(f"  the whole machine's busy time per run {cpu.machine_ms or 0:.2f} ms (everything running)")


def report(profiler: cProfile.Profile, runs: int, top: int) -> None:
    stats = pstats.Stats(profiler)
    raw = stats.stats  # type: ignore[attr-defined]
    by_stage: dict[str, float] = defaultdict(float)
    for (filename, _line, _name), (_cc, _nc, tottime, _ct, _callers) in raw.items():
        by_stage[stage_of(filename)] += tottime
    total = sum(by_stage.values())
    print(f"\nprofiled self time by stage (ms per run; {total / runs * 1000:.2f} ms per run in all):")
    for stage, seconds in sorted(by_stage.items(), key=lambda item: -item[1]):
        print(f"  {seconds / runs * 1000:6.3f}  {100 * seconds / total:4.1f}%  {stage}")
    print(f"\nheaviest functions by cumulative time (of {runs} runs):")
    stats.sort_stats("tottime").print_stats(top)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="configuration file (TOML): its image and pool are used")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--no-profile", action="store_true", help="CPU per run alone, without the profiler's cost")
    args = parser.parse_args()
    profiler = None if args.no_profile else cProfile.Profile(time.process_time)
    anyio.run(measure, args.config, args.runs, args.clients, profiler)
    if profiler is not None:
        report(profiler, args.runs, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
