"""Where a stateless call over stdio spends its time in the local service, step by step.

Starts a local service of its own whose process stamps ``time.perf_counter()`` at four places: a
``tools/call`` line read from the front, an ``exec`` request framed and sent on a container's
attach stream (before and after), its ``done`` event read, and the answer written to the front
(before and after). Then, through the MCP SDK's client, ``print(1+1)`` calls to the floor
(``stdio_floor.py``'s server) and through ``mcp-code-exec serve`` (the front, relaying to that
service): ``WARM_UP_S`` seconds of them unmeasured, while the service's pools fill, then ``--calls``;
``--rounds`` times, with a new service each round. Per round: the client's p50 for both, and the
p50 / p90 / p99 of each step in the service::

    line read ─▶ exec sent ─ ─ (the container) ─ ─▶ done read ─▶ answer written
              1           2                      3             4   5

The client, the front and the pipes between them are outside the service: the client's p50 less
the service's (a difference of medians, so approximate). The service runs in
``MCP_CODE_EXEC_RUNTIME_DIR`` when that is set (a test's private directory), else in the script's
own; it is stopped at the end of each round, and its stamps are written as it exits. It is
started as a front starts one (``--ready-fd``), but with this script's import path rather than
isolated (``-I``): the same code, not the same start-up.

    mcp-code-exec image build
    python bench/stdio_steps.py --config my.toml --calls 500 --rounds 3
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import anyio
from mcp import Client, StdioServerParameters

from mcp_code_exec.commands.bench.outside import START_S as STOP_S
from mcp_code_exec.commands.bench.outside import stop_local_service
from mcp_code_exec.commands.bench.report import config_for_subprocess, percentile, to_toml
from mcp_code_exec.commands.stdio.isolation import service_command
from mcp_code_exec.commands.stdio.local_service import ENV_RUNTIME_DIR, place_for, service_alive
from mcp_code_exec.config.settings import load_config

PRINT = "print(1+1)"
WARM_UP_S = 5.0  # longer than a pool's containers take to start (about a second each)
CALL_S = 60.0
START_S = 120.0
STEPS = [
    ("1. the request's line read, to its exec request's start (before the framing)", "in", "send"),
    ("2. the exec request framed and sent on the attach stream", "send", "sent"),
    ("3. the container: the request sent, to its done event read", "sent", "done"),
    ("4. the done event read, to the answer's write", "done", "out"),
    ("5. the answer's write to the front", "out", "written"),
    ("in the service in all: the line read, to the answer written", "in", "written"),
]


def stamp_the_service(path: str) -> None:
    """In the service's process: wrap the four places, and write the stamps at its exit."""
    from mcp_code_exec.mcp_server.local import daemon
    from mcp_code_exec.sandbox import channel

    stamps: list[tuple[str, float]] = []

    def write_stamps() -> None:
        with open(path, "w") as out:
            json.dump(stamps, out)

    atexit.register(write_stamps)  # SIGTERM makes the service return from its main, so atexit runs
    next_line, start, route, write = (
        daemon._Lines.next_line, channel.AgentChannel.start, channel.AgentChannel._route, daemon._Writer.write
    )  # fmt: skip

    async def stamped_next_line(self: Any, limit: int | None = None) -> bytes:
        line: bytes = await next_line(self, limit)
        if b'"tools/call"' in line:
            stamps.append(("in", time.perf_counter()))
        return line

    async def stamped_start(self: Any, request: Any, payload: bytes = b"", **options: Any) -> Any:
        is_exec = getattr(request, "op", None) == "exec"
        if is_exec:
            stamps.append(("send", time.perf_counter()))
        sent = await start(self, request, payload, **options)
        if is_exec:
            stamps.append(("sent", time.perf_counter()))
        return sent

    async def stamped_route(self: Any, header: dict[str, Any], payload: bytes) -> None:
        if header.get("ev") == "done":
            stamps.append(("done", time.perf_counter()))
        await route(self, header, payload)

    async def stamped_write(self: Any, text: str) -> None:
        answer = '"structuredContent"' in text
        if answer:
            stamps.append(("out", time.perf_counter()))
        await write(self, text)
        if answer:
            stamps.append(("written", time.perf_counter()))

    daemon._Lines.next_line = stamped_next_line  # type: ignore[method-assign]
    channel.AgentChannel.start = stamped_start  # type: ignore[method-assign]
    channel.AgentChannel._route = stamped_route  # type: ignore[method-assign]
    daemon._Writer.write = stamped_write  # type: ignore[method-assign]


def calls_of(stamps: list[tuple[str, float]]) -> list[dict[str, float]]:
    """Each call's moments, in order: a line, then the first of each later place before the answer
    is written (one stateless call runs at a time, so nothing of another call falls between)."""
    calls: list[dict[str, float]] = []
    current: dict[str, float] | None = None
    for name, at in stamps:
        if name == "in":
            current = {"in": at}
        elif current is not None:
            current.setdefault(name, at)
            if name == "written":
                if len(current) == 6:  # in, send, sent, done, out, written
                    calls.append(current)
                current = None
    return calls


