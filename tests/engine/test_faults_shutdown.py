"""Faults from outside, at the real server's end: shut down by SIGTERM, SIGINT or its stdin closing
while a run is in flight, it exits cleanly and removes every container and volume it made.

Every wait is bounded (``anyio.fail_after``); leak checks look only at this server's containers and
volumes (other test runs share the engine).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from _support import ServerProcess, client_with_token, structured_call
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from mcp_code_exec.config.settings import Config
from mcp_code_exec.runtime.base import LABEL_OWNER

pytestmark = pytest.mark.anyio


def objects_of_pid(pid: int) -> tuple[list[str], list[str]]:
    """Containers and volumes whose owner label names this host and ``pid``."""
    import docker

    def mine(labels: dict[str, str]) -> bool:
        parts = labels.get(LABEL_OWNER, "").rsplit(":", 2)
        return len(parts) == 3 and parts[0] == socket.gethostname() and parts[1] == str(pid)

    client = docker.from_env()
    try:
        containers = [
            c["Id"] for c in client.api.containers(all=True, filters={"label": LABEL_OWNER}) if mine(c["Labels"] or {})
        ]
        volumes = [
            v["Name"]
            for v in client.api.volumes(filters={"label": LABEL_OWNER}).get("Volumes") or []
            if mine(v.get("Labels") or {})
        ]
        return containers, volumes
    finally:
        client.close()


class StdioPeer:
    """A bare JSON-RPC client over a server process's stdin/stdout (so the test owns the process)."""

    def __init__(self, process: Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.stdin = process.stdin
        self.stdout = BufferedByteReceiveStream(process.stdout)
        self.replies: dict[int, dict[str, Any]] = {}
        self.progress: list[dict[str, Any]] = []
        self.eof = anyio.Event()
        self.changed = anyio.Event()
        self._next = 0

    async def read_loop(self) -> None:
        try:
            while True:
                line = await self.stdout.receive_until(b"\n", 64 * 1024 * 1024)
                message = json.loads(line)
                if "id" in message and ("result" in message or "error" in message):
                    self.replies[message["id"]] = message
                elif message.get("method") == "notifications/progress":
                    self.progress.append(message["params"])
                self.changed.set()
                self.changed = anyio.Event()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        finally:
            self.eof.set()
            self.changed.set()

    async def send(self, method: str, params: dict[str, Any] | None = None, *, notify: bool = False) -> int:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params or {}}
        self._next += 1
        if not notify:
            message["id"] = self._next
        await self.stdin.send(json.dumps(message).encode() + b"\n")
        return self._next

    async def until(self, predicate: Any) -> None:
        while not predicate():
            if self.eof.is_set():
                raise AssertionError("the server closed its stdout")
            await self.changed.wait()

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        request_id = await self.send(method, params)
        await self.until(lambda: request_id in self.replies)
        return self.replies[request_id]

    async def tool(self, name: str, **arguments: Any) -> dict[str, Any]:
        reply = await self.call("tools/call", {"name": name, "arguments": arguments})
        assert "result" in reply, reply
        result: dict[str, Any] = reply["result"]
        assert not result.get("isError"), result
        return result


@pytest.fixture
def server_config_file(tmp_path: Path, config: Config) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'image = "{config.image}"\n'
        "[limits]\nmemory_mb = 256\ndefault_timeout_s = 20\nmax_run_s = 60\n"
        "[pool]\nsize = 1\nsession_spares = 1\nacquire_timeout_s = 30\n"
        "[sessions]\ndurable = false\n"  # a clean exit removes its sessions (durable ones are kept: test_durable_restart)
    )
    return path


