"""``serve`` over stdio is a front to the user's local service: sessions outlive the stdio process.

Each test has its own runtime directory (``conftest.private_local_services``), so its service is
its own, and is stopped when it ends. Clients here start a new server process per call, as
LangChain's ``MultiServerMCPClient.get_tools()`` does, or restart it, as desktop clients do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_service import live_service_pids, process_gone, service_dir
from _security import runsc_available
from _stdio_front import line_front, sdk_front, serve_command
from _support import free_port, wait_until
from fastmcp.client.transports import StdioTransport
from mcp import Client, StdioServerParameters
from pydantic_ai.mcp import MCPToolset

from mcp_code_exec.config.settings import Config

pytestmark = pytest.mark.anyio
CALL_S = 120  # one call, a service's start included (2 shared cores)


def write_config(tmp_path: Path, config: Config, extra: str = "") -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f"image = {json.dumps(config.image)}\n{extra}"
        "[limits]\nmemory_mb = 256\ndefault_timeout_s = 20\nmax_run_s = 60\n"
        "[pool]\nsize = 1\nsession_spares = 1\nacquire_timeout_s = 60\n"
        "[sessions]\ndurable = false\n"  # a stopped service leaves nothing behind (the suite's leak checks)
    )
    return path


async def call_in_a_new_process(params: StdioServerParameters, tool: str, arguments: dict[str, Any]) -> Any:
    with anyio.fail_after(CALL_S):
        async with Client(params) as client:
            return await client.call_tool(tool, arguments)


def structured(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict)
    return result.structured_content


def runtime_dir() -> Path:
    return Path(os.environ["MCP_CODE_EXEC_RUNTIME_DIR"])


async def test_a_client_that_starts_a_server_per_call_keeps_its_session(tmp_path: Path, config: Config) -> None:
    params = sdk_front(write_config(tmp_path, config))
    session_id = structured(await call_in_a_new_process(params, "new_session", {}))["session_id"]
    structured(await call_in_a_new_process(params, "run_python", {"code": "x = 41", "session_id": session_id}))
    answer = structured(await call_in_a_new_process(params, "run_python", {"code": "x + 1", "session_id": session_id}))
    assert answer["result"] == "42"
    assert len(live_service_pids(runtime_dir())) == 1  # one service served all three processes


async def test_a_killed_front_and_a_new_one_keep_the_session(tmp_path: Path, config: Config) -> None:
    config_path = write_config(tmp_path, config)
    with anyio.fail_after(CALL_S * 2):
        async with line_front(config_path) as first:
            assert "result" in await first.initialize("desktop")
            session_id = (await first.tool("new_session"))["session_id"]
            await first.tool("run_python", code="x = 41", session_id=session_id)
            first.process.send_signal(signal.SIGKILL)  # a desktop client restarting, or crashing
            await first.process.wait()
        async with line_front(config_path) as second:
            assert "result" in await second.initialize("desktop")
            answer = await second.tool("run_python", code="x + 1", session_id=session_id)
    assert answer["result"] == "42"


async def test_two_configured_identities_do_not_see_each_others_sessions(tmp_path: Path, config: Config) -> None:
    config_path = write_config(tmp_path, config)
    alice, bob = (
        sdk_front(config_path, MCP_CODE_EXEC_IDENTITY="alice"),
        sdk_front(config_path, MCP_CODE_EXEC_IDENTITY="bob"),
    )
    session_id = structured(await call_in_a_new_process(alice, "new_session", {}))["session_id"]
    refused = await call_in_a_new_process(bob, "run_python", {"code": "1", "session_id": session_id})
    assert refused.is_error and "no such session" in str(refused.content)
    files = await call_in_a_new_process(bob, "list_files", {"session_id": session_id})
    assert files.is_error and "no such session" in str(files.content)
    kept = structured(await call_in_a_new_process(alice, "run_python", {"code": "2", "session_id": session_id}))
    assert kept["result"] == "2"


async def test_a_bad_identity_name_is_refused_with_a_message(tmp_path: Path, config: Config) -> None:
    command = [sys.executable, "-m", "mcp_code_exec", "serve", "--config", str(write_config(tmp_path, config))]
    env = {**os.environ, "MCP_CODE_EXEC_IDENTITY": "../../x"}
    done = await anyio.run_process(command, env=env, check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert "is not a name" in done.stderr.decode(), done.stderr


# -- pydantic-ai's default 5 s connect, 20 starts ---------------------------------------------------------
@asynccontextmanager
async def other_core_busy() -> AsyncIterator[None]:
    """A CPU burner on the machine's other core, for the test's duration (killed after, bounded)."""
    burner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 600\nwhile time.time() < end: pass"]
    )
    try:
        yield
    finally:
        burner.kill()
        burner.wait(timeout=30)


async def pydantic_ai_connects(config_path: Path) -> bool:
    """One fresh front, with pydantic-ai's defaults (``init_timeout`` 5 s): did the handshake succeed?"""
    args = ["-m", "mcp_code_exec", "serve", "--config", str(config_path)]
    toolset: MCPToolset[Any] = MCPToolset(StdioTransport(sys.executable, args, env=dict(os.environ), keep_alive=False))
    try:
        async with toolset:
            return any(tool.name == "run_python" for tool in await toolset.list_tools())
    except Exception:
        return False


