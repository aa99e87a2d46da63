"""The README's set-up steps from a fresh clone: install (not editable), build the image, serve."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import anyio
import docker
import pytest
from _support import in_fresh_thread
from mcp import Client, StdioServerParameters
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
TAG = "mcp-code-exec-packaging-test:latest"
MCPB = REPO / "tests" / "engine" / "fixtures" / "mcpb" / "node_modules" / ".bin" / "mcpb"


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


def test_the_installed_package_makes_a_bundle_of_itself_the_bundle_cli_accepts(installed: Path, tmp_path: Path) -> None:
    """An installation has no pyproject.toml: the bundle's is made from the installed metadata, and
    the image context comes from inside the package, where the wheel put it."""
    done = subprocess.run(
        [str(installed / "bin" / "mcp-code-exec"), "bundle", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    bundle = Path(done.stdout.split("\n")[0])
    site = next((installed / "lib").glob("python3*/site-packages"))
    package = site / "mcp_code_exec"
    installed_files = {
        path.relative_to(site).as_posix()
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }
    with zipfile.ZipFile(bundle) as archive:
        names = set(archive.namelist())
        bundled = tomllib.loads(archive.read("pyproject.toml").decode())["project"]
    extras = {"manifest.json", "pyproject.toml", "server/main.py", "icon.png", ".mcpbignore"}
    assert names == installed_files | extras
    project = tomllib.loads((installed.parent / "clone" / "pyproject.toml").read_text())["project"]

    def normal(lines: list[str]) -> list[tuple[str, str]]:  # the metadata sorts them and normalises their names
        return sorted((canonicalize_name(r.name), str(r.specifier)) for r in map(Requirement, lines))

    assert normal(bundled["dependencies"]) == normal(project["dependencies"])
    assert bundled["requires-python"] == project["requires-python"]
    if MCPB.exists():
        unpacked = tmp_path / "unpacked"
        subprocess.run([str(MCPB), "unpack", str(bundle), str(unpacked)], check=True, capture_output=True, timeout=120)
        checked = subprocess.run(
            [str(MCPB), "validate", str(unpacked / "manifest.json")], capture_output=True, text=True, timeout=120
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
