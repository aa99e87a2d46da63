"""A stdio front (``mcp-code-exec serve``) spoken to line by line in 2025-06-18 JSON-RPC, so a test can
hold it mid-conversation, answer its own handshake, or SIGKILL it (the SDK client hides all three);
and ``sdk_front``, the same process for the SDK's own client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from mcp import StdioServerParameters


class LineFront:
    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.buffer = b""
        self.next_id = 0

    async def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send(json.dumps(message).encode() + b"\n")

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        await self.send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        return await self.reply()

    async def reply(self) -> dict[str, Any]:
        """The answer to the last request sent."""
        assert self.process.stdout is not None
        while True:
            while b"\n" not in self.buffer:
                self.buffer += await self.process.stdout.receive()
            line, self.buffer = self.buffer.split(b"\n", 1)
            reply: dict[str, Any] = json.loads(line)
            if reply.get("id") == self.next_id:
                return reply

    async def initialize(self, name: str = "line-front") -> dict[str, Any]:
        info = {"name": name, "version": "0"}
        reply = await self.request(
            "initialize", {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": info}
        )
        await self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return reply

    async def tool(self, name: str, **arguments: Any) -> dict[str, Any]:
        reply = await self.request("tools/call", {"name": name, "arguments": arguments})
        assert "result" in reply and not reply["result"].get("isError"), reply
        content: dict[str, Any] = reply["result"]["structuredContent"]
        return content


# The two ways the docs tell a client to start the server: the console script, and the interpreter
# isolated (``-I``: not ``python -m`` alone, which looks for the package in its working directory first).
CONSOLE_SCRIPT = Path(sys.executable).with_name("mcp-code-exec")
FORMS = {"console script": [str(CONSOLE_SCRIPT)], "python -I -m": [sys.executable, "-I", "-m", "mcp_code_exec"]}


def serve_command(config_path: Path, form: str = "python -I -m") -> list[str]:
    return [*FORMS[form], "serve", "--config", str(config_path)]


@asynccontextmanager
async def line_front(
    config_path: Path, *, stderr: int = subprocess.DEVNULL, form: str = "python -I -m", cwd: Path | None = None
) -> AsyncIterator[LineFront]:
    """A new ``serve`` process (started in ``cwd``), killed at the end if it is still there."""
    async with await anyio.open_process(serve_command(config_path, form), stderr=stderr, cwd=cwd) as process:
        try:
            yield LineFront(process)
        finally:
            if process.returncode is None:
                process.kill()


def sdk_front(
    config_path: Path, *, form: str = "python -I -m", cwd: Path | None = None, **env: str
) -> StdioServerParameters:
    """A new ``serve`` process (the front) for the SDK's client, as a per-call client starts one
    (in ``cwd``: where the client starts its servers)."""
    command, *args = serve_command(config_path, form)
    return StdioServerParameters(command=command, args=args, env={**os.environ, **env}, cwd=cwd)
