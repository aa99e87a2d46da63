"""Where the Docker endpoint is looked for, and what the logs may and may not contain."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
from mcp import Client

from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.runtime.docker.endpoints import candidate_endpoints
from mcp_code_exec.service.facade import SandboxService


def test_an_explicit_endpoint_or_docker_host_is_the_only_one_tried(tmp_path: Path) -> None:
    assert candidate_endpoints("tcp://10.0.0.1:2375", {"HOME": str(tmp_path)}) == ["tcp://10.0.0.1:2375"]
    assert candidate_endpoints(None, {"HOME": str(tmp_path), "DOCKER_HOST": "unix:///x.sock"}) == ["unix:///x.sock"]


def test_the_active_docker_context_is_used(tmp_path: Path) -> None:
    docker_dir = tmp_path / ".docker"
    meta = docker_dir / "contexts" / "meta" / hashlib.sha256(b"colima").hexdigest()
    meta.mkdir(parents=True)
    (docker_dir / "config.json").write_text(json.dumps({"currentContext": "colima"}))
    (meta / "meta.json").write_text(json.dumps({"Name": "colima", "Endpoints": {"docker": {"Host": "unix:///c.sock"}}}))
    assert candidate_endpoints(None, {"HOME": str(tmp_path)})[0] == "unix:///c.sock"


def test_docker_desktop_sockets_are_found_in_the_home_directory(tmp_path: Path) -> None:
    socket_path = tmp_path / ".docker" / "run" / "docker.sock"
    socket_path.parent.mkdir(parents=True)
    socket_path.touch()
    assert f"unix://{socket_path}" in candidate_endpoints(
        None, {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path)}
    )


@pytest.mark.anyio
async def test_each_tool_call_logs_one_line_without_user_code_or_secrets(
    service: SandboxService, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mcp_code_exec")
    async with Client(build_server(service)) as client:
        await client.call_tool("run_python", {"code": "secret_marker_4711 = 'hunter2'; print(secret_marker_4711)"})
        await client.call_tool("list_files", {"session_id": "s_unknown"})
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("mcp_code_exec.mcp_server")]
    assert any(line.startswith("tool run_python: ok in") for line in lines)
    assert any(line.startswith("tool list_files: error SessionNotFound in") for line in lines)
    everything = "\n".join(r.getMessage() for r in caplog.records)
    assert "secret_marker_4711" not in everything and "hunter2" not in everything
