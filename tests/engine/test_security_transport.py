"""The HTTP transport against hostile requests (docs/security.md#transport), on the real server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import anyio
import httpx2
import pytest
from _support import ServerProcess, free_port, project_containers, project_volumes, wait_until

from mcp_code_exec.sandbox.ownership import owner_token
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
TOKEN = "test-token-" + os.urandom(8).hex()
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
}
ACCEPT = "application/json, text/event-stream"


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[ServerProcess]:
    async with ServerProcess("streamable-http", env={"MCP_CODE_EXEC_TOKEN": TOKEN}) as running:
        yield running


def headers(**extra: str) -> dict[str, str]:
    return {"Accept": ACCEPT, "Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}", **extra}


def post(server: ServerProcess, *, json_body: object = INITIALIZE, **kwargs: object) -> httpx2.Response:
    return httpx2.post(f"{server.url}/mcp", json=json_body, timeout=30, **kwargs)  # type: ignore[arg-type]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


# -- 37. Host, Origin, bearer token ----------------------------------------------------------------------
async def test_a_correct_request_is_accepted(server: ServerProcess) -> None:
    response = await anyio.to_thread.run_sync(lambda: post(server, headers=headers()))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "auth",
    [None, "Bearer wrong", f"Bearer {TOKEN}x", f"Basic {TOKEN}", "Bearer", TOKEN, f"bearer {TOKEN[:-1]}"],
    ids=["missing", "wrong", "longer", "basic", "empty", "no-scheme", "prefix"],
)
async def test_a_missing_or_wrong_bearer_token_gets_401(server: ServerProcess, auth: str | None) -> None:
    sent = headers()
    if auth is None:
        del sent["Authorization"]
    else:
        sent["Authorization"] = auth
    response = await anyio.to_thread.run_sync(lambda: post(server, headers=sent))
    assert response.status_code == 401, response.text
    assert TOKEN not in response.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.1.evil.example", "localhost.evil:1"])
async def test_a_foreign_host_header_gets_421(server: ServerProcess, host: str) -> None:
    response = await anyio.to_thread.run_sync(lambda: post(server, headers=headers(Host=host)))
    assert response.status_code == 421, response.text


@pytest.mark.parametrize(
    "origin", ["http://evil.example", "https://127.0.0.1.evil.example", "null", "http://localhost.evil:80"]
)
async def test_a_foreign_origin_gets_403(server: ServerProcess, origin: str) -> None:
    response = await anyio.to_thread.run_sync(lambda: post(server, headers=headers(Origin=origin)))
    assert response.status_code == 403, response.text


async def test_healthz_tells_nothing_secret(server: ServerProcess) -> None:
    response = await anyio.to_thread.run_sync(lambda: httpx2.get(f"{server.url}/healthz", timeout=10))
    assert response.status_code == 200
    assert TOKEN not in response.text and "session" in response.text


# -- 38. loopback by default; elsewhere only with a token ---------------------------------------------------
def listening_addresses(port: int) -> list[str]:
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                lines = handle.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.append(address)
    return found


async def test_the_default_listener_is_loopback_only(server: ServerProcess) -> None:
    assert listening_addresses(server.port) == ["0100007F"]  # 127.0.0.1, nothing else


def env_without_token() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("MCP_CODE_EXEC_TOKEN", "MCP_CODE_EXEC_CONFIG")}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
async def test_binding_beyond_loopback_without_a_token_is_refused_at_start(host: str) -> None:
    command = [
        sys.executable,
        "-m",
        "mcp_code_exec",
        "serve",
        "--transport",
        "streamable-http",
        "--host",
        host,
        "--port",
        str(free_port()),
    ]
    with anyio.fail_after(60):
        done = await anyio.to_thread.run_sync(
            lambda: subprocess.run(
                command, env=env_without_token(), capture_output=True, text=True, timeout=55, check=False
            )
        )
    assert done.returncode != 0
    assert "token" in done.stderr and "MCP_CODE_EXEC_TOKEN" in done.stderr, done.stderr


# -- 39. huge request bodies ----------------------------------------------------------------------------------
def raw_request(port: int, head: bytes, first_chunk: bytes) -> bytes:
    """Send headers and only the start of the body; the answer must come without the rest."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(head + first_chunk)
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = conn.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


async def test_a_huge_declared_body_is_rejected_before_it_is_read(server: ServerProcess) -> None:
    declared = 1 << 30  # 1 GiB announced, 1 MiB sent: a buffering server would wait for the rest
    head = (
        f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nAccept: {ACCEPT}\r\nContent-Length: {declared}\r\n\r\n"
    ).encode()
    with anyio.fail_after(30):
        answer = await anyio.to_thread.run_sync(lambda: raw_request(server.port, head, b"{" + b" " * (1 << 20)))
    assert answer.split(b"\r\n", 1)[0].split()[1] == b"413", answer[:200]


async def test_a_huge_streamed_body_is_cut_off_without_growing_the_server(server: ServerProcess) -> None:
    before = rss_kib(server.process.pid)

    def body() -> Iterator[bytes]:
        yield b'{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"pad": "'
        for _ in range(256):  # 256 MiB, chunked: no Content-Length to judge by
            yield b"x" * (1 << 20)
        yield b'"}}'

    def send() -> int:
        try:
            return httpx2.post(f"{server.url}/mcp", content=body(), headers=headers(), timeout=60).status_code
        except httpx2.HTTPError:
            return -1  # the server hung up on us mid-body: also a rejection

    with anyio.fail_after(90):
        status = await anyio.to_thread.run_sync(send)
    assert status in (413, -1), status
    assert rss_kib(server.process.pid) - before < 64 * 1024  # far less than the 256 MiB sent
    response = await anyio.to_thread.run_sync(lambda: post(server, headers=headers()))
    assert response.status_code == 200  # and it still answers


# -- after the adversarial suite -----------------------------------------------------------------------------
async def test_after_the_hostile_suite_nothing_of_this_process_is_left_but_the_live_pools(
    service: SandboxService,
) -> None:
    """Every container and volume of this process is one the running service's pools account for."""
    owner = owner_token()

    def accounted() -> bool:
        containers = project_containers(owner)
        volumes = project_volumes(owner)
        pools = service.stateless_pool.owned + service.session_spares.owned
        return len(service.sessions) == 0 and len(containers) <= pools and len(volumes) <= service.session_spares.owned

    await wait_until(accounted, 60)
