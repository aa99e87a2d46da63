"""The README's set-up steps from a fresh clone: install (not editable), build the image, serve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import docker
import pytest
from _support import in_fresh_thread
from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parents[2]
TAG = "mcp-code-exec-packaging-test:latest"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh clone of the committed tree, pip-installed into its own virtualenv."""
    work = tmp_path_factory.mktemp("fresh")
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    venv = work / "venv"
    # Reuse the dependencies already installed here; the package itself comes from the clone.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", str(clone)],
        check=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    return venv


def test_the_installed_package_comes_from_the_clone_and_lists_every_command(installed: Path) -> None:
    where = subprocess.run(
        [str(installed / "bin" / "python"), "-c", "import mcp_code_exec; print(mcp_code_exec.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=installed,  # not the repo: it would shadow
    )
    assert where.stdout.startswith(str(installed))
    helped = subprocess.run(
        [str(installed / "bin" / "mcp-code-exec"), "--help"], capture_output=True, text=True, timeout=60, cwd=installed
    )
    assert helped.returncode == 0
    assert all(command in helped.stdout for command in ("serve", "image", "doctor", "bench"))


def test_the_installed_package_builds_the_image_and_serves_over_stdio(installed: Path) -> None:
    # Its own tag: the clone is the committed tree, which may differ from a developer's work tree.
    config = installed / "config.toml"
    config.write_text(f'image = "{TAG}"\n[pool]\nsize = 1\nsession_spares = 0\n')
    command = [str(installed / "bin" / "mcp-code-exec")]
    built = subprocess.run(
        [*command, "image", "build", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=installed,
    )
    assert built.returncode == 0, built.stderr[-2000:]

    async def call() -> dict[str, object]:
        params = StdioServerParameters(
            command=command[0],
            args=["serve", "--config", str(config)],
            cwd=str(installed),
            env={"MCP_CODE_EXEC_RUNTIME_DIR": os.environ["MCP_CODE_EXEC_RUNTIME_DIR"]},  # the test's own service
        )
        with anyio.fail_after(120):
            async with Client(params) as client:
                result = await client.call_tool("run_python", {"code": "print(6*7)"})
        assert result.structured_content is not None
        return dict(result.structured_content)

    try:
        assert in_fresh_thread(anyio.run, call)["stdout"] == "42\n"
    finally:
        client = docker.from_env()
        try:
            client.images.remove(TAG, force=True)
        finally:
            client.close()
