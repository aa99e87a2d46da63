"""The command line: every error a user can reach is one clear sentence and a non-zero exit."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _support import in_fresh_thread

from mcp_code_exec.commands.cli import main
from mcp_code_exec.config.settings import load_config


def write_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return str(path)


def last_line(captured: str) -> str:
    lines = [line for line in captured.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_help_lists_every_command() -> None:
    done = subprocess.run([sys.executable, "-m", "mcp_code_exec", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for command in ("serve", "image", "doctor", "bench"):
        assert command in done.stdout


def test_a_bad_flag_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert in_fresh_thread(main, ["--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_bad_config_value_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, '[limits]\nmemory_mb = "lots"\n')
    assert in_fresh_thread(main, ["serve", "--config", path]) == 2
    line = last_line(capsys.readouterr().err)
    assert "limits.memory_mb" in line and "integer" in line
    assert "Traceback" not in line


def test_an_unknown_config_key_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, "[pool]\nsizee = 3\n")
    assert in_fresh_thread(main, ["serve", "--config", path]) == 2
    assert "pool.sizee: unknown key" in capsys.readouterr().err


def test_a_config_file_that_is_not_toml_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, "this is = = not toml")
    assert in_fresh_thread(main, ["serve", "--config", path]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_a_missing_config_file_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert in_fresh_thread(main, ["serve", "--config", "/nonexistent/config.toml"]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_no_docker_engine_says_what_was_tried_and_how_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, 'docker_host = "unix:///nonexistent/docker.sock"\n')
    assert in_fresh_thread(main, ["serve", "--config", path]) == 1
    line = last_line(capsys.readouterr().err)
    assert "no Docker engine answers" in line and "/nonexistent/docker.sock" in line and "start" in line


def test_a_missing_image_names_the_build_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, 'image = "mcp-code-exec:not-built"\n')
    assert in_fresh_thread(main, ["serve", "--config", path]) == 1
    assert "mcp-code-exec image build" in last_line(capsys.readouterr().err)


def test_a_port_in_use_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert in_fresh_thread(main, ["serve", "--transport", "streamable-http", "--port", str(port)]) == 2
    line = last_line(capsys.readouterr().err)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line


def test_binding_a_public_address_without_a_token_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MCP_CODE_EXEC_TOKEN", raising=False)
    assert in_fresh_thread(main, ["serve", "--transport", "sse", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "refusing to listen on 0.0.0.0 without a bearer token" in capsys.readouterr().err


def test_configuration_precedence_is_defaults_then_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[limits]\nmemory_mb = 300\n[http]\ntoken = "from-file"\n[pool]\nsize = 3\n')
    assert load_config(environ={}).limits.memory_mb == 512  # default
    from_file = load_config(environ={"MCP_CODE_EXEC_CONFIG": path})
    assert from_file.limits.memory_mb == 300 and from_file.pool.size == 3
    assert from_file.http.token is not None and from_file.http.token.get_secret_value() == "from-file"
    from_env = load_config(environ={"MCP_CODE_EXEC_CONFIG": path, "MCP_CODE_EXEC_TOKEN": "from-env"})
    assert from_env.http.token is not None and from_env.http.token.get_secret_value() == "from-env"
    flagged = load_config(path, environ={"MCP_CODE_EXEC_TOKEN": "from-env"}, overrides={"pool": {"size": 5}})
    assert flagged.pool.size == 5 and flagged.limits.memory_mb == 300
    assert "from-env" not in repr(from_env)  # secrets never printed
