"""Measurements outside the in-memory service: the server as a stdio subprocess (cold start, first
call, steady calls) and the naive ways of running the same code (a container per call, an exec per
call) with the same hardened flags."""

from __future__ import annotations

import dataclasses
import os
import signal
import tempfile
import time

import anyio
from mcp import Client, StdioServerParameters

from ...runtime.docker.engine import DockerEngine
from ...service.facade import SandboxService
from ..stdio.isolation import service_command
from ..stdio.local_service import ENV_RUNTIME_DIR, place_for, service_alive, service_pid
from .calls import PRINT, read_all, run_ok
from .measure import Bench
from .report import config_for_subprocess, to_toml

START_S = 180


async def stdio(bench: Bench) -> None:
    """Fresh ``serve`` processes over stdio, as clients start them: the first also starts the local
    service (cold), the next find it running (warm: what a client that starts a server per call pays
    each time); each measured to the end of the handshake and through its first call, then a run of
    steady calls on the last. The service runs in a directory of the bench's own and is stopped at
    the end, so nothing outlives the bench."""
    handshake = bench.metric("stdio_handshake", "stdio: server start to end of handshake (cold service)")
    first = bench.metric("stdio_first_call", "stdio: first run_python after the handshake (cold service)")
    warm_handshake = bench.metric("stdio_warm_handshake", "stdio: server start to end of handshake (warm service)")
    warm_first = bench.metric("stdio_warm_first_call", "stdio: first run_python after the handshake (warm service)")
    steady = bench.metric("stdio_print", "stateless print(1+1) over stdio")
    with tempfile.TemporaryDirectory(prefix="mcp-code-exec-bench-") as tmp:
        path = os.path.join(tmp, "config.toml")
        await anyio.Path(path).write_text(to_toml(config_for_subprocess(bench.config)))
        env = {**os.environ, ENV_RUNTIME_DIR: tmp}
        # As a client should start it: isolated, and not in a directory sandboxes may write to.
        command, *args = service_command(["serve", "--config", path], os.getcwd())
        params = StdioServerParameters(command=command, args=args, env=env, cwd=tmp)
        try:
            for attempt in range(1 + max(1, bench.plan.cold_starts)):
                with anyio.fail_after(START_S):
                    started = time.perf_counter()
                    async with Client(params) as client:
                        (warm_handshake if attempt else handshake).samples.append(
                            (time.perf_counter() - started) * 1000
                        )
                        await bench.sample(warm_first if attempt else first, 1, lambda: run_ok(client, PRINT))
                        if attempt == max(1, bench.plan.cold_starts):
                            for _ in range(max(3, bench.plan.warmup)):
                                await run_ok(client, PRINT)
                            await bench.sample(
                                steady, bench.plan.stdio_prints, lambda: run_ok(client, PRINT, stdout="2\n")
                            )
        finally:
            await stop_local_service(path, env)


async def stop_local_service(config_path: str, env: dict[str, str]) -> None:
    """SIGTERM the local service the bench's fronts started, and wait (bounded) until it is gone."""
    place = place_for(config_path, env)
    pid = service_pid(place)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    with anyio.move_on_after(START_S):
        while service_alive(place):  # noqa: ASYNC110 - another process's lock: no event to wait on
            await anyio.sleep(0.1)


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
