"""Code mode's upstreams as the host's own processes (issue 32, classes 1 and 6), on the real server
over stdio with the real engine.

- Where an upstream starts: configured as ``python -m NAME`` without ``cwd``, it starts in a private
  empty directory, never the server's working directory, where a planted ``NAME.py`` (what a
  sandbox wrote there through a mount) would run on the host instead; not at its first start, not
  after it is restarted.
- What is read of an answer: ``git_show`` of a 24 MB file through the real ``mcp-server-git``,
  twelve times. Each call fails with the cap named (``code_mode.max_answer_mb``), the server's
  memory stays about where it was (the answer is dropped as it arrives, never held whole), and the
  next call works on the same upstream.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from _support import free_port, structured_call, wait_until
from mcp import Client, StdioServerParameters

from mcp_code_exec.config.code_mode import CodeModeSettings, UpstreamServer
from mcp_code_exec.config.settings import Config
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
FIXTURES = Path(__file__).parent / "fixtures"
BIG_MB = 24
PLANTED = (
    "import pathlib\n"
    "pathlib.Path(__file__).with_name('PLANTED-RAN').write_text('this ran on the host')\n"
    "raise SystemExit(1)\n"
)


def write_config(path: Path, config: Config, servers: str) -> Path:
    path.write_text(
        f'image = "{config.image}"\n'
        "[limits]\nmemory_mb = 256\ndefault_timeout_s = 20\nmax_run_s = 300\n"
        "[pool]\nsize = 1\nsession_spares = 0\nacquire_timeout_s = 30\n"
        "[sessions]\ndurable = false\n"
        f"[code_mode]\ncall_timeout_s = 120\n{servers}"
    )
    return path


@contextlib.asynccontextmanager
async def stdio_server(config_file: Path, cwd: Path) -> AsyncIterator[tuple[Client, int]]:
    """The real server over stdio in ``cwd``, and its pid."""
    command = [sys.executable, "-m", "mcp_code_exec", "serve", "--in-process", "--config", str(config_file)]
    environment = {"MCP_CODE_EXEC_RUNTIME_DIR": os.environ["MCP_CODE_EXEC_RUNTIME_DIR"]}
    params = StdioServerParameters(command=command[0], args=command[1:], env=environment, cwd=cwd)
    async with Client(params) as client:
        yield client, process_naming(str(config_file))


def process_naming(text: str, parent: int | None = None) -> int:
    """The process whose command line holds ``text`` (a child of ``parent``, if given)."""
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            named = entry.isdigit() and text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes()
            if named and (parent is None or f"PPid:\t{parent}\n" in Path(f"/proc/{entry}/status").read_text()):
                return int(entry)
    raise AssertionError(f"no process runs {text!r}")


def memory_kib(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the most it ever was) of a process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


async def run(client: Client, code: str) -> dict[str, Any]:
    with anyio.fail_after(290):
        result = await structured_call(client, "run_python", code=code, timeout=280)
        while result["status"] == "running":  # past the call's wait: the run goes on
            result = await structured_call(client, "get_run", run_id=result["run_id"], wait=60)
    assert result["status"] == "ok", result
    return result


WHERE = """
import json, mcp_tools
try:
    print(json.dumps(mcp_tools.where.where()))
except mcp_tools.ToolUnavailable:
    print("UNAVAILABLE")
"""


async def where(client: Client) -> dict[str, Any] | None:
    """What the upstream says of its working directory; None while it restarts."""
    said = (await run(client, WHERE))["stdout"]
    return None if said.startswith("UNAVAILABLE") else dict(json.loads(said))


async def test_an_upstream_started_as_python_m_never_imports_a_module_planted_in_the_servers_directory(
    config: Config, tmp_path: Path
) -> None:
    workspace = tmp_path / "workspace"  # the server's working directory
    workspace.mkdir()
    (workspace / "where_server.py").write_text(PLANTED)  # as a sandbox would have written it
    servers = (
        f'[[code_mode.servers]]\nname = "where"\ncommand = "{sys.executable}"\nargs = ["-m", "where_server"]\n'
        f'env = {{PYTHONPATH = "{FIXTURES}"}}\n'
    )
    config_file = write_config(tmp_path / "config.toml", config, servers)
    async with stdio_server(config_file, workspace) as (client, server):
        first = await where(client)
        os.kill(process_naming("where_server", parent=server), signal.SIGKILL)  # it starts again when called
        second = None
        with anyio.fail_after(60):
            for _ in range(100):  # while the upstream restarts (its backoff)
                second = await where(client)
                if second is not None:
                    break
                await anyio.sleep(0.5)  # pacing of the retry; the answer is the synchronisation
    assert not (workspace / "PLANTED-RAN").exists()
    for seen in (first, second):
        assert seen is not None and Path(seen["cwd"]) != workspace and seen["entries"] == [], seen
        assert not await anyio.Path(seen["cwd"]).exists()  # removed with the server


def big_repository(path: Path) -> Path:
    path.mkdir()
    for command in (["init", "-q"], ["config", "user.email", "t@example.com"], ["config", "user.name", "T"]):
        subprocess.run(["git", *command], cwd=path, check=True)
    line = "0123456789" * 10 + "\n"
    (path / "big.txt").write_text(line * (BIG_MB * 1024 * 1024 // len(line)))
    subprocess.run(["git", "add", "big.txt"], cwd=path, check=True)
    subprocess.run(["git", "commit", "-qm", "big"], cwd=path, check=True)
    return path


SHOW_TWELVE_TIMES = """
import mcp_tools
for _ in range(12):
    try:
        shown = mcp_tools.git.git_show(repo_path=REPO, revision="HEAD")
        print("SHOWN", len(shown))
    except mcp_tools.ToolError as exc:
        print(type(exc).__name__, str(exc)[:300])
