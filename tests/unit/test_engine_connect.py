"""Finding an engine: what the server says when nothing (or something mute) answers."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from mcp_code_exec.errors import EngineUnavailable
from mcp_code_exec.runtime.docker.engine import DockerEngine


@pytest.mark.anyio
async def test_a_socket_that_accepts_but_never_answers_is_an_unavailable_engine(tmp_path: Path) -> None:
    path = tmp_path / "mute.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)  # accepts into the backlog and never replies: a dockerd still starting
    try:
        with pytest.raises(EngineUnavailable) as caught:
            await DockerEngine.connect(f"unix://{path}", timeout_s=0.5)
    finally:
        listener.close()
    assert f"unix://{path} (TimeoutError)" in str(caught.value)