async def timed_calls(params: StdioServerParameters, calls: int) -> tuple[int, list[float]]:
    """``WARM_UP_S`` seconds of calls, then ``calls`` timed ones: how many warmed up, and the times (ms)."""
    from stdio_floor import one_call  # this script's directory; only here, not in the service's process

    with anyio.fail_after(START_S + WARM_UP_S + calls * CALL_S):  # the client's start and close too
        async with Client(params) as client:
            warmed, until = 0, time.monotonic() + WARM_UP_S
            while time.monotonic() < until:
                with anyio.fail_after(CALL_S):
                    await one_call(client, PRINT, 2)
                warmed += 1
            took = []
            for _ in range(calls):
                with anyio.fail_after(CALL_S):
                    took.append(await one_call(client, PRINT, 2))
    return warmed, took


async def start_stamped_service(config: str, stamps: str, log: str, env: dict[str, str]) -> None:
    """Start the stamped service as a front would (``--ready-fd``, its output in ``log``), and wait
    until it says it is ready."""
    command = [sys.executable, __file__, "--as-service", stamps, "daemon", "--config", config]
    ready_r, ready_w = os.pipe()
    try:
        try:
            out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                with anyio.fail_after(START_S):  # it forks, and its first process exits at once
                    await anyio.run_process(
                        [*command, "--ready-fd", str(ready_w)],
                        env=env,
                        pass_fds=(ready_w,),
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=out,
                        start_new_session=True,
                    )
            finally:
                os.close(out)
        finally:
            os.close(ready_w)  # the service holds its own copy: the pipe ends with its last line
        said = b""
        os.set_blocking(ready_r, False)
        with anyio.fail_after(START_S):
            while True:
                await anyio.wait_readable(ready_r)
                if not (chunk := os.read(ready_r, 4096)):
                    break
                said += chunk
    finally:
        os.close(ready_r)
    if said.splitlines()[-1:] != [b"ready"]:  # "listening", then "ready" or why not
        raise SystemExit(f"the stamped service did not start: {said.decode(errors='replace').strip()}")


def spread(samples: list[float]) -> str:
    p50, p90, p99 = (percentile(samples, q) or 0.0 for q in (50, 90, 99))
    return f"p50 {p50:.3f} ms, p90 {p90:.3f} ms, p99 {p99:.3f} ms"


async def round_of(round_number: int, config: str, tmp: str, calls: int) -> None:
    from stdio_floor import FLOOR  # the same floor as stdio_floor.py's

    floor = os.path.join(tmp, "floor.py")
    await anyio.Path(floor).write_text(FLOOR)
    env = {**os.environ, ENV_RUNTIME_DIR: os.environ.get(ENV_RUNTIME_DIR) or tmp}
    command, *args = service_command(["serve", "--config", config], os.getcwd())
    ours = StdioServerParameters(command=command, args=args, env=env, cwd=tmp)
    stamps = os.path.join(tmp, f"stamps-{round_number}.json")
    load = os.getloadavg()[0]
    _, floor_took = await timed_calls(StdioServerParameters(command=sys.executable, args=["-I", floor]), calls)
    try:
        await start_stamped_service(config, stamps, os.path.join(tmp, "service.log"), env)
        warmed, ours_took = await timed_calls(ours, calls)
    finally:
        await stop_local_service(config, env)
    if service_alive(place_for(config, env)):  # its stamps are written as it exits: not yet, or not whole
        raise SystemExit(f"the stamped service did not stop on SIGTERM within {STOP_S:.0f} s")
    moments = calls_of(json.loads(await anyio.Path(stamps).read_text()))[warmed:]
    if len(moments) != calls:
        raise SystemExit(f"{len(moments)} of the {calls} calls were stamped at every place")
    ours_p50, floor_p50 = percentile(ours_took, 50) or 0.0, percentile(floor_took, 50) or 0.0
    in_service = [(call["written"] - call["in"]) * 1000 for call in moments]
    print(f"round {round_number} (load average {load:.2f}, {calls} calls after {warmed} to warm up)")
    print(f"  the client's whole call, p50: ours {ours_p50:.2f} ms, the floor's {floor_p50:.2f} ms")
    for name, begin, end in STEPS:
        print(f"  {name}: {spread([(call[end] - call[begin]) * 1000 for call in moments])}")
    outside = ours_p50 - (percentile(in_service, 50) or 0.0)
    print(f"  outside the service (client, front, pipes), p50 less p50: {outside:.2f} ms")


async def main_async(config_path: str | None, calls: int, rounds: int) -> None:
    config = load_config(config_path)
    config = config.model_copy(update={"sessions": config.sessions.model_copy(update={"durable": False})})
    with tempfile.TemporaryDirectory(prefix="mcpx-steps-") as tmp:
        path = os.path.join(tmp, "config.toml")
        await anyio.Path(path).write_text(to_toml(config_for_subprocess(config)))
        for round_number in range(1, rounds + 1):
            await round_of(round_number, path, tmp, calls)


def main() -> int:
    if sys.argv[1:2] == ["--as-service"]:
        stamp_the_service(sys.argv[2])
        from mcp_code_exec.commands.cli import main as cli_main

        return cli_main(sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="configuration file (TOML): its image and pool are used")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    anyio.run(main_async, args.config, args.calls, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