async def start_server(config_file: Path, log_path: Path) -> Process:
    """``mcp_code_exec serve --in-process`` as a child process the test owns, its stderr in ``log_path``."""
    with log_path.open("wb") as log_file:
        return await anyio.open_process(
            [sys.executable, "-m", "mcp_code_exec", "serve", "--in-process", "--config", str(config_file)],
            stderr=log_file,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


async def open_a_session_and_start_a_long_run(peer: StdioPeer) -> int:
    """Initialize, make a session with a file and a run in it, then start a run that is still in flight
    when the shutdown comes. Returns that run's request id."""
    init = await peer.call(
        "initialize",
        {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "faults", "version": "0"},
        },
    )
    assert "result" in init, init
    await peer.send("notifications/initialized", notify=True)
    session = (await peer.tool("new_session"))["structuredContent"]["session_id"]
    await peer.tool("write_file", session_id=session, path="a.txt", content="kept until shutdown")
    await peer.tool("run_python", code="open('a.txt').read()", session_id=session)
    containers, volumes = objects_of_pid(peer.process.pid)
    assert containers and volumes

    # A run in flight when the shutdown comes: it streams a line first, so we know it runs.
    long_run = await peer.send(
        "tools/call",
        {
            "name": "run_python",
            "arguments": {
                "code": "print('running', flush=True)\nimport time\ntime.sleep(40)",
                "timeout": 50,
            },
            "_meta": {"progressToken": "in-flight"},
        },
    )
    await peer.until(lambda: any(p.get("progressToken") == "in-flight" for p in peer.progress))
    return long_run


async def shut_down(peer: StdioPeer, how: str) -> int:
    """Stop the server by a signal or by closing its stdin; its exit code once its stdout has closed."""
    process = peer.process
    if how == "stdin-close":
        await process.stdin.aclose()  # type: ignore[union-attr]
    else:
        process.send_signal(getattr(signal, how))
    with anyio.fail_after(60):
        await peer.eof.wait()
        return await process.wait()


async def kill_if_running(process: Process) -> None:
    """Whatever happened to the test, the server does not outlive it."""
    if process.returncode is None:
        process.kill()
        with anyio.CancelScope(shield=True):
            await process.wait()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "stdin-close"])
async def test_the_server_exits_cleanly_and_removes_everything_it_made(
    how: str, server_config_file: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "server.log"
    process = await start_server(server_config_file, log_path)
    peer = StdioPeer(process)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(peer.read_loop)
            with anyio.fail_after(120):
                long_run = await open_a_session_and_start_a_long_run(peer)
            code = await shut_down(peer, how)
            tg.cancel_scope.cancel()
    finally:
        await kill_if_running(process)
    log_text = log_path.read_text(errors="replace")
    assert code == 0, log_text
    reply = peer.replies.get(long_run)
    if reply is not None:  # answered: as a result (cancelled/crashed) or an error, never a hang
        assert "result" in reply or "error" in reply
    # Everything this server made is gone when it has exited (no waiting for auto-remove).
    assert objects_of_pid(process.pid) == ([], []), log_text
    assert "shut down cleanly" in log_text


async def test_a_sigterm_of_an_http_server_logs_no_error_and_no_traceback(config: Config) -> None:
    """uvicorn's lifespan task, left pending when the server's task group is cancelled, used to be
    cancelled as the event loop closed and logged as an ERROR with a traceback after "shut down
    cleanly": the listener now shuts its application down before it goes."""
    token = "faults-sigterm-5c1e"
    server = ServerProcess("streamable-http", env={"MCP_CODE_EXEC_TOKEN": token}, args=["--metrics-port", "0"])
    async with server:
        async with client_with_token(server, token) as client:
            sid = (await structured_call(client, "new_session"))["session_id"]
            await structured_call(client, "run_python", code="x = 6 * 7", session_id=sid)
            server.process.send_signal(signal.SIGTERM)  # while the client's MCP session is open
            with anyio.fail_after(60):
                code = await anyio.to_thread.run_sync(server.process.wait)
        server.log.seek(0)
        log_text = server.log.read().decode(errors="replace")
    assert code == 0, log_text
    assert "shut down cleanly" in log_text
    assert "ERROR" not in log_text and "Traceback" not in log_text, log_text
