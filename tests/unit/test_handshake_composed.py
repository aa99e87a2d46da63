"""A front with no kept answer composes the ``initialize`` answer from the configuration file; it must
be the answer the server itself gives (the SDK's, over the server the service builds), for every
protocol version and every configuration the instructions depend on, and none for what the SDK
would refuse. A service that still answers otherwise stops the composing for its build."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.shared.memory import create_client_server_memory_streams
from mcp.shared.message import SessionMessage
from mcp_types import jsonrpc_message_adapter
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION, MODERN_PROTOCOL_VERSIONS

from mcp_code_exec.commands.stdio import front
from mcp_code_exec.commands.stdio.handshake import (
    DISCOVER_VERSIONS,
    INITIALIZE_VERSIONS,
    LATEST_INITIALIZE_VERSION,
    composed_answer,
    remember_answer,
)
from mcp_code_exec.commands.stdio.local_service import Place, parsed_file
from mcp_code_exec.config import greeting, load_config
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.mcp_server.local.late_service import LateService

CLIENT: dict[str, Any] = {"name": "c", "version": "1"}
CONFIGS = {
    "defaults": "",
    "network, no installs": "network = true\n[packages]\nenabled = false\n",
    "mounts": '[[mounts]]\nname = "data"\npath = "{home}/data"\n\n[[mounts]]\nname = "out"\npath = "~/out"\nwritable = true\n',
}


META = "io.modelcontextprotocol/"


def discover(**meta: Any) -> dict[str, Any]:
    envelope = {f"{META}protocolVersion": "2026-07-28", f"{META}clientCapabilities": {}, f"{META}clientInfo": CLIENT}
    fields = {**envelope, **{f"{META}{key}": value for key, value in meta.items()}}
    return {"jsonrpc": "2.0", "id": 8, "method": "server/discover", "params": {"_meta": fields}}


def initialize(version: str, **params: Any) -> dict[str, Any]:
    fields = {"protocolVersion": version, "capabilities": {}, "clientInfo": CLIENT, **params}
    return {"jsonrpc": "2.0", "id": 7, "method": "initialize", "params": fields}


async def sdk_answer(config_path: Path, environ: dict[str, str], request: dict[str, Any]) -> dict[str, Any]:
    """What the server the service builds answers ``request`` with (over the SDK, in memory)."""
    config = load_config(config_path, environ=environ)
    lowlevel = build_server(LateService(config, 1.0))._lowlevel_server
    streams = create_client_server_memory_streams()
    async with streams as ((read, write), (server_read, server_write)), anyio.create_task_group() as group:
        group.start_soon(lowlevel.run, server_read, server_write, lowlevel.create_initialization_options())
        with anyio.fail_after(10):
            await write.send(SessionMessage(jsonrpc_message_adapter.validate_python(request, by_name=False)))
            reply = await read.receive()
        group.cancel_scope.cancel()
    assert isinstance(reply, SessionMessage)
    answer: dict[str, Any] = json.loads(reply.message.model_dump_json(by_alias=True, exclude_unset=True))
    return answer


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("data", "out"):
        (tmp_path / "home" / name).mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # where "~" is, for the front and the server alike
    return tmp_path / "home"


def write_config(tmp_path: Path, home: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text.replace("{home}", str(home)))
    return path


def composed(config_path: Path, environ: dict[str, str], request: dict[str, Any]) -> dict[str, Any] | None:
    parsed = parsed_file(str(config_path))
    assert parsed is not None
    found = greeting.from_file(parsed, environ=environ, config_file=str(config_path))
    assert found is not None
    answer = composed_answer(json.dumps(request).encode() + b"\n", greeting.instructions(found))
    return None if answer is None else answer[1]


def test_the_front_negotiates_the_versions_the_sdk_does() -> None:
    assert INITIALIZE_VERSIONS == HANDSHAKE_PROTOCOL_VERSIONS
    assert LATEST_INITIALIZE_VERSION == LATEST_HANDSHAKE_VERSION
    assert DISCOVER_VERSIONS == MODERN_PROTOCOL_VERSIONS


@pytest.mark.anyio
@pytest.mark.parametrize("config_text", CONFIGS.values(), ids=CONFIGS.keys())
async def test_the_composed_answer_is_the_servers_own_for_every_version(
    tmp_path: Path, home: Path, config_text: str
) -> None:
    config_path = write_config(tmp_path, home, config_text)
    environ = dict(os.environ)
    ui = {"extensions": {"io.modelcontextprotocol/ui": {"mimeTypes": ["text/html;profile=mcp-app"]}}}
    requests = [
        initialize(version, capabilities=capabilities)
        for version in [*HANDSHAKE_PROTOCOL_VERSIONS, "1999-01-01"]
        for capabilities in ({}, ui)
    ]
    requests += [discover(), discover(clientCapabilities=ui)]
    for request in requests:
        server = await sdk_answer(config_path, environ, request)
        assert composed(config_path, environ, request) == server["result"], request


@pytest.mark.anyio
async def test_params_the_sdk_refuses_get_no_composed_answer(tmp_path: Path, home: Path) -> None:
    config_path = write_config(tmp_path, home, "")
    environ = dict(os.environ)
    refused = [
        initialize("2025-06-18", clientInfo={"name": "c"}),
        initialize("2025-06-18", capabilities=[]),
        initialize(42),  # type: ignore[arg-type]  # a hostile client's version
        discover(protocolVersion="2025-06-18"),
        discover(clientInfo={"name": "c"}),
        discover(clientCapabilities=None),
        {"jsonrpc": "2.0", "id": 8, "method": "server/discover", "params": {}},
    ]
    for request in refused:
        assert "error" in await sdk_answer(config_path, environ, request), request
        assert composed(config_path, environ, request) is None, request


@pytest.mark.parametrize(
    "text",
    [
        'network = "yes"\n',
        "[packages]\nenabled = 1\n",
        'mounts = "data"\n',
        '[[mounts]]\nname = "Data"\npath = "/tmp"\n',
    ],
)
def test_a_value_the_front_cannot_read_plainly_composes_nothing(tmp_path: Path, home: Path, text: str) -> None:
    parsed = parsed_file(str(write_config(tmp_path, home, text)))
    assert parsed is not None
    assert greeting.from_file(parsed, environ=os.environ, config_file=None) is None


def test_the_greetings_defaults_are_the_configurations() -> None:
    assert greeting.from_file({}, environ=os.environ, config_file=None) == greeting.from_config(load_config(environ={}))


def first_line(request: dict[str, Any]) -> bytes:
    return json.dumps(request).encode() + b"\n"


def test_a_kept_answer_comes_before_the_composed_one_and_a_refusal_stops_composing(tmp_path: Path) -> None:
    place = Place(tmp_path, "service")
    request = initialize("2025-06-18")
    answer, unlike = front.early_answer(first_line(request), place, {}, None, os.environ)
    assert answer is not None and answer[1]["serverInfo"]["name"] == "mcp-code-exec"
    unlike()  # the service answered otherwise
    assert front.early_answer(first_line(request), place, {}, None, os.environ)[0] is None
    remember_answer(place.answers, request, {"kept": True})
    assert front.early_answer(first_line(request), place, {}, None, os.environ)[0] == (request, {"kept": True})


def test_an_unreadable_configuration_file_composes_nothing(tmp_path: Path) -> None:
    place = Place(tmp_path, "service")
    assert front.early_answer(first_line(initialize("2025-06-18")), place, None, None, os.environ)[0] is None


def test_a_service_answer_unlike_the_one_given_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    ours, service = socket.socketpair()
    request = initialize("2025-06-18")
    called: list[bool] = []
    with ours, service:
        service.sendall(first_line({"jsonrpc": "2.0", "id": 7, "result": {"other": 1}}) + b"after\n")
        service.shutdown(socket.SHUT_WR)
        rest = front._drop_service_answer(ours, request, {"given": 1}, lambda: called.append(True))
    assert rest == b"after\n"
    assert called == [True]
    assert "unlike" in capsys.readouterr().err
