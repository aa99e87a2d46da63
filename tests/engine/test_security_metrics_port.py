"""``--metrics-port`` under a flood of idle connections from any local user (issue 32, class 3).

The real server over stdio, started with a descriptor limit of 1024 (soft and hard, so it cannot
raise it), its metrics on a port of their own. More connections than the server has descriptors
are opened to that port and never send a byte. The listener closes those past its cap at once and
the rest at the header deadline, within a budget that keeps half the descriptors for the server:
while the flood holds, ``new_session`` and runs work, and the metrics answer once it has gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import socket
import struct
import sys
import termios
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from _support import free_port, structured_call, wait_until
from mcp import Client, StdioServerParameters

from mcp_code_exec.config.settings import Config

pytestmark = pytest.mark.anyio
LIMIT = 1024  # the server's descriptors
FLOOD = 1300  # idle connections to its metrics port: more than it has descriptors


def answers_metrics(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return b"mcpx_build_info" in response.read()
    except OSError:
        return False


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def server_pid(config_file: Path) -> int:
    """The server process: the one whose command line names this test's config file."""
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and str(config_file).encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                return int(entry)
    raise AssertionError("the server process is not running")


def unacknowledged(connection: socket.socket) -> int:
    """Bytes sent on ``connection`` that the other end's kernel has not acknowledged yet."""
    queued = fcntl.ioctl(connection.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    return int(struct.unpack("i", queued)[0])


def flood(port: int) -> list[socket.socket]:
    """FLOOD connections to ``port``, one after the other, each sending a request's first line and
    nothing more. Each is let in before the next (its line acknowledged: with a full accept queue the
    kernel answers with SYN cookies, and a connection exists for the server only once its data gets
    in), for up to a second each and 90 s in all (a server out of descriptors takes no more)."""
    sockets: list[socket.socket] = []
    deadline = time.monotonic() + 90
    while len(sockets) < FLOOD and time.monotonic() < deadline:
        try:
            connection = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            continue
        sockets.append(connection)
        with contextlib.suppress(OSError):
            connection.send(b"GET /metrics HTTP/1.1\r\n")
        let_in = time.monotonic() + 1
        while unacknowledged(connection) and time.monotonic() < let_in:
            time.sleep(0.001)  # pacing of the poll of the kernel's state
    return sockets


@contextlib.asynccontextmanager
async def stdio_server(config: Config, tmp_path: Path, metrics: int) -> AsyncIterator[tuple[Client, Path]]:
    config_file = tmp_path / "config.toml"
    config_file.write_text(
        f'image = "{config.image}"\n'
        "[limits]\nmemory_mb = 256\ndefault_timeout_s = 20\nmax_run_s = 60\n"
        "[pool]\nsize = 1\nsession_spares = 1\nacquire_timeout_s = 30\n"
        "[sessions]\ndurable = false\n"
    )
    command = [sys.executable, "-m", "mcp_code_exec", "serve", "--in-process", "--config", str(config_file)]
    params = StdioServerParameters(
        command="prlimit",
        args=[f"--nofile={LIMIT}:{LIMIT}", "--", *command, "--metrics-port", str(metrics)],
        env={"MCP_CODE_EXEC_RUNTIME_DIR": os.environ["MCP_CODE_EXEC_RUNTIME_DIR"]},
    )
    async with Client(params) as client:
        yield client, config_file


async def test_a_flood_of_idle_connections_to_the_metrics_port_leaves_descriptors_for_sessions(
    config: Config, tmp_path: Path
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD + 512:
        pytest.skip(f"this process may open only {hard} descriptors; the flood needs {FLOOD + 512}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the flood's own descriptors (restored below)
    port = free_port()
    sockets: list[socket.socket] = []
    try:
        async with stdio_server(config, tmp_path, port) as (client, config_file):
            await wait_until(lambda: answers_metrics(port), 60, every_s=0.2)
            pid = server_pid(config_file)
            sockets = await anyio.to_thread.run_sync(flood, port)
            held = open_descriptors(pid)
            assert len(sockets) > LIMIT // 2  # the flood got in: more than the server could ever hold
            with anyio.fail_after(120):
                sid = (await structured_call(client, "new_session"))["session_id"]
                ran = await structured_call(client, "run_python", code="print(6 * 7)", session_id=sid)
                stateless = await structured_call(client, "run_python", code="print(7 * 8)")
            assert ran["stdout"] == "42\n" and stateless["stdout"] == "56\n", (ran, stateless)
            assert held < LIMIT // 2, f"the server held {held} of its {LIMIT} descriptors under the flood"
            for connection in sockets:
                connection.close()
            await wait_until(lambda: answers_metrics(port), 60, every_s=0.2)
    finally:
        for connection in sockets:
            connection.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
