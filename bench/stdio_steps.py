"""Where a stateless call over stdio spends its time in the local service, step by step.

Starts a local service of its own (in a runtime directory of its own) whose process stamps
``time.perf_counter()`` at four places: a ``tools/call`` line read from the front, a send on a
container's attach stream, each read from one, and an answer written to the front. Then, through the
MCP SDK's client, ``--calls`` ``print(1+1)`` calls to the floor (``stdio_floor.py``'s server), and
as many through ``mcp-code-exec serve`` (the front, relaying to that service), ``--rounds`` times.
Per round it prints the client's p50 for both, and the p50 / p90 of each step in the service:

    line read ──▶ send ──▶ sent ─ ─ ─ (the container) ─ ─ ─▶ done read ──▶ answer written

The client, the front and the pipes between them are the client's whole call less the service's
part. The service is stopped at the end (its stamps are written as it exits).

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
from stdio_floor import FLOOR  # the same floor as stdio_floor.py's (this script's directory is on the path)

from mcp_code_exec.commands.bench.outside import stop_local_service
from mcp_code_exec.commands.bench.report import config_for_subprocess, to_toml
from mcp_code_exec.commands.stdio.isolation import service_command
from mcp_code_exec.commands.stdio.local_service import ENV_RUNTIME_DIR
from mcp_code_exec.config.settings import load_config

PRINT = "print(1+1)"
WARM_UP = 40
START_S = 120.0
STEPS = [
    ("the request's line read, to its send to the container", "in", "send"),
    ("the send on the attach stream", "send", "sent"),
    ("the container's round trip: sent, to the done event read", "sent", "done"),
    ("the done event read, to the answer's write", "done", "out"),
    ("in the service in all: the line read, to the answer written", "in", "written"),
]


def stamp_the_service(path: str) -> None:
    """In the service's process: wrap the four places, and write the stamps at its exit."""
    from mcp_code_exec.mcp_server.local import daemon
    from mcp_code_exec.runtime.docker import attach

    stamps: list[tuple[str, float]] = []

    def write_stamps() -> None:
        with open(path, "w") as out:
            json.dump(stamps, out)

    atexit.register(write_stamps)  # the service returns from its main on SIGTERM, so atexit runs

    next_line, send, receive, write = (
        daemon._Lines.next_line, attach._Wrapper.send, attach.DemuxedStream.receive, daemon._Writer.write
    )  # fmt: skip

    async def stamped_next_line(self: Any, limit: int | None = None) -> bytes:
        line: bytes = await next_line(self, limit)
        if b'"tools/call"' in line:
            stamps.append(("in", time.perf_counter()))
        return line

    async def stamped_send(self: Any, item: bytes) -> None:
        stamps.append(("send", time.perf_counter()))
        await send(self, item)
        stamps.append(("sent", time.perf_counter()))

    async def stamped_receive(self: Any, max_bytes: int = 65536) -> bytes:
        data: bytes = await receive(self, max_bytes)
        stamps.append(("read", time.perf_counter()))
        return data

    async def stamped_write(self: Any, text: str) -> None:
        answer = "structuredContent" in text
        if answer:
            stamps.append(("out", time.perf_counter()))
        await write(self, text)
        if answer:
            stamps.append(("written", time.perf_counter()))

    daemon._Lines.next_line = stamped_next_line  # type: ignore[method-assign]
    attach._Wrapper.send = stamped_send  # type: ignore[method-assign]
    attach.DemuxedStream.receive = stamped_receive  # type: ignore[method-assign]
    daemon._Writer.write = stamped_write  # type: ignore[method-assign]


def calls_of(stamps: list[tuple[str, float]]) -> list[dict[str, float]]:
    """Each call's moments: its line, its first send, the last read before its answer (its done)."""
    calls, current, last_read = [], None, 0.0
    for name, at in stamps:
        if name == "in":
            current = {"in": at}
        elif current is None:
            continue
        elif name in ("send", "sent"):
            current.setdefault(name, at)
        elif name == "read":
            last_read = at
        elif name == "out":
            current.update(out=at, done=last_read)
        elif name == "written" and {"send", "sent", "out"} <= current.keys():
            current["written"] = at
            calls.append(current)
            current = None
    return calls[WARM_UP:]


def p(samples: list[float], percent: int) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, len(ordered) * percent // 100)]


async def client_p50(params: StdioServerParameters, calls: int) -> float:
    took = []
    async with Client(params) as client:
        for index in range(WARM_UP + calls):
            began = time.perf_counter()
            result = await client.call_tool("run_python", {"code": PRINT})
            if index >= WARM_UP:
                took.append((time.perf_counter() - began) * 1000)
            if result.is_error or "2" not in str(result.structured_content):
                raise SystemExit(f"the call failed: {result.content}")
    return p(took, 50)


async def start_stamped_service(config: str, stamps: str, log: str, env: dict[str, str]) -> None:
    """Start the stamped service as a front would (``--ready-fd``, its output in ``log``), and wait
    until it is ready."""
    ready_r, ready_w = os.pipe()
    command = [sys.executable, __file__, "--as-service", stamps, "daemon", "--config", config]
    try:
        # It forks and its first process exits at once: the service lives on, holding ready_w.
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
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
        os.close(ready_w)
    said = b""
    try:
        os.set_blocking(ready_r, False)
        with anyio.fail_after(START_S):
            while True:  # its lines, until it closes the pipe ("ready", or why not)
                await anyio.wait_readable(ready_r)
                if not (chunk := os.read(ready_r, 4096)):
                    break
                said += chunk
    finally:
        os.close(ready_r)
    if b"ready\n" not in said:
        raise SystemExit(f"the stamped service did not start: {said.decode(errors='replace').strip()}")


async def main_async(config_path: str | None, calls: int, rounds: int) -> None:
    config = load_config(config_path)
    config = config.model_copy(update={"sessions": config.sessions.model_copy(update={"durable": False})})
    with tempfile.TemporaryDirectory(prefix="mcpx-steps-") as tmp:
        path, floor = os.path.join(tmp, "config.toml"), os.path.join(tmp, "floor.py")
        await anyio.Path(path).write_text(to_toml(config_for_subprocess(config)))
        await anyio.Path(floor).write_text(FLOOR)
        env = {**os.environ, ENV_RUNTIME_DIR: tmp}
        command, *args = service_command(["serve", "--config", path], os.getcwd())
        ours = StdioServerParameters(command=command, args=args, env=env, cwd=tmp)
        floor_server = StdioServerParameters(command=sys.executable, args=["-I", floor])
        for round_number in range(1, rounds + 1):
            stamps = os.path.join(tmp, f"stamps-{round_number}.json")
            load = os.getloadavg()[0]
            floor_p50 = await client_p50(floor_server, calls)
            await start_stamped_service(path, stamps, os.path.join(tmp, "service.log"), env)
            try:
                ours_p50 = await client_p50(ours, calls)
            finally:
                await stop_local_service(path, env)
            moments = calls_of(json.loads(await anyio.Path(stamps).read_text()))
            print(f"round {round_number} (load average {load:.2f}, {len(moments)} calls)")
            print(f"  the client's whole call, p50: ours {ours_p50:.2f} ms, the floor's {floor_p50:.2f} ms")
            for name, start, end in STEPS:
                took = [(call[end] - call[start]) * 1000 for call in moments]
                print(f"  {name}: p50 {p(took, 50):.3f} ms, p90 {p(took, 90):.3f} ms")


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
