"""Sessions outlive their server: the real server (``serve --transport streamable-http``, two tokens)
is killed, or stopped cleanly, and started again; its sessions are served again to their token
only, with their files. A session past its lifetime is removed by the next start.
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from _durable import docker, records_of, remove_sessions, snapshot_written
from _support import ServerProcess, make_test_config, wait_until
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from mcp_code_exec.runtime.base import LABEL_OWNER

pytestmark = pytest.mark.anyio
log = logging.getLogger(__name__)
TOKENS = {"alice": "alice-token-d1e7", "bob": "bob-token-44c0"}
CONFIG = """
image = "{image}"
[limits]
memory_mb = 256
session_data_mb = 64
session_max_files = 200
session_disk = "agent"
[pool]
size = 1
session_spares = 0
[sessions]
durable = true
max_lifetime_s = {lifetime}
scope = "{scope}"
[http.tokens]
alice = "{alice}"
bob = "{bob}"
"""


def config_file(directory: Path, lifetime_s: float = 3600) -> list[str]:
    path = directory / "config.toml"
    # A scope of its own: each server here listens on a new port (the default scope is the address)
    scope = f"test-restart-{secrets.token_hex(4)}"
    path.write_text(CONFIG.format(image=make_test_config().image, lifetime=lifetime_s, scope=scope, **TOKENS))
    return ["--config", str(path)]


@asynccontextmanager
async def connect(server: ServerProcess, who: str) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKENS[who]}"}, timeout=60)
    async with http, Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as client:
        yield client


async def call(server: ServerProcess, who: str, tool: str, arguments: dict[str, Any]) -> tuple[bool, str, Any]:
    """(is_error, text, structured content) of one call on a new connection as ``who``."""
    async with connect(server, who) as client:
        result = await client.call_tool(tool, arguments)
    return bool(result.is_error), str(getattr(result.content[0], "text", "")), result.structured_content


def kill(server: ServerProcess) -> None:
    """SIGKILL, as a crash or an OOM kill would: nothing of its shutdown runs."""
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()


def left_by(pid: int) -> list[str]:
    """Containers still labelled as the (dead) process ``pid``'s."""
    listed = docker("ps", "-a", "--format", f'{{{{.ID}}}} {{{{.Label "{LABEL_OWNER}"}}}}')
    prefix = f"{socket.gethostname()}:{pid}:"
    return [line.split()[0] for line in listed.splitlines() if line.split()[1:2] and line.split()[1].startswith(prefix)]


READ = "import os; print(open('/mnt/data/kept.txt').read(), sorted(set(os.listdir('/mnt/data')) - {'.mcpx'}))"


async def test_a_killed_or_stopped_server_serves_its_sessions_again_to_their_token_only(tmp_path: Path) -> None:
    args = config_file(tmp_path)
    session_id = ""
    try:
        async with ServerProcess("streamable-http", args=args) as first:
            error, said, made = await call(first, "alice", "new_session", {})
            assert not error, said
            session_id = made["session_id"]
            error, said, _ = await call(
                first, "alice", "write_file", {"session_id": session_id, "path": "kept.txt", "content": "kept"}
            )
            assert not error, said
            kill(first)
            killed_pid = first.process.pid
        assert records_of([session_id]), "the killed server's record went before the next start (another server?)"

        began = time.monotonic()
        async with ServerProcess("streamable-http", args=args) as second:
            error, said, result = await call(second, "alice", "run_python", {"code": READ, "session_id": session_id})
            log.warning(
                "a killed server's successor: %.2f s from its start to its first answer", time.monotonic() - began
            )
            assert not error and result["stdout"] == "kept ['kept.txt']\n", said
            assert any("resumed in" in note for note in result["notes"]), result
            error, said, _ = await call(second, "bob", "run_python", {"code": READ, "session_id": session_id})
            assert error and f"no such session: '{session_id}'" in said, said
            assert left_by(killed_pid) == []  # the killed server's containers: swept at the start
        # A clean stop (SIGTERM) and a start
        async with ServerProcess("streamable-http", args=args) as third:
            error, said, result = await call(third, "alice", "run_python", {"code": READ, "session_id": session_id})
            assert not error and result["stdout"] == "kept ['kept.txt']\n", said
            error, said, _ = await call(third, "bob", "list_files", {"session_id": session_id})
            assert error and f"no such session: '{session_id}'" in said, said
            error, said, _ = await call(third, "alice", "close_session", {"session_id": session_id})
            assert not error, said
        assert records_of([session_id]) == {}
    finally:
        remove_sessions([session_id])


