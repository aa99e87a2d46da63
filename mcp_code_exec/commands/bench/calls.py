"""What the measurements do through an MCP client, and waits for the service to be at rest."""

from __future__ import annotations

import time
from typing import Any

import anyio
from mcp import Client
from mcp.types import CallToolResult

from ...service.facade import SandboxService

PRINT = "print(1+1)"
SCIENCE = (
    "import numpy as np, pandas as pd, matplotlib.pyplot as plt\n"
    "df = pd.DataFrame({'x': np.arange(20), 'y': np.arange(20) ** 2})\n"
    "plt.figure(figsize=(4, 3)); plt.plot(df.x, df.y)\n"
    "int(df.y.sum())"
)
SETTLE_S = 120.0


async def run_ok(
    client: Client, code: str, *, session_id: str | None = None, stdout: str | None = None, images: int = 0
) -> bool:
    """One run_python call; True when it ran fine and gave what was expected."""
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


async def new_session(client: Client) -> str:
    result = await client.call_tool("new_session", {})
    if result.is_error or not result.structured_content:
        raise RuntimeError(f"new_session failed: {result.content}")
    return str(result.structured_content["session_id"])


async def timed_new_sessions(client: Client, service: SandboxService, count: int) -> tuple[list[float], int]:
    """``count`` timed ``new_session`` calls (ms), each with a warm spare ready (the wait is not
    timed) and closed at once; and how many failed."""
    samples: list[float] = []
    failures = 0
    for _ in range(count):
        await wait_for_spares(service)
        started = time.perf_counter()
        result = await client.call_tool("new_session", {})
        elapsed = (time.perf_counter() - started) * 1000
        if result.is_error or not result.structured_content:
            failures += 1
            continue
        samples.append(elapsed)
        await client.call_tool("close_session", {"session_id": result.structured_content["session_id"]})
    return samples, failures


async def wait_for_spares(service: SandboxService, timeout_s: float = SETTLE_S) -> None:
    """Until the session pool holds its warm spares again."""
    wanted = service.config.pool.session_spares
    await service.session_spares.wait_for(lambda pool: pool.idle >= wanted, timeout_s)


async def settle(service: SandboxService, timeout_s: float = SETTLE_S) -> None:
    """Until every pool is full and idle, so a measurement does not include container starts."""
    wanted = service.config.pool.size
    await service.stateless_pool.wait_for(lambda pool: pool.idle >= wanted, timeout_s)
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
