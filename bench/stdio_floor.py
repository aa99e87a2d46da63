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

    mcp-code-exec image build
    python bench/stdio_floor.py --config my.toml

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

from mcp_code_exec.commands.bench.outside import stop_local_service
from mcp_code_exec.commands.bench.report import config_for_subprocess, to_toml
from mcp_code_exec.commands.stdio.isolation import service_command
from mcp_code_exec.commands.stdio.local_service import ENV_RUNTIME_DIR, place_for, service_pid
from mcp_code_exec.config.settings import load_config

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


async def main_async(config_path: str | None, calls: int, mib: float, seconds: float) -> None:
    config = load_config(config_path)
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
    args = parser.parse_args()
    anyio.run(main_async, args.config, args.calls, args.mib, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
