"""Our stdio server against the floor, side by side in one run, through the MCP SDK's own client.

The floor is an MCP SDK server (``MCPServer``) whose ``run_python`` ``exec()``s the code in its
own process: no isolation at all, the cost of the SDK and stdio alone. Against it, the same calls
through ``mcp-code-exec serve`` (the front, relaying to the local service) and through
``mcp-code-exec serve --in-process`` (the server in the client's subprocess, no relay): the
difference of those two is what the front's relay adds. Per server: ``print(1+1)`` p50 over
``--calls`` calls, a ``--mib`` MiB result's p50 (printed text: the relay's cost per MiB), and the
calls per second of 8 clients, each with a server process of its own (ours: 8 fronts sharing one
local service; not for ``--in-process``, where each would start a service and its warm pool),
calling in a loop for ``--seconds``.

With ``--plot``, instead: the bench's numpy+pandas+matplotlib plot (its result an image) over
stdio through ``mcp-code-exec serve`` against the same plot through a service in this process,
called through an in-memory MCP client as ``mcp-code-exec bench`` does, and ``print(1+1)`` both
ways for scale: p50 and p90 of ``--calls`` calls each (40 suits), in alternating blocks of 10, so
that the machine's drift falls on both alike.

    mcp-code-exec image build
    python bench/stdio_floor.py --config my.toml
    python bench/stdio_floor.py --config my.toml --plot --calls 40

The configuration's ``[limits] max_output_bytes`` must hold the large result (the script raises it
in the copy it runs with). The local service runs in a directory of the script's own and is
stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time

import anyio
from mcp import Client, StdioServerParameters

from mcp_code_exec.commands.bench.calls import SCIENCE, settle
from mcp_code_exec.commands.bench.outside import stop_local_service
from mcp_code_exec.commands.bench.report import config_for_subprocess, to_toml
from mcp_code_exec.commands.stdio.isolation import service_command
from mcp_code_exec.commands.stdio.local_service import ENV_RUNTIME_DIR, place_for, service_pid
from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.observability import logs
from mcp_code_exec.runtime.docker.engine import DockerEngine
from mcp_code_exec.service.facade import SandboxService

FLOOR = textwrap.dedent(
    '''
    import contextlib, io
    from mcp.server.mcpserver import MCPServer
    from pydantic import BaseModel
    server = MCPServer("floor")

    class Ran(BaseModel):
        status: str
        stdout: str

    @server.tool()
    def run_python(code: str) -> Ran:
        """Run code in this process."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code, {})
        return Ran(status="ok", stdout=out.getvalue())

    server.run("stdio")
    '''
)
PRINT = "print(1+1)"
CLIENTS = 8


async def one_call(client: Client, code: str, expect: int) -> float:
    began = time.perf_counter()
    result = await client.call_tool("run_python", {"code": code})
    elapsed = (time.perf_counter() - began) * 1000
    stdout = (result.structured_content or {}).get("stdout", "")
    if result.is_error or len(stdout) != expect:
        raise RuntimeError(f"a call failed: {str(result)[:300]}")
    return elapsed


async def measure(
    name: str, params: StdioServerParameters, calls: int, mib: float, seconds: float, *, concurrent: bool = True
) -> list[str]:
    big = f"print('x' * {int(mib * (1 << 20))})"
    async with Client(params) as client:
        for _ in range(5):
            await one_call(client, PRINT, 2)
        prints = [await one_call(client, PRINT, 2) for _ in range(calls)]
        await one_call(client, big, int(mib * (1 << 20)) + 1)
        larges = [await one_call(client, big, int(mib * (1 << 20)) + 1) for _ in range(max(5, calls // 10))]
    p50, p50_big = statistics.median(prints), statistics.median(larges)
    row = [name, f"{p50:.2f}", f"{p50_big:.1f}", f"{(p50_big - p50) / mib:.1f}"]
    if not concurrent:
        return [*row, "-"]
    done = [0]
    stop_at = [float("inf")]
    go = anyio.Event()

    async def loop() -> None:
        async with Client(params) as client:
            await one_call(client, PRINT, 2)
            await go.wait()
            while time.perf_counter() < stop_at[0]:
                await one_call(client, PRINT, 2)
                done[0] += 1

    async with anyio.create_task_group() as tg:
        for _ in range(CLIENTS):
            tg.start_soon(loop)
        await anyio.sleep(3.0)  # the clients' servers start (pacing, not synchronisation: go waits)
        began = time.perf_counter()
        stop_at[0] = began + seconds
        go.set()
    return [*row, f"{done[0] / (time.perf_counter() - began):.0f}"]


async def plot_call(client: Client, code: str) -> tuple[float, int]:
    """One call (ms) that must end ``ok``, and the bytes of the images it returned (base64)."""
    began = time.perf_counter()
    result = await client.call_tool("run_python", {"code": code})
    elapsed = (time.perf_counter() - began) * 1000
    images = [block for block in result.content if block.type == "image"]
    if result.is_error or (result.structured_content or {}).get("status") != "ok":
        raise RuntimeError(f"a call failed: {str(result)[:300]}")
    if code == SCIENCE and not images:
        raise RuntimeError("the plot returned no image")
    return elapsed, sum(len(getattr(block, "data", "")) for block in images)


def p(samples: list[float], percent: int) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(percent / 100 * (len(ordered) - 1)))]


async def plot_mode(config: Config, stdio: StdioServerParameters, calls: int) -> None:
    """The plot and the print over stdio and in memory, side by side (see the module's text)."""
    block = 10
    samples: dict[tuple[str, str], list[float]] = {}
    image_bytes = 0
    engine = await DockerEngine.connect(config.docker_host, disk_image=config.image)
    async with SandboxService.start(config, engine=engine) as service, Client(stdio) as over_stdio:
        await service.wait_ready()
        async with Client(build_server(service)) as in_memory:
            clients = {"stdio": over_stdio, "memory": in_memory}
            for client in clients.values():
                for code in (PRINT, SCIENCE) * 3:
                    await plot_call(client, code)
            await settle(service)
            for round_index in range(-(-calls // block)):
                order = list(clients.items())
                for name, client in order if round_index % 2 == 0 else order[::-1]:
                    for label, code in (("plot", SCIENCE), ("print(1+1)", PRINT)):
                        for _ in range(block):
                            elapsed, size = await plot_call(client, code)
                            samples.setdefault((label, name), []).append(elapsed)
                            image_bytes = max(image_bytes, size)
    print(f"{len(samples['plot', 'stdio'])} calls of each; the plot's image {image_bytes} bytes of base64")
    print(f"{'':12}{'stdio p50':>10}{'p90':>8}{'memory p50':>12}{'p90':>8}{'stdio - memory p50':>20}")
    for label in ("plot", "print(1+1)"):
        over, local = samples[label, "stdio"], samples[label, "memory"]
        print(
            f"{label:12}{p(over, 50):10.1f}{p(over, 90):8.1f}{p(local, 50):12.1f}{p(local, 90):8.1f}"
            f"{p(over, 50) - p(local, 50):20.1f}"
        )


async def main_async(config_path: str | None, calls: int, mib: float, seconds: float, plot: bool = False) -> None:
    config = load_config(config_path)
    # Logs as quiet as the stdio server's (``config_for_subprocess``). Unset, the SDK's server installs
    # rich's handler, whose line for each call took ~0.55 ms of the in-memory side's time.
    logs.setup("warning")  # text, as the local service's (``cli._setup_logging``)
    limits = config.limits.model_copy(update={"max_output_bytes": int(mib * (1 << 20)) + 4096})
    config = config.model_copy(update={"limits": limits})
    config = config.model_copy(update={"sessions": config.sessions.model_copy(update={"durable": False})})
    rows = [["server", "print p50 ms", f"{mib:g} MiB p50 ms", "ms per MiB", f"{CLIENTS} clients calls/s"]]
    with tempfile.TemporaryDirectory(prefix="mcp-code-exec-floor-") as tmp:
        path = os.path.join(tmp, "config.toml")
        await anyio.Path(path).write_text(to_toml(config_for_subprocess(config)))
        floor = os.path.join(tmp, "floor.py")
        await anyio.Path(floor).write_text(FLOOR)
        env = {**os.environ, ENV_RUNTIME_DIR: tmp}

        def ours(extra: list[str]) -> StdioServerParameters:
            command, *args = service_command(["serve", "--config", path, *extra], os.getcwd())
            return StdioServerParameters(command=command, args=args, env=env, cwd=tmp)

        servers = [
            ("floor (SDK server, exec in-process)", StdioServerParameters(command=sys.executable, args=["-I", floor])),
            ("ours, serve (front + local service)", ours([])),
            ("ours, serve --in-process", ours(["--in-process"])),
        ]
        try:
            if plot:
                load = os.getloadavg()
                await plot_mode(config, ours([]), calls)
                print(f"load average {load[0]:.2f} -> {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
                return
            for name, params in servers:
                # 8 in-process servers would be 8 services, each starting a warm pool: not measured
                rows.append(await measure(name, params, calls, mib, seconds, concurrent="--in-process" not in name))
            pid = service_pid(place_for(path, env))
            if pid is not None:  # what the service itself holds (its warm containers are apart)
                status = await anyio.Path(f"/proc/{pid}/status").read_text()
                print(next(line for line in status.splitlines() if line.startswith("VmRSS")), "(the local service)")
        finally:
            await stop_local_service(path, env)
    widths = [max(len(row[index]) for row in rows) for index in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) if index == 0 else cell.rjust(width) for index, (cell, width) in
                        enumerate(zip(row, widths, strict=True))))  # fmt: skip
    floor_p50, floor_rate = float(rows[1][1]), float(rows[1][4])
    for row in rows[2:]:
        rate = "" if row[4] == "-" else f", throughput {100 * float(row[4]) / floor_rate:.0f}% of the floor's"
        print(f"{row[0]}: print p50 {float(row[1]) / floor_p50:.1f}x the floor's{rate}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="configuration file (TOML): its image and pool are used")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--mib", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--plot", action="store_true", help="the plot over stdio against in memory (only)")
    args = parser.parse_args()
    anyio.run(main_async, args.config, args.calls, args.mib, args.seconds, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
