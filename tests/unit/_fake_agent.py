"""A container's agent played in memory: it answers each request as the real agent does."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import ByteStream

from mcp_code_exec.protocol import frames
from mcp_code_exec.runtime.base import ContainerSpec

Exec = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


async def send(stream: ByteStream, header: dict[str, Any], payload: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    await stream.send(frames.PREFIX.pack(len(raw), len(payload)) + raw + payload)


async def echo(code: str, request: dict[str, Any]) -> dict[str, Any]:
    """The default cell: prints its code back."""
    return {"stdout": f"ran {code}\n"}


@dataclass
class FakeAgent:
    """Call it as an engine's agent. ``cell`` decides a run's outcome (fields of the done event)."""

    cell: Exec = echo
    clean: bool = True
    files: dict[str, bytes] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    interrupted: anyio.Event = field(default_factory=anyio.Event)

    async def __call__(self, stream: ByteStream, spec: ContainerSpec) -> None:
        await send(stream, {"ev": "ready", "agent_version": 2, "python": "3.11.2"})
        decoder = frames.FrameDecoder(max_header=frames.MAX_REQUEST_HEADER, max_payload=frames.MAX_REQUEST_PAYLOAD)
        async with anyio.create_task_group() as tg:
            while True:
                try:
                    data = await stream.receive()
                except anyio.EndOfStream:  # the host let go: the container's stdin closed
                    tg.cancel_scope.cancel()
                    return
                for header, payload in decoder.feed(data):
                    self.requests.append(header)
                    if header["op"] == "exec":
                        tg.start_soon(self.execute, stream, header, payload)
                    elif header["op"] == "interrupt":
                        self.interrupted.set()
                    else:
                        await self.answer(stream, header, payload)

    async def execute(self, stream: ByteStream, header: dict[str, Any], payload: bytes) -> None:
        done: dict[str, Any] = {
            "ev": "done", "id": header["id"], "status": "ok", "result": None, "error": None, "stdout": "",
            "stderr": "", "truncated": [], "session_restarted": False, "duration_ms": 1.0, "files": [],
            "notes": [], "recycle": False,
        }  # fmt: skip
        with anyio.move_on_after(header["timeout"]) as deadline:
            async with anyio.create_task_group() as tg:

                async def watch_interrupt() -> None:
                    await self.interrupted.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_interrupt)
                done.update(await self.cell(payload.decode(), header))
                tg.cancel_scope.cancel()
        if deadline.cancelled_caught:
            done["status"] = "timeout"
        elif self.interrupted.is_set():
            done["status"], self.interrupted = "cancelled", anyio.Event()
        await send(stream, done)
        if header["mode"] == "stateless" and not done["recycle"]:
            await send(stream, {"ev": "clean", "id": header["id"], "ok": self.clean, "problems": []})

    async def answer(self, stream: ByteStream, header: dict[str, Any], payload: bytes) -> None:
        rid, op = header["id"], header["op"]
        if op == "ping":
            await send(stream, {"ev": "pong", "id": rid, "oom_kills": 0})
        elif op == "write_file":
            self.files[header["path"]] = payload
            await send(
                stream, {"ev": "written", "id": rid, "path": header["path"], "size": len(payload), "modified": 1.0}
            )
        elif op == "read_file":
            if header["path"] not in self.files:
                await send(stream, {"ev": "error", "id": rid, "message": f"{header['path']}: no such file"})
                return
            data = self.files[header["path"]]
            meta = {"ev": "file", "id": rid, "path": header["path"], "size": len(data), "modified": 1.0}
            await send(stream, meta, data)
        elif op == "list_files":
            entries = [
                {"path": path, "size": len(data), "is_dir": False, "is_symlink": False, "modified": 1.0}
                for path, data in sorted(self.files.items())
            ]
            await send(stream, {"ev": "listing", "id": rid, "entries": entries, "truncated": False})
        else:
            await send(stream, {"ev": "error", "id": rid, "message": f"unknown op {op!r}"})