async def test_a_session_past_its_lifetime_is_removed_when_the_next_server_starts(tmp_path: Path) -> None:
    lifetime_s = 8.0
    args = config_file(tmp_path, lifetime_s)
    session_id = ""
    try:
        async with ServerProcess("streamable-http", args=args) as first:
            error, said, made = await call(first, "alice", "new_session", {})
            assert not error, said
            session_id, made_at = made["session_id"], time.time()
            kill(first)  # before its own reaper could close it
        # A lifetime is a time: wait it out (a timer, not synchronisation)
        await anyio.sleep(max(0.0, made_at + lifetime_s + 0.5 - time.time()))
        found = records_of([session_id])
        assert found, "the killed server's record went before the next start (another server on the engine?)"
        async with ServerProcess("streamable-http", args=args) as second:
            assert records_of([session_id]) == {}
            data_volumes = set(docker("volume", "ls", "-q").split())
            assert not set(found.values()) & data_volumes, "the session's data volume outlived its lifetime"
            error, said, _ = await call(second, "alice", "list_files", {"session_id": session_id})
            assert error and f"no such session: '{session_id}'" in said, said
    finally:
        remove_sessions([session_id])


async def test_a_dataframe_survives_a_killed_server(tmp_path: Path) -> None:
    args = config_file(tmp_path)
    session_id = ""
    make = "import pandas as pd\ndf = pd.DataFrame({'x': range(1000)})"
    try:
        async with ServerProcess("streamable-http", args=args) as first:
            error, said, made = await call(first, "alice", "new_session", {})
            assert not error, said
            session_id = made["session_id"]
            error, said, _ = await call(first, "alice", "list_variables", {"session_id": session_id})
            if error and "rebuild the image" in said:
                pytest.skip("the image's agent predates snapshots (it answers Restore with 'unknown op')")
            error, said, _ = await call(first, "alice", "run_python", {"code": make, "session_id": session_id})
            assert not error, said
            # Killed once its snapshot is written (half a second idle, then the write): a server killed
            # sooner loses that last run's variables, as a container lost that soon does.
            await wait_until(lambda: snapshot_written(session_id, make_test_config().image), 60)
            kill(first)
        async with ServerProcess("streamable-http", args=args) as second:
            code = "print(df.shape, int(df.x.sum()))"
            error, said, result = await call(second, "alice", "run_python", {"code": code, "session_id": session_id})
            assert not error and result["stdout"] == "(1000, 1) 499500\n", said
            await call(second, "alice", "close_session", {"session_id": session_id})
    finally:
        remove_sessions([session_id])


async def test_a_server_killed_right_after_a_run_loses_neither_its_variables_nor_its_history_line(
    tmp_path: Path,
) -> None:
    # Killed within the half second before the idle session writes its snapshot and history: the
    # container's channel closes, and the agent writes both there (the snapshot first).
    args = config_file(tmp_path)
    session_id = ""
    try:
        async with ServerProcess("streamable-http", args=args) as first:
            error, said, made = await call(first, "alice", "new_session", {})
            assert not error, said
            session_id = made["session_id"]
            error, said, _ = await call(first, "alice", "list_variables", {"session_id": session_id})
            if error and "rebuild the image" in said:
                pytest.skip("the image's agent predates snapshots (it answers Restore with 'unknown op')")
            error, said, _ = await call(first, "alice", "run_python", {"code": "b = 2", "session_id": session_id})
            assert not error, said
            kill(first)
        async with ServerProcess("streamable-http", args=args) as second:
            code = {"code": "print(b)", "session_id": session_id}
            error, said, result = await call(second, "alice", "run_python", code)
            assert not error and result["stdout"] == "2\n", said
            where = {"session_id": session_id, "path": "history.ipynb"}
            error, said, _ = await call(second, "alice", "export_notebook", where)
            assert not error, said
            error, said, _ = await call(second, "alice", "read_file", where)
            assert not error, said
            cells = [cell for cell in json.loads(said)["cells"] if cell["cell_type"] == "code"]
            assert ["".join(cell["source"]) for cell in cells] == ["b = 2", "print(b)"]
            await call(second, "alice", "close_session", {"session_id": session_id})
    finally:
        remove_sessions([session_id])