print("LOG", "big" in mcp_tools.git.git_log(repo_path=REPO, max_count=1))
"""


async def test_an_upstream_answer_past_the_cap_fails_its_call_and_never_fills_the_servers_memory(
    config: Config, tmp_path: Path
) -> None:
    repository = big_repository(tmp_path / "repo")
    servers = (
        f'[[code_mode.servers]]\nname = "git"\ncommand = "{sys.executable}"\n'
        f'args = ["-m", "mcp_server_git", "--repository", "{repository}"]\nallow = ["git_show", "git_log"]\n'
    )
    config_file = write_config(tmp_path / "config.toml", config, servers)
    async with stdio_server(config_file, tmp_path) as (client, server):
        warm = await run(
            client, SHOW_TWELVE_TIMES.replace("range(12)", "range(1)").replace("REPO", repr(str(repository)))
        )
        assert "LOG True" in warm["stdout"], warm
        before = memory_kib(server, "VmRSS")
        shown = await run(client, SHOW_TWELVE_TIMES.replace("REPO", repr(str(repository))))
        peak = memory_kib(server, "VmHWM")
    lines = shown["stdout"].splitlines()
    assert len(lines) == 13 and lines[-1] == "LOG True", shown
    assert all(line.startswith("ToolBudgetExceeded") and "max_answer_mb" in line for line in lines[:12]), lines
    assert peak - before < 64 * 1024, f"the server grew from {before} KiB to a peak of {peak} KiB"


@contextlib.contextmanager
def tiny_over_http(mode: str) -> Iterator[str]:
    """The tiny server over streamable HTTP on loopback (``http``: event streams, ``http-json``:
    JSON bodies); its URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(FIXTURES / "tiny_server.py"), mode, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=10)


BIG_THEN_SMALL = """
import mcp_tools
for name in ("stdio", "events", "json"):
    server = getattr(mcp_tools, name)
    try:
        server.big(megabytes=6)
        print(name, "READ")
    except mcp_tools.ToolBudgetExceeded as exc:
        print(name, "CAPPED", "max_answer_mb" in str(exc))
    print(name, server.slow(seconds=0)["result"])
"""


async def test_an_answer_past_the_cap_fails_its_call_over_stdio_event_streams_and_json_bodies(config: Config) -> None:
    """6 MiB against the 4 MiB cap, from the SDK's MCPServer on each transport: the call fails with
    the cap named, and the next call to the same upstream works."""
    with tiny_over_http("http") as events, tiny_over_http("http-json") as json_bodies:
        for url in (events, json_bodies):
            await wait_until(partial(listening, url), 30)
        servers = [
            UpstreamServer(name="stdio", command=sys.executable, args=[str(FIXTURES / "tiny_server.py")]),
            UpstreamServer(name="events", url=events),
            UpstreamServer(name="json", url=json_bodies),
        ]
        settings = CodeModeSettings(servers=servers, call_timeout_s=30)
        async with SandboxService.start(config.model_copy(update={"code_mode": settings})) as service:
            with anyio.fail_after(120):
                result = await service.run("local", BIG_THEN_SMALL, timeout=100)
    assert result.status == "ok", (result.error, result.stderr)
    assert result.stdout.splitlines() == [
        f"{name} {said}" for name in ("stdio", "events", "json") for said in ("CAPPED True", "slept")
    ], result.stdout


def listening(url: str) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", int(url.split(":")[2].split("/")[0]))) == 0
