"""A new stdio front is answered (the handshake, the tools' list) before the local service has
started its sandboxes; and its handshake, once a service of its build and configuration has
answered that client, before any service runs at all.

The engine is reached through a gate the test holds (a unix socket that accepts and forwards nothing
until opened): while it is shut, the service cannot have connected to the engine, let alone warmed a
container; the handshake must still complete. Each test has its own runtime directory
(``conftest.private_local_services``), so the service is its own and is stopped when it ends.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from _local_service import live_service_pids, service_dir, stop_services
from _stdio_front import LineFront, line_front, sdk_front
from _support import wait_until
from mcp import Client
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from mcp_code_exec.commands.stdio.local_service import place_for
from mcp_code_exec.config.settings import Config

pytestmark = pytest.mark.anyio
CALL_S = 120
ENGINE_SOCKET = "/var/run/docker.sock"


class EngineGate:
    """A unix socket in front of the engine: connections are held, unanswered, until ``open()``
    (then forwarded to the engine) or ``refuse()`` (then closed: as if no engine answered).

    asyncio's streams, not anyio's: an anyio UNIX socket stream whose ``receive`` is cancelled as
    bytes arrive (the gate's end, while a container's attach stream still flows) has its reader's
    callback complete a cancelled future, and the loop reports ``InvalidStateError`` to the test.
    Transports take the bytes in without such a future; the gate ends its connections by aborting
    them, and each relay then ends on its own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.opened = anyio.Event()
        self.refusing = False
        self.writers: set[asyncio.StreamWriter] = set()
        self.relays: set[asyncio.Task[Any]] = set()
        self.closing = False

    def open(self) -> None:
        self.opened.set()

    def refuse(self) -> None:
        self.refusing = True
        self.opened.set()

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        server = await asyncio.start_unix_server(self._forward, path=str(self.path))
        task_status.started()
        try:
            async with server:
                await anyio.sleep_forever()
        finally:
            self.closing = True
            for writer in list(self.writers):
                writer.transport.abort()
            with anyio.CancelScope(shield=True), anyio.fail_after(10):
                await asyncio.gather(*self.relays, return_exceptions=True)

    async def _forward(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.relays.add(task)
        ends = [to_client]
        self.writers.add(to_client)
        try:
            await self.opened.wait()
            if self.refusing:
                return
            engine, to_engine = await asyncio.open_unix_connection(ENGINE_SOCKET)
            ends.append(to_engine)
            self.writers.add(to_engine)
            if self.closing:  # the gate ended while this connected: it aborted all it knew of then
                return
            await asyncio.gather(relay(client, to_engine), relay(engine, to_client))
        except OSError:
            pass  # the engine refused, or the gate is ending: the client sees its connection close
        finally:
            for writer in ends:
                writer.close()
                self.writers.discard(writer)


async def relay(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Bytes from ``source`` to ``sink`` until ``source`` ends (then ``sink`` is told no more comes)
    or either end breaks."""
    try:
        while data := await source.read(1 << 16):
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()
    except OSError:
        sink.transport.abort()


@asynccontextmanager
async def engine_gate(tmp_path: Path) -> AsyncIterator[EngineGate]:
    gate = EngineGate(tmp_path / "engine.sock")
    async with anyio.create_task_group() as tg:
        await tg.start(gate.serve)
        try:
            yield gate
        finally:
            gate.open()  # a service still waiting on the engine can then stop cleanly
            tg.cancel_scope.cancel()


def write_config(tmp_path: Path, config: Config, docker_host: str, extra: str = "") -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f"image = {json.dumps(config.image)}\ndocker_host = {json.dumps(docker_host)}\n{extra}"
        "[limits]\nmemory_mb = 256\ndefault_timeout_s = 20\nmax_run_s = 60\n"
        "[pool]\nsize = 1\nsession_spares = 0\nacquire_timeout_s = 60\n"
    )
    return path


@asynccontextmanager
async def front(config_path: Path) -> AsyncIterator[LineFront]:
    async with line_front(config_path, stderr=subprocess.PIPE) as client:
        yield client


async def test_a_cold_start_answers_the_handshake_and_lists_tools_before_the_service_reaches_the_engine(
    tmp_path: Path, config: Config
) -> None:
    async with engine_gate(tmp_path) as gate:
        # The engine's connect gives up after 10 s; on a busy machine the service keeps trying.
        config_path = write_config(tmp_path, config, f"unix://{gate.path}", "engine_wait_s = 60\n")
        with anyio.fail_after(CALL_S):
            async with front(config_path) as client:
                handshake = await client.initialize()
                listed = await client.request("tools/list", {})
                assert not gate.opened.is_set()  # the engine was unreachable all along: no container could be warm
                gate.open()
                answer = await client.request("tools/call", {"name": "run_python", "arguments": {"code": "6*7"}})
    assert "result" in handshake, handshake
    assert "run_python" in [tool["name"] for tool in listed["result"]["tools"]], listed
    assert answer["result"]["structuredContent"]["result"] == "42", answer


def service_log_says(text: str) -> bool:
    return any(
        text in log.read_text() for log in service_dir(Path(os.environ["MCP_CODE_EXEC_RUNTIME_DIR"])).glob("*.log")
    )


async def test_a_call_waiting_for_a_start_that_fails_is_told_why_and_the_front_exits_with_it(
    tmp_path: Path, config: Config
) -> None:
    async with engine_gate(tmp_path) as gate:
        config_path = write_config(tmp_path, config, f"unix://{gate.path}")
        with anyio.fail_after(CALL_S):
            async with front(config_path) as client:
                handshake = await client.initialize()
                assert "result" in handshake, handshake
                client.next_id += 1
                call = {"name": "run_python", "arguments": {"code": "1"}}
                await client.send({"jsonrpc": "2.0", "id": client.next_id, "method": "tools/call", "params": call})
                await wait_until(lambda: service_log_says("a call waits for the sandbox service to start"), 60)
                gate.refuse()  # the engine "goes away" while the service starts: its start fails
                refused = await client.reply()
                assert client.process.stderr is not None
                stderr = b"".join([chunk async for chunk in client.process.stderr])
                code = await client.process.wait()
    assert "no Docker engine answers" in refused["error"]["message"], refused
    assert code == 1
    assert "no Docker engine answers" in stderr.decode(), stderr


# -- a front answers the handshake from what the service answered before ----------------------------------
@contextmanager
def start_lock_held(config_path: Path) -> Iterator[None]:
    """No service can start while this is held: the lock a front takes to start one."""
    place = place_for(str(config_path), os.environ)
    handle = os.open(place.start_lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


def runtime_dir() -> Path:
    return Path(os.environ["MCP_CODE_EXEC_RUNTIME_DIR"])


async def test_a_front_answers_a_legacy_handshake_it_has_seen_before_any_service_runs(
    tmp_path: Path, config: Config
) -> None:
    config_path = write_config(tmp_path, config, f"unix://{ENGINE_SOCKET}")
    with anyio.fail_after(CALL_S):
        async with front(config_path) as client:
            seen = await client.initialize()
    assert stop_services(runtime_dir()) == []  # cold again: no service, its answers kept
    with anyio.fail_after(CALL_S):
        async with front(config_path) as client:
            with start_lock_held(config_path):
                handshake = await client.initialize()  # no service exists, and none can start
            answer = await client.request("tools/call", {"name": "run_python", "arguments": {"code": "6*7"}})
    assert handshake["result"] == seen["result"]
    assert answer["result"]["structuredContent"]["result"] == "42", answer


async def test_a_front_answers_the_first_handshake_of_a_configuration_before_any_service_runs(
    tmp_path: Path, config: Config
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    mount = f'[[mounts]]\nname = "shared"\npath = "{shared}"\n'
    config_path = write_config(tmp_path, config, f"unix://{ENGINE_SOCKET}", mount)
    place = place_for(str(config_path), os.environ)
    with anyio.fail_after(CALL_S):
        async with front(config_path) as client:
            with start_lock_held(config_path):
                handshake = await client.initialize()  # no service has ever run this configuration
            answer = await client.request("tools/call", {"name": "run_python", "arguments": {"code": "6*7"}})
    assert f"/mnt/host/shared is {shared}" in handshake["result"]["instructions"]
    assert answer["result"]["structuredContent"]["result"] == "42", answer
    # The service's own answer, kept as it gave it, is the one the front composed.
    [kept] = json.loads(place.answers.read_text())["answers"].values()
    assert kept == handshake["result"]
    assert not place.composing_refused.exists()


def daemons_of(config_path: Path) -> list[int]:
    """The local services started with this configuration (their command lines name it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"daemon" in argv and os.fsencode(config_path) in argv:
            found.append(int(entry.name))
    return found


async def test_a_front_answers_the_first_discovery_of_a_configuration_before_any_service_runs(
    tmp_path: Path, config: Config
) -> None:
    config_path = write_config(tmp_path, config, f"unix://{ENGINE_SOCKET}")
    params = sdk_front(config_path)
    place = place_for(str(config_path), os.environ)
    with anyio.fail_after(CALL_S):
        async with AsyncExitStack() as stack:
            with start_lock_held(config_path):  # no service has ever run this configuration, and none can start
                client = await stack.enter_async_context(Client(params))  # mode "auto": server/discover first
            version = client.protocol_version
            answer = await client.call_tool("run_python", {"code": "6*7"})
    assert version in MODERN_PROTOCOL_VERSIONS
    assert answer.structured_content is not None and answer.structured_content["result"] == "42"
    assert not place.composing_refused.exists()  # the service answered the discovery as the front did


async def test_a_front_killed_while_its_service_starts_leaves_that_service_to_the_next_front(
    tmp_path: Path, config: Config
) -> None:
    config_path = write_config(tmp_path, config, f"unix://{ENGINE_SOCKET}")
    with anyio.fail_after(CALL_S):
        async with front(config_path) as client:
            await client.initialize()  # answered by the front, while it starts the service
            await wait_until(lambda: daemons_of(config_path), 60, every_s=0.01)
            client.process.kill()  # before that service listens (it is importing the MCP SDK)
            await client.process.wait()
        async with front(config_path) as client:
            await client.initialize()
            answer = await client.request("tools/call", {"name": "run_python", "arguments": {"code": "6*7"}})
    assert answer["result"]["structuredContent"]["result"] == "42", answer
    assert len(live_service_pids(runtime_dir())) == 1  # the first front's service, not a second one


async def test_a_front_answers_a_discovery_it_has_seen_before_any_service_runs(tmp_path: Path, config: Config) -> None:
    config_path = write_config(tmp_path, config, f"unix://{ENGINE_SOCKET}")
    params = sdk_front(config_path)
    with anyio.fail_after(CALL_S):
        async with Client(params) as client:  # mode "auto": server/discover first
            seen = client.protocol_version
    assert stop_services(runtime_dir()) == []
    with anyio.fail_after(CALL_S):
        async with AsyncExitStack() as stack:
            with start_lock_held(config_path):
                client = await stack.enter_async_context(Client(params))
            assert client.protocol_version == seen
            answer = await client.call_tool("run_python", {"code": "6*7"})
    assert answer.structured_content is not None and answer.structured_content["result"] == "42"
    assert seen in MODERN_PROTOCOL_VERSIONS  # the discovery era, not a fallback to initialize
