"""Plumbing of the real-engine tier: test configuration, waiting on the engine, leak checks, server
subprocesses. It asks the engine through the ``docker`` CLI (the package's Docker SDK use stays in
``mcp_code_exec.runtime``)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio

from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.runtime.base import LABEL_INSTANCE, LABEL_OWNER

T = TypeVar("T")
HERE = str(Path(__file__).resolve().parent)  # so a server script run in a child can import this module


def make_test_config(**overrides: Any) -> Config:
    """Small limits so the suite is quick and two cores suffice. ``MCP_CODE_EXEC_TEST_IMAGE`` names
    another image tag, so that two checkouts can run the suite on one engine side by side."""
    base: dict[str, Any] = {
        "image": os.environ.get("MCP_CODE_EXEC_TEST_IMAGE", "mcp-code-exec:latest"),
        "limits": {"memory_mb": 256, "default_timeout_s": 20, "max_run_s": 60},
        "pool": {"size": 2, "session_spares": 1, "acquire_timeout_s": 30},
        # Not durable: a test's sessions end with its service, so the leak checks cover them too
        # (the tests of durable sessions turn it on, and close what they make).
        "sessions": {"max_sessions": 12, "durable": False},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return load_config(environ={}, overrides=base)


async def wait_until(predicate: Callable[[], Any], timeout_s: float, *, every_s: float = 0.1) -> None:
    """Poll external state (the engine) until ``predicate()`` is truthy; TimeoutError past the bound."""
    with anyio.fail_after(timeout_s):
        while not await anyio.to_thread.run_sync(predicate):  # noqa: ASYNC110 - polls state outside this process
            await anyio.sleep(every_s)  # pacing of the poll; the predicate is the synchronisation


def ensure_image(config: Config) -> None:
    """Build the sandbox image when it is missing or stale (the test command builds what it needs)."""
    from mcp_code_exec.commands.image import build
    from mcp_code_exec.sandbox.image import image_is_current

    if not in_fresh_thread(anyio.run, image_is_current, config.image, config.docker_host):
        in_fresh_thread(anyio.run, lambda: build(config.image, docker_host=config.docker_host))


def _label(owner: str | None, instance: str | None) -> str:
    if instance:
        return f"{LABEL_INSTANCE}={instance}"
    return f"{LABEL_OWNER}={owner}" if owner else LABEL_OWNER


def project_containers(owner: str | None = None, *, instance: str | None = None, host: str | None = None) -> list[str]:
    """Ids of containers carrying this project's label: of one owner (a process), or one service instance.

    A process may run several services (the test suite does); ``instance`` tells them apart.
    ``host``: another engine than the default one (``docker -H``).
    """
    return _listed(_label(owner, instance), existing=True, host=host)


def ghost_containers() -> list[str]:
    """Ids of this project's containers that the engine lists but no longer has (see ``_exists``):
    not a leak, but a user would see them in ``docker ps -a`` until dockerd restarts."""
    return _listed(LABEL_OWNER, existing=False)


def _docker(*args: str, host: str | None = None) -> list[str]:
    import subprocess

    command = ["docker", *(["-H", host] if host else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.split() if done.returncode == 0 else []


def _listed(label: str, *, existing: bool, host: str | None = None) -> list[str]:
    listed = _docker("ps", "-a", "-q", "--no-trunc", "--filter", f"label={label}", host=host)
    return [container_id for container_id in listed if _exists(container_id, host) == existing]


def _exists(container_id: str, host: str | None = None) -> bool:
    """False for a container removed since the listing, and for a listing's ghost: a dockerd killed
    while it auto-removed a container lists it as "Dead" until it restarts, while inspecting or
    removing it says "No such container" (nothing of it is left)."""
    return bool(_docker("inspect", "--type", "container", "--format", "{{.Id}}", container_id, host=host))


def project_volumes(owner: str | None = None, *, instance: str | None = None, host: str | None = None) -> list[str]:
    return _docker("volume", "ls", "-q", "--filter", f"label={_label(owner, instance)}", host=host)


def session_records() -> set[str]:
    """The durable sessions' record volumes on the engine (whoever made them)."""
    from mcp_code_exec.runtime.base import LABEL_KIND
    from mcp_code_exec.sandbox.ownership import RECORD_KIND

    return set(_docker("volume", "ls", "-q", "--filter", f"label={LABEL_KIND}={RECORD_KIND}"))


