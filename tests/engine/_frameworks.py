"""Shared by the agent framework tests (``test_frameworks_*.py``): the scripted models' scripts, what a
model was handed, and the real server as a subprocess that a framework starts over stdio.

No LLM, no network: each framework drives the real server with a scripted model, and every tool result
reaches that model through the framework's own conversion, so the tests show what a real model would
be given. The scripts only read tool results as text, the way a model does.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import docker

from mcp_code_exec.config.settings import Config
from mcp_code_exec.runtime.base import LABEL_OWNER

RUN_S = 120  # one agent run (the machine has 2 cores, shared with other test runs)
LONG_RUN_S = 200
PNG = b"\x89PNG\r\n\x1a\n"
PLOT = "import matplotlib.pyplot as plt; plt.plot([1,2,3]); plt.show()"
# default_timeout_s is 20 s: the sleeper asks for more, within max_run_s.
LONG = "import time; time.sleep(90); print('done')"
MAX_POLLS = 40  # get_run calls the long-run model makes at most (each waits up to wait_s = 5 s)

Call = tuple[str, dict[str, Any]]
Script = Callable[[list[str]], Call | None]  # tool results seen so far (as text) -> next call, or None: "done"


# -- what the scripted models do ------------------------------------------------------------------
def field_of(text: str, name: str) -> str:
    """A field of a tool result as a model reads it: ``"name": "value"`` in JSON, ``name: value`` or
    ``name='value'`` in the server's text."""
    found = re.search(rf"""\b{name}["']?\s*[:=]\s*["']?([\w.-]+)""", text)
    assert found is not None, f"no {name} in the tool result the model saw: {text[:500]!r}"
    return found.group(1)


def plot_script(results: list[str]) -> Call | None:
    return ("run_python", {"code": PLOT}) if not results else None


def session_script(results: list[str]) -> Call | None:
    if not results:
        return ("new_session", {})
    session_id = field_of(results[0], "session_id")  # read back from new_session's answer
    steps: list[Call] = [
        ("run_python", {"code": "x = 41", "session_id": session_id}),
        ("run_python", {"code": "x + 1", "session_id": session_id}),
        ("close_session", {"session_id": session_id}),
    ]
    done = len(results) - 1
    return steps[done] if done < len(steps) else None


def errors_script(results: list[str]) -> Call | None:
    codes = ["1/0", "1/0", "print('recovered')"]
    return ("run_python", {"code": codes[len(results)]}) if len(results) < len(codes) else None


def long_run_script(results: list[str]) -> Call | None:
    if not results:
        return ("run_python", {"code": LONG, "wait": 5, "timeout": 150})
    if field_of(results[-1], "status") == "running" and len(results) <= MAX_POLLS:
        return ("get_run", {"run_id": field_of(results[0], "run_id")})
    return None


@dataclass
class Seen:
    """One tool result as the framework handed it to the model."""

    text: str
    images: list[bytes]
    raw: Any


def data_url(url: str) -> bytes:
    assert url.startswith("data:") and ";base64," in url, url[:100]
    return base64.b64decode(url.split(";base64,", 1)[1])


# -- the server subprocess and what it owns ---------------------------------------------------------
SERVER_CONFIG = """\
image = {image}
log_level = "warning"

[limits]
memory_mb = 256
default_timeout_s = 20
max_run_s = 200
wait_s = 5

[pool]
size = 2

[sessions]
max_sessions = 8
durable = false  # its sessions end with it: nothing is left on the engine
"""


def owned_by(pid: int) -> tuple[list[str], list[str]]:
    """This project's containers and volumes whose owner label (host:pid:start) names this process."""
    host = socket.gethostname()

    def ours(labels: dict[str, str] | None) -> bool:
        parts = (labels or {}).get(LABEL_OWNER, "").rsplit(":", 2)
        return len(parts) == 3 and parts[0] == host and parts[1] == str(pid)

    client = docker.from_env()
    try:
        containers = [
            c["Id"] for c in client.api.containers(all=True, filters={"label": LABEL_OWNER}) if ours(c["Labels"])
        ]
        listed = client.api.volumes(filters={"label": LABEL_OWNER}).get("Volumes") or []
        return containers, [v["Name"] for v in listed if ours(v.get("Labels"))]
    finally:
        client.close()


@dataclass
class ServerUnderTest:
    """``python -m mcp_code_exec serve --in-process --config <file>``, started by a framework's stdio
    client: the server is the process the framework starts, so the tests can see it end."""

    config_path: Path
    log_path: Path
    pid: int | None = None

    @property
    def command(self) -> str:
        return sys.executable

    @property
    def args(self) -> list[str]:
        return ["-m", "mcp_code_exec", "serve", "--in-process", "--config", str(self.config_path)]

    def pids(self) -> list[int]:
        """Processes running this server (its config file is unique to the test)."""
        wanted = str(self.config_path).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    argv = (entry / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if wanted in argv and b"mcp_code_exec" in argv:
                    found.append(int(entry.name))
        return found

    async def record_running(self) -> None:
        """While the framework's connection is open: the one server process and its sandboxes."""
        pids = await anyio.to_thread.run_sync(self.pids)
        assert len(pids) == 1, pids
        self.pid = pids[0]
        containers, _ = await anyio.to_thread.run_sync(owned_by, self.pid)
        assert containers, "the server's warm containers carry its owner label (else the check after is void)"

    async def assert_gone(self) -> None:
        """After the framework's context manager closed stdio: the process ended and left nothing behind."""
        assert self.pid is not None
        assert await anyio.to_thread.run_sync(self.pids) == [], "the server outlived the framework's connection"
        left = await anyio.to_thread.run_sync(owned_by, self.pid)
        assert left == ([], []), f"left behind: {left}; server log: {self.log_tail()}"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else "(none)"


def server_under_test(config: Config, tmp_path: Path) -> ServerUnderTest:
    """The server's config file (the test image, small limits) and its log, in ``tmp_path``."""
    path = tmp_path / "config.toml"
    path.write_text(SERVER_CONFIG.format(image=json.dumps(config.image)))
    return ServerUnderTest(config_path=path, log_path=tmp_path / "server.log")
