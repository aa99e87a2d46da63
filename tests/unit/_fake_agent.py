"""A container's agent played in memory: it answers each request as the real agent does, with the
real agent's event builders (``mcpx_agent/events.py``)."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ByteStream

from mcp_code_exec.protocol import frames
from mcp_code_exec.runtime.base import ContainerSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent import events
from mcpx_agent import protocol as agent_protocol

DURABLE_OPS = ("restore", "snapshot_sync", "variables", "export_notebook")
Exec = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


async def send(stream: ByteStream, header: dict[str, Any], payload: bytes = b"") -> None:
    await stream.send(agent_protocol.encode(header, payload))


async def echo(code: str, request: dict[str, Any]) -> dict[str, Any]:
    """The default cell: prints its code back."""
    return {"stdout": f"ran {code}\n"}


@dataclass
class FakeAgent:
    """Call it as an engine's agent. ``cell`` decides a run's outcome (fields of the done event)."""

    cell: Exec = echo
    clean: bool = True
    files: dict[str, bytes] = field(default_factory=dict)
    staging: dict[str, bytearray] = field(default_factory=dict)
    quota: int | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    interrupted: anyio.Event = field(default_factory=anyio.Event)
    # The durable-session requests (restore, snapshot_sync, variables, export_notebook): answered
    # as an agent with snapshots does when True, with "unknown op" (an older agent) when False.
    snapshots: bool = True
    snapshot_found: bool = True
    variables: list[dict[str, Any]] = field(default_factory=lambda: [{"name": "x", "type": "int", "repr": "1"}])

    async def __call__(self, stream: ByteStream, spec: ContainerSpec) -> None:
        await send(stream, events.ready(2, "3.11.2"))
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
            "status": "ok", "result": None, "error": None, "stdout": "", "stderr": "", "truncated": [],
            "session_restarted": False, "duration_ms": 1.0, "files": [], "notes": [], "recycle": False,
            "usage": None,
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
        files_payload = done.pop("files_payload", b"")  # the collected files' bytes, as a cell says
        await send(stream, events.done(header["id"], **done), files_payload)
        if header["mode"] == "stateless" and not done["recycle"]:
            await send(stream, events.clean(header["id"], self.clean, []))

    async def write_chunk(self, stream: ByteStream, header: dict[str, Any], payload: bytes) -> None:
        """Stage in memory; the last chunk puts the file in place. A chunk over ``quota`` bytes in
        all is refused as the agent refuses it, and the upload is dropped."""
        rid, upload = header["id"], header["upload"]
        staged = self.staging.setdefault(upload, bytearray()) if header["offset"] == 0 else self.staging.get(upload)
        if staged is None or len(staged) != header["offset"]:
            self.staging.pop(upload, None)
            await send(stream, events.failure(rid, "a chunk out of order"))
            return
        announced = header.get("total") or 0 if header["offset"] == 0 else 0
        if self.quota is not None and max(announced, len(staged) + len(payload)) > self.quota:
            self.staging.pop(upload, None)
            await send(stream, events.failure(rid, "nothing was written: quota", "quota"))
            return
        staged += payload
        if not header["final"]:
            await send(stream, events.staged(rid, upload, len(staged)))
            return
        self.files[header["path"]] = bytes(self.staging.pop(upload))
        await send(stream, events.written(rid, header["path"], len(staged), 1.0))

    async def answer(self, stream: ByteStream, header: dict[str, Any], payload: bytes) -> None:
        rid, op = header["id"], header["op"]
        if op == "ping":
            await send(stream, events.pong(rid, 0))
        elif op == "write_chunk":
            await self.write_chunk(stream, header, payload)
        elif op == "abort_upload":
            self.staging.pop(header["upload"], None)
            await send(stream, events.dropped(rid, header["upload"]))
        elif op == "read_chunk":
            if header["path"] not in self.files:
                await send(stream, events.failure(rid, f"{header['path']}: no such file"))
                return
            data = self.files[header["path"]]
            offset, length = header["offset"], header["length"]
            chunk = events.chunk(rid, header["path"], offset, len(data), 1.0, 10**9)
            await send(stream, chunk, data[offset : offset + length])
        elif op == "list_files":
            entries = [
                {"path": path, "size": len(data), "is_dir": False, "is_symlink": False, "modified": 1.0}
                for path, data in sorted(self.files.items())
            ]
            await send(stream, events.listing(rid, entries, False))
        elif self.snapshots and op in DURABLE_OPS:
            await self.durable(stream, header)
        else:
            await send(stream, events.failure(rid, f"unknown op {op!r}"))

    async def durable(self, stream: ByteStream, header: dict[str, Any]) -> None:
        rid, op = header["id"], header["op"]
        if op == "restore":
            found = self.snapshot_found
            note = "restored 1 names" if found else "no snapshot yet"
            await send(stream, events.restored(rid, "restored" if found else "none", int(found), [], note, 1.0))
        elif op == "snapshot_sync":
            await send(stream, events.snapshot(rid, True, 1.0, 10))
        elif op == "variables":
            await send(stream, events.variables(rid, self.variables[: header["limit"]], False))
        else:
            self.files[header["path"]] = b"{}"
            await send(stream, events.written(rid, header["path"], 2, 1.0))