@pytest.mark.parametrize("runtime", [None, pytest.param("runsc", marks=pytest.mark.runsc)])
async def test_pydantic_ai_with_its_default_timeout_connects_20_of_20_times(
    tmp_path: Path, config: Config, runtime: str | None
) -> None:
    if runtime == "runsc" and not runsc_available():
        pytest.skip("gVisor (runsc) is not registered with the engine")
    extra = f'runtime = "{runtime}"\n' if runtime else ""
    config_path = write_config(tmp_path, config, extra)
    assert live_service_pids(runtime_dir()) == []  # the first start also starts the service
    async with other_core_busy():
        with anyio.fail_after(20 * 30):
            connected = [await pydantic_ai_connects(config_path) for _ in range(20)]
    assert connected.count(True) == 20, connected
    first_call = await call_in_a_new_process(sdk_front(config_path), "run_python", {"code": "print(6*7)"})
    assert structured(first_call)["stdout"] == "42\n"


# -- the socket is this user's alone ---------------------------------------------------------------------
def connect_as_nobody(socket_path: Path) -> str:
    """From a child that setuid()s to nobody: connect and say hello; what happened, as text."""
    probe = (
        "import os, pwd, socket, sys\n"
        "nobody = pwd.getpwnam('nobody')\n"
        "os.setgroups([]); os.setgid(nobody.pw_gid); os.setuid(nobody.pw_uid)\n"
        "conn = socket.socket(socket.AF_UNIX)\n"
        "conn.settimeout(20)\n"
        "try:\n"
        "    conn.connect(sys.argv[1])\n"
        "except OSError as exc:\n"
        "    print('connect failed:', exc.strerror); sys.exit()\n"
        "try:\n"  # the service may close before the hello is even written: that is a refusal too
        '    conn.sendall(b\'{"hello": 1, "identity": null}\\n\')\n'
        "    print('answer:', conn.recv(4096) or 'closed')\n"
        "except (ConnectionResetError, BrokenPipeError):\n"
        "    print('answer: closed')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(socket_path)], capture_output=True, text=True, timeout=60, check=False
    )
    return done.stdout + done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to become another user")