def existing_volumes(names: Iterable[str], host: str | None = None) -> list[str]:
    """Which of these volumes the engine still holds, with or without labels."""
    wanted = set(names)
    return sorted(name for name in _docker("volume", "ls", "-q", host=host) if name in wanted)


@asynccontextmanager
async def crashing_server(script: str, timeout_s: float = 120.0) -> AsyncIterator[str]:
    """Run ``script`` in a child Python: a server that prints its owner token once its sandboxes
    are up. Yields that token; on leaving the block the child is SIGKILLed, as in a crash."""
    import os
    import signal
    import subprocess
    import sys

    from anyio.streams.buffered import BufferedByteReceiveStream

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}
    process = await anyio.open_process([sys.executable, "-c", script], stderr=subprocess.DEVNULL, env=env)
    try:
        assert process.stdout is not None
        with anyio.fail_after(timeout_s):
            line = await BufferedByteReceiveStream(process.stdout).receive_until(b"\n", 4096)
        owner = line.decode().strip()
        assert owner, "the server subprocess did not get its sandboxes going"
        yield owner
    finally:
        with anyio.CancelScope(shield=True):
            process.send_signal(signal.SIGKILL)
            await process.wait()
            await process.aclose()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ServerProcess:
    """The real server as a subprocess on an HTTP transport; waits for /healthz, stops it after.

    ``async with ServerProcess("streamable-http", env={"MCP_CODE_EXEC_TOKEN": "t"}) as server:``
    then ``server.url`` is the base URL.
    """

    def __init__(
        self, transport: str, *, env: dict[str, str] | None = None, args: list[str] | None = None, port: int = 0
    ) -> None:
        self.transport = transport
        self.port = port or free_port()  # a given port: a server started again where clients know it
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env or {}
        self.args = args or []
        self.process: Any = None
        self.config_dir: Any = None

    async def __aenter__(self) -> ServerProcess:
        import os
        import subprocess
        import sys

        import httpx2

        command = [
            sys.executable,
            "-m",
            "mcp_code_exec",
            "serve",
            "--transport",
            self.transport,
            "--port",
            str(self.port),
        ]
        import tempfile

        env = {**os.environ, **self.env}
        if "--config" not in self.args and "MCP_CODE_EXEC_CONFIG" not in self.env:  # the test image, at least
            self.config_dir = tempfile.TemporaryDirectory()
            path = Path(self.config_dir.name) / "config.toml"
            path.write_text(f"image = {json.dumps(make_test_config().image)}\n[sessions]\ndurable = false\n")
            env["MCP_CODE_EXEC_CONFIG"] = str(path)
        # A file, not a pipe: nobody reads the log while the server runs, and a full pipe would block it.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server; closed in __aexit__
        self.process = subprocess.Popen([*command, *self.args], env=env, stdin=subprocess.DEVNULL, stderr=self.log)

        def healthy() -> bool:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read().decode(errors='replace')[-2000:]}")
            try:
                return httpx2.get(f"{self.url}/healthz", timeout=1).status_code == 200
            except httpx2.HTTPError:
                return False

        try:
            await wait_until(healthy, 60, every_s=0.2)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        import signal

        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                with anyio.fail_after(60):
                    await anyio.to_thread.run_sync(self.process.wait)
            except TimeoutError:
                self.process.kill()
                self.process.wait()
        if self.process is not None:
            self.log.close()
        if self.config_dir is not None:
            self.config_dir.cleanup()


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; raises ValueError for anything else."""
    import struct

    if not data.startswith(b"\x89PNG\r\n\x1a\n") or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def in_fresh_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on a new thread and return its result (or raise its exception).

    For code that calls ``anyio.run`` (the CLI's ``main``) from a test while the test runner keeps
    an event loop going in the main thread for session-scoped async fixtures.
    """
    import threading

    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="in-fresh-thread")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]


@asynccontextmanager
async def client_with_token(server: ServerProcess, token: str) -> AsyncIterator[Any]:
    """An ``mcp`` client of a server process over streamable HTTP, with a bearer token."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60)
    async with http, Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as client:
        yield client


async def structured_call(client: Any, tool: str, **arguments: Any) -> dict[str, Any]:
    """A tool's structured result; the call must succeed."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result
    return dict(result.structured_content or {})
