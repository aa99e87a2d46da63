"""An independent client: the official MCP Inspector's CLI mode against the stdio server (2025-11-25)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

INSPECTOR_VERSION = "2.12.0"
INSPECTOR_DIR = Path(os.environ.get("MCP_INSPECTOR_DIR", Path.home() / ".cache" / "mcp-code-exec" / "inspector"))


@pytest.fixture(scope="module")
def inspector() -> Path:
    binary = INSPECTOR_DIR / "node_modules" / ".bin" / "mcp-inspector"
    if binary.exists():
        return binary
    if shutil.which("npm") is None:
        if os.environ.get("CI"):
            pytest.fail("npm is required in CI for the Inspector test")
        pytest.skip("npm is not installed; the Inspector test needs node and npm")
    INSPECTOR_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "npm",
            "install",
            "--no-audit",
            "--no-fund",
            "--loglevel=error",
            f"@modelcontextprotocol/inspector@{INSPECTOR_VERSION}",
        ],
        cwd=INSPECTOR_DIR,
        check=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    return binary


def run_inspector(inspector: Path, *method_args: str) -> dict[str, Any]:
    # The Inspector passes the server a few variables only: the test's own runtime directory goes too.
    RUNTIME_DIR = ["-e", f"MCP_CODE_EXEC_RUNTIME_DIR={os.environ['MCP_CODE_EXEC_RUNTIME_DIR']}"]
    done = subprocess.run(
        [str(inspector), "--cli", *RUNTIME_DIR, sys.executable, "-m", "mcp_code_exec", "serve", *method_args],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def test_the_inspector_lists_the_tools(inspector: Path) -> None:
    listing = run_inspector(inspector, "--method", "tools/list")
    names = {tool["name"] for tool in listing["tools"]}
    assert names == {
        "run_python",
        "get_run",
        "cancel_run",
        "new_session",
        "close_session",
        "list_files",
        "read_file",
        "write_file",
        "file_url",
        "fork_session",
        "list_variables",
        "export_notebook",
        "get_usage",
        "view_session",
        "view_run",
    }  # fmt: skip  (the view's app-only tools are not listed: the Inspector does not declare MCP Apps)


def test_the_inspector_calls_run_python_and_gets_42(inspector: Path) -> None:
    called = run_inspector(
        inspector, "--method", "tools/call", "--tool-name", "run_python", "--tool-arg", "code=print(6*7)"
    )
    assert called["isError"] is False
    assert called["structuredContent"]["stdout"] == "42\n"
