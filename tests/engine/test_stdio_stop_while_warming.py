"""The local service stopped (SIGTERM) while its pools warm leaves nothing of its own on the engine.

A stdio client's service is often stopped seconds after it started (a client that tried a tool and
quit): a spare session container may then be half made (its volume there, its container not yet)
or warm already, its volume in use. Each test stops it at one moment of that, seen from outside (the
engine's listing, the service's log), and looks for what is left:
the containers and volumes labelled with the service process's owner token (other tests' services,
in this process or another, have tokens of their own; the engine-wide store of sized volumes'
disks, ``mcp-code-exec-disks``, has none).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from _support import wait_until

from mcp_code_exec.config.settings import Config
from mcp_code_exec.runtime.base import LABEL_KIND, LABEL_OWNER

pytestmark = pytest.mark.anyio
START_S = 120  # a moment of the warming to come (2 shared cores, other tests' engines beside)
STOP_S = 90  # the stop, its last sweep included


def owned(pid: int) -> tuple[list[str], list[str]]:
    """(containers, volumes) labelled as made by the process ``pid``: "kind name" each."""
    prefix = f"{socket.gethostname()}:{pid}:"
    found = []
    for listing in (["ps", "-a", "--format"], ["volume", "ls", "--format"]):
        name = "{{.ID}}" if listing[0] == "ps" else "{{.Name}}"
        form = f'{name} {{{{.Label "{LABEL_OWNER}"}}}} {{{{.Label "{LABEL_KIND}"}}}}'
        done = subprocess.run(
            ["docker", *listing, form, "--filter", f"label={LABEL_OWNER}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        rows = [line.split(" ") for line in done.stdout.splitlines()]
        found.append([f"{row[2]} {row[0]}" for row in rows if len(row) == 3 and row[1].startswith(prefix)])
    return found[0], found[1]


def _first_container(pid: int) -> bool:
    return bool(owned(pid)[0])


def _first_volume(pid: int) -> bool:
    return bool(owned(pid)[1])


def _spare_container(pid: int) -> bool:
    return any(entry.startswith("session ") for entry in owned(pid)[0])


def _spares_warm(log: Path) -> bool:
    return "pool sessions: 2 warm containers ready" in log.read_text(errors="replace")


# Each moment, seen from outside: the engine's listing, or the service's log.
MOMENTS: dict[str, Callable[[int, Path], bool]] = {
    "its first container is made": lambda pid, _: _first_container(pid),
    "the spare's volume is made": lambda pid, _: _first_volume(pid),
    "the spare's container is made": lambda pid, _: _spare_container(pid),
    "the spares are warm": lambda _, log: _spares_warm(log),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
async def test_a_service_stopped_while_warming_leaves_no_container_or_volume(
    tmp_path: Path, config: Config, moment: str
) -> None:
    config_path = tmp_path / "config.toml"
    config_path.write_text(
        f"image = {json.dumps(config.image)}\n"
        "[limits]\nmemory_mb = 256\n"
        "[pool]\nsize = 1\nsession_spares = 2\n"
        "[sessions]\ndurable = false\n"
    )
    command = [sys.executable, "-I", "-m", "mcp_code_exec", "daemon", "--config", str(config_path)]
    log = tmp_path / "service.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        await wait_until(lambda: MOMENTS[moment](process.pid, log), START_S, every_s=0.01)
        process.send_signal(signal.SIGTERM)
        with anyio.fail_after(STOP_S):
            code = await anyio.to_thread.run_sync(process.wait)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 0, log.read_text()[-4000:]
    assert owned(process.pid) == ([], []), log.read_text()[-4000:]
