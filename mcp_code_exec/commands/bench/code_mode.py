"""Code mode's broker overhead, when ``mcp-server-time`` is installed (a dev dependency): the same
tool call made directly by an ``mcp`` client to the warm upstream and from sandbox code through
the broker, p50 each in one run, and a cell making 50 sequential calls.

The upstream is given to one identity of the bench's own (``principals``), so the other figures'
runs (the local client's) carry no catalog and are measured as before. Sandbox code times its own
calls (``time.perf_counter`` around each), so neither figure includes a run's start.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time

from mcp import Client, StdioServerParameters

from ...config.code_mode import UpstreamServer
from ...config.settings import Config
from ...service.facade import SandboxService
from .measure import Bench

PRINCIPAL = "bench-code-mode"
OWNER = f"token:{PRINCIPAL}"  # the identity a bearer token of that name gives: what principals name
SERVER = "time"
ARGUMENTS = {"timezone": "UTC"}
OVERHEAD_TARGET_MS = 5.0
CELL_CALLS = 50
WARM_CALLS = 5
TIMED = (
    "import mcp_tools, time, json\n"
    "call = mcp_tools.time.get_current_time\n"
    "for _ in range(WARM):\n"
    "    call(timezone='UTC')\n"
    "samples = []\n"
    "for _ in range(COUNT):\n"
    "    began = time.perf_counter()\n"
    "    call(timezone='UTC')\n"
    "    samples.append((time.perf_counter() - began) * 1000)\n"
    "print(json.dumps(samples))\n"
)
CELL = (
    "import mcp_tools, time\n"
    "call = mcp_tools.time.get_current_time\n"
    "began = time.perf_counter()\n"
    f"for _ in range({CELL_CALLS}):\n"
    "    call(timezone='UTC')\n"
    "print((time.perf_counter() - began) * 1000)\n"
)


def available() -> bool:
    return importlib.util.find_spec("mcp_server_time") is not None


def upstream() -> list[str]:
    return [sys.executable, "-I", "-m", "mcp_server_time"]  # isolated: nothing from the working directory


def with_code_mode(config: Config) -> Config:
    """The bench's config with ``mcp-server-time`` as an upstream of the bench's own identity."""
    if not available() or any(server.name == SERVER for server in config.code_mode.servers):
        return config
    command, *args = upstream()
    server = UpstreamServer(name=SERVER, command=command, args=args, principals=[PRINCIPAL])
    code_mode = config.code_mode.model_copy(update={"servers": [*config.code_mode.servers, server]})
    return config.model_copy(update={"code_mode": code_mode})


async def broker_overhead(bench: Bench, service: SandboxService) -> None:
    if not available() or not any(server.name == SERVER for server in service.config.code_mode.servers):
        return
    direct = bench.metric("code_mode_direct", "time.get_current_time, direct mcp client")
    command, *args = upstream()
    async with Client(StdioServerParameters(command=command, args=args)) as client:
        for _ in range(WARM_CALLS):
            await client.call_tool("get_current_time", ARGUMENTS)

        async def one() -> bool:
            return not (await client.call_tool("get_current_time", ARGUMENTS)).is_error

        await bench.sample(direct, bench.plan.tool_calls, one)
    direct_p50 = direct.percentile(50) or 0.0
    through = bench.metric(
        "code_mode_call", "  the same from sandbox code (mcp_tools)", target=direct_p50 + OVERHEAD_TARGET_MS
    )
    per_run = CELL_CALLS - WARM_CALLS  # within the run's call budget (50)
    left = bench.plan.tool_calls
    while left > 0:
        count = min(per_run, left)
        code = TIMED.replace("WARM", str(WARM_CALLS)).replace("COUNT", str(count))
        result = await service.run(OWNER, code)
        if result.status == "ok" and result.stdout.strip().startswith("["):
            through.samples += [float(value) for value in json.loads(result.stdout)]
        else:
            through.failures += 1
        left -= count
    overhead = bench.metric("code_mode_overhead", "  broker overhead (p50 difference)", target=OVERHEAD_TARGET_MS)
    if through.samples and direct.samples:
        overhead.value = (through.percentile(50) or 0.0) - direct_p50
    cell = bench.metric(
        "code_mode_cell", f"cell of {CELL_CALLS} sequential tool calls", target=CELL_CALLS * (direct_p50 + 5)
    )
    walls: list[float] = []
    for _ in range(bench.plan.tool_cells):
        began = time.perf_counter()
        result = await service.run(OWNER, CELL)
        walls.append((time.perf_counter() - began) * 1000)
        try:
            cell.samples.append(float(result.stdout))
        except ValueError:
            cell.failures += 1
    cell.note = (
        f"timed inside the cell; the whole run_python p50 {sorted(walls)[len(walls) // 2]:.1f} ms" if walls else ""
    )
