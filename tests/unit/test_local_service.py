"""The stdio front and where the local service lives: no engine needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_code_exec.commands.stdio import local_service
from mcp_code_exec.commands.stdio.local_service import (
    LocalServiceError,
    config_fingerprint,
    identity_name,
    runtime_directory,
    stdio_identity,
)

PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def test_the_front_imports_neither_the_sdk_nor_docker_nor_pydantic_nor_anyio() -> None:
    probe = (
        "import sys; from mcp_code_exec.commands import cli; from mcp_code_exec.commands.stdio import front, local_service;"
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


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to make a directory another user owns")
def test_a_runtime_directory_another_user_took_in_tmp_is_left_for_one_in_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/clients.md#the-local-service-stdio: a name in /tmp is first come, first served; another
    local user who takes ``mcp-code-exec-UID`` first must not stop this user's stdio server."""
    shared, home = tmp_path / "tmp", tmp_path / "home"
    shared.mkdir()
    shared.chmod(0o1777)
    home.mkdir()
    monkeypatch.setattr(local_service, "RUN_USER", str(tmp_path / "no-logind"))
    monkeypatch.setattr(local_service, "SHARED_TMP", str(shared))
    monkeypatch.setattr(local_service, "_home", lambda uid: home)
    uid, name = os.geteuid(), f"mcp-code-exec-{os.geteuid()}"
    assert runtime_directory({}) == shared / name  # free: this user takes it, private
    os.rmdir(shared / name)
    fallback = home / ".cache" / "mcp-code-exec" / "run"
    for owner, mode, link in ((65534, 0o700, False), (uid, 0o777, False), (None, None, True)):
        if link:
            (shared / name).symlink_to(tmp_path)
        else:
            (shared / name).mkdir()
            (shared / name).chmod(mode or 0)
            os.chown(shared / name, owner or 0, 65534)
        chosen = runtime_directory({})
        assert chosen == fallback, (owner, mode, link)
        assert chosen.stat().st_uid == uid and (chosen.stat().st_mode & 0o777) == 0o700
        assert runtime_directory({}) == fallback  # and so does every front of this user after it
        (shared / name).unlink() if link else os.rmdir(shared / name)
    other = shared / "named"
    (other / "mcp-code-exec").mkdir(parents=True)
    os.chown(other / "mcp-code-exec", 65534, 65534)
    with pytest.raises(LocalServiceError, match="nobody else can enter"):
        runtime_directory({"MCP_CODE_EXEC_RUNTIME_DIR": str(other)})  # named on purpose: the only choice
