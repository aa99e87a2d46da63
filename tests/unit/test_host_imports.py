"""The Pythons the server starts never import what lies in the directory they were started from
(docs/security.md#code-planted-for-the-hosts-python); the engine tier drives the whole front."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_code_exec import __version__
from mcp_code_exec.commands.stdio.isolation import PACKAGE_HOME, import_path, refuse_writable_start, service_command
from mcp_code_exec.commands.stdio.local_service import LocalServiceError
from mcp_code_exec.config import greeting

PLANTED = ("json", "typing", "argparse", "netrc", "ctypes", "docker", "sitecustomize", "usercustomize")


def plant(directory: Path) -> None:
    """Modules named like the package and like what it imports, each leaving a mark if imported."""
    mark = "import pathlib\npathlib.Path(__file__).resolve().parent.joinpath('RAN-' + __name__).write_text('ran')\n"
    (directory / "mcp_code_exec").mkdir()
    for name in ("mcp_code_exec/__init__", "mcp_code_exec/__main__", *PLANTED):
        (directory / f"{name}.py").write_text(mark)


def test_the_service_starts_isolated_and_imports_nothing_from_where_its_front_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # the front's own path had it (``python -m`` put it there)
    assert str(tmp_path) not in import_path(str(tmp_path)) and os.fspath(PACKAGE_HOME) in import_path(str(tmp_path))
    command = service_command(["--version"], str(tmp_path))
    assert command[:3] == [sys.executable, "-I", "-c"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # -I: not read
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, f"mcp-code-exec {__version__}\n"), done.stderr
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith("RAN-")) == []


def test_the_front_refuses_a_writable_mount_holding_where_it_started_or_what_it_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, lib = tmp_path / "project", tmp_path / "lib"
    project.mkdir()
    lib.mkdir()

    def found(path: Path, writable: bool) -> greeting.Greeting | None:
        settings = {"mounts": [{"name": "w", "path": str(path), "writable": writable}]}
        return greeting.from_file(settings, environ={}, config_file=None)

    with pytest.raises(
        LocalServiceError, match=r"mounts\[0\].writable: .* the directory the server was started in"
    ) as e:
        refuse_writable_start(found(project, True), "/c.toml", str(project))
    assert e.value.exit_code == 2 and str(e.value).startswith("/c.toml: ")
    refuse_writable_start(found(project, False), None, str(project))  # read-only: fine
    refuse_writable_start(found(lib, True), None, str(project))  # neither: fine
    monkeypatch.syspath_prepend(str(lib))
    with pytest.raises(LocalServiceError, match="a directory the server's Python imports modules from"):
        refuse_writable_start(found(tmp_path, True), None, None)
