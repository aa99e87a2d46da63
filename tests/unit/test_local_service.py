"""The stdio front and where the local service lives: no engine needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_code_exec.commands.local import (
    LocalServiceError,
    config_fingerprint,
    identity_name,
    runtime_directory,
    stdio_identity,
)

PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def test_the_front_imports_neither_the_sdk_nor_docker_nor_pydantic_nor_anyio() -> None:
    probe = (
        "import sys; from mcp_code_exec.commands import cli, front, local;"
        "heavy = [m for m in ('mcp', 'docker', 'pydantic', 'anyio') if m in sys.modules]; assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=PACKAGE_PARENT)


def test_the_stdio_identity_is_the_os_user_unless_a_name_is_configured() -> None:
    assert stdio_identity(None, 0) == "user:root"
    assert stdio_identity("desktop", 0) == "local:desktop"
    with pytest.raises(ValueError, match="is not a name"):
        stdio_identity("../x", 0)
    with pytest.raises(ValueError, match="is not a name"):
        stdio_identity("a" * 65, 0)


def test_the_environment_names_the_identity_before_the_file() -> None:
    settings: dict[str, object] = {"stdio": {"identity": "from-file"}}
    assert identity_name(settings, {}) == "from-file"
    assert identity_name(settings, {"MCP_CODE_EXEC_IDENTITY": "from-env"}) == "from-env"
    assert identity_name({}, {}) is None


def test_a_different_configuration_gets_a_different_service(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('image = "a"\n')
    first = config_fingerprint(str(path), {})
    assert config_fingerprint(str(path), {}) == first
    assert config_fingerprint(str(path), {"DOCKER_HOST": "unix:///other.sock"}) != first
    path.write_text('image = "b"\n')
    assert config_fingerprint(str(path), {}) != first


def test_the_runtime_directory_is_made_private_and_refused_if_others_can_enter(tmp_path: Path) -> None:
    made = runtime_directory({"MCP_CODE_EXEC_RUNTIME_DIR": str(tmp_path)})
    assert made == tmp_path / "mcp-code-exec" and (made.stat().st_mode & 0o777) == 0o700
    made.chmod(0o755)
    with pytest.raises(LocalServiceError, match="nobody else can enter"):
        runtime_directory({"MCP_CODE_EXEC_RUNTIME_DIR": str(tmp_path)})
    made.rmdir()
    os.symlink(tmp_path, made)  # a link planted where the directory goes is not followed
    with pytest.raises(LocalServiceError, match="must be a directory"):
        runtime_directory({"MCP_CODE_EXEC_RUNTIME_DIR": str(tmp_path)})