async def test_the_socket_is_private_and_another_uid_is_refused(tmp_path: Path, config: Config) -> None:
    structured(await call_in_a_new_process(sdk_front(write_config(tmp_path, config)), "run_python", {"code": "1"}))
    directory = service_dir(runtime_dir())
    [socket_path] = directory.glob("*.sock")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert "connect failed: Permission denied" in connect_as_nobody(socket_path)
    # Past the file modes (as if they were loosened): the service itself refuses the other uid.
    runtime_dir().chmod(0o711)
    directory.chmod(0o711)
    socket_path.chmod(0o666)
    assert connect_as_nobody(socket_path) == "answer: closed\n"  # no {"ok": true}: nothing served


async def test_the_local_service_raises_its_descriptor_limit_as_every_server_does(
    tmp_path: Path, config: Config
) -> None:
    """A front started under a soft limit of 1024 descriptors (a desktop client's, systemd's
    default) with a hard limit of 8192: the service it starts raises its soft limit to the hard one,
    as the HTTP and in-process servers do, for the sessions and containers it holds."""
    front = sdk_front(write_config(tmp_path, config))
    params = front.model_copy(
        update={"command": "prlimit", "args": ["--nofile=1024:8192", "--", front.command, *front.args]}
    )
    structured(await call_in_a_new_process(params, "run_python", {"code": "1"}))
    [pid] = live_service_pids(runtime_dir())
    assert soft_descriptor_limit(pid) == 8192


def soft_descriptor_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no descriptor limit for {pid}")


async def test_a_metrics_port_over_stdio_is_refused_unless_served_in_process(tmp_path: Path, config: Config) -> None:
    """The local service stdio fronts share has no metrics listener: ``--metrics-port`` over stdio is
    refused at once with a sentence saying so (it was silently ignored), and served with ``--in-process``."""
    config_path = write_config(tmp_path, config)
    port = free_port()
    command = [*serve_command(config_path), "--metrics-port", str(port)]
    with anyio.fail_after(CALL_S):
        done = await anyio.run_process(command, input=b"", check=False)
    assert done.returncode == 2 and b"--in-process" in done.stderr, (done.returncode, done.stderr[-500:])
    assert live_service_pids(runtime_dir()) == []  # refused before any service starts
    params = StdioServerParameters(command=command[0], args=[*command[1:], "--in-process"], env=dict(os.environ))
    with anyio.fail_after(CALL_S):
        async with Client(params) as client:
            await client.call_tool("run_python", {"code": "1"})
            served = await anyio.to_thread.run_sync(metrics_text, port)
    assert "mcpx_" in served


def metrics_text(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        return str(answer.read().decode())


# -- lifetime --------------------------------------------------------------------------------------------
async def test_the_service_exits_when_idle_and_removes_its_socket(tmp_path: Path, config: Config) -> None:
    # Not durable: a service that took over the sessions earlier tests' services left would hold work.
    config_path = write_config(tmp_path, config, "[stdio]\nidle_exit_s = 1\n")
    structured(await call_in_a_new_process(sdk_front(config_path), "run_python", {"code": "1"}))
    [pid] = live_service_pids(runtime_dir())
    await wait_until(lambda: process_gone(pid), 90)
    assert list(service_dir(runtime_dir()).glob("*.sock")) == []


def nobody_answers(socket_path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(socket_path))
        except ConnectionRefusedError:
            return True
    return False


async def test_a_killed_service_leaves_a_socket_that_the_next_front_replaces(tmp_path: Path, config: Config) -> None:
    params = sdk_front(write_config(tmp_path, config))
    structured(await call_in_a_new_process(params, "run_python", {"code": "1"}))
    [pid] = live_service_pids(runtime_dir())
    [stale] = service_dir(runtime_dir()).glob("*.sock")
    os.kill(pid, signal.SIGKILL)
    # (Its main thread is a zombie before its other threads, which share the listening socket, are gone.)
    await wait_until(lambda: nobody_answers(stale), 30)
    assert stale.exists()  # left behind
    answer = structured(await call_in_a_new_process(params, "run_python", {"code": "6*7"}))
    assert answer["result"] == "42"
    assert live_service_pids(runtime_dir()) not in ([], [pid])
