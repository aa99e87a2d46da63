"""Measurements outside the in-memory service: the server as a stdio subprocess (cold start, first
call, steady calls) and the naive ways of running the same code (a container per call, an exec per
call) with the same hardened flags."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time

import anyio
from mcp import Client, StdioServerParameters

from ...runtime.docker.engine import DockerEngine
from ...service.facade import SandboxService
from .calls import PRINT, read_all, run_ok
from .measure import Bench
from .report import config_for_subprocess, to_toml

START_S = 180


async def stdio(bench: Bench) -> None:
    """Fresh servers over stdio: the time to the end of the handshake, the first call after it (what
    a desktop client's first tool call waits), then a run of steady calls on the last server."""
    handshake = bench.metric("stdio_handshake", "stdio: server start to end of handshake")
    first = bench.metric("stdio_first_call", "stdio: first run_python after the handshake")
    steady = bench.metric("stdio_print", "stateless print(1+1) over stdio")
    with tempfile.TemporaryDirectory(prefix="mcp-code-exec-bench-") as tmp:
        path = os.path.join(tmp, "config.toml")
        await anyio.Path(path).write_text(to_toml(config_for_subprocess(bench.config)))
        params = StdioServerParameters(command=sys.executable, args=["-m", "mcp_code_exec", "serve", "--config", path])
        for attempt in range(bench.plan.cold_starts):
            with anyio.fail_after(START_S):
                started = time.perf_counter()
                async with Client(params) as client:
                    handshake.samples.append((time.perf_counter() - started) * 1000)
                    await bench.sample(first, 1, lambda: run_ok(client, PRINT, stdout="2\n"))
                    if attempt == bench.plan.cold_starts - 1:
                        for _ in range(max(3, bench.plan.warmup)):
                            await run_ok(client, PRINT)
                        await bench.sample(steady, bench.plan.stdio_prints, lambda: run_ok(client, PRINT, stdout="2\n"))


async def baselines(bench: Bench, service: SandboxService, engine: DockerEngine) -> None:
    """The same print as ``docker run --rm`` per call and as ``docker exec`` per call."""
    command = ["python3", "-c", PRINT]
    spec = service.spec("stateless")  # the same hardened flags as the warm containers
    run = bench.metric("docker_run", "docker run --rm per call (print)")

    async def docker_run() -> bool:
        container_id, stream = await engine.start(dataclasses.replace(spec, command=command))
        try:
            output = await read_all(stream)
        finally:
            await stream.aclose()
            await engine.remove(container_id)  # --rm: the call ends when the container is gone
        return b"2\n" in output

    await bench.sample(run, bench.plan.docker_runs, docker_run)
    execs = bench.metric("docker_exec", "docker exec per call (print)")
    container_id, stream = await engine.start(dataclasses.replace(spec, command=["sleep", "infinity"]))
    try:

        async def docker_exec() -> bool:
            code, output = await engine.exec_once(container_id, command)
            return code == 0 and output.strip() == b"2"

        await docker_exec()  # the first exec pays for page cache warm-up
        await bench.sample(execs, bench.plan.docker_execs, docker_exec)
    finally:
        await stream.aclose()
        await engine.remove(container_id)
