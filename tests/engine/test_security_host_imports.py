"""Nothing a sandbox writes is imported by the host's own Python (issue 32, class 1), on the real engine.

A cell writes, into everything it can write (a writable mount and ``/mnt/data``), modules named like
the server's package (``mcp_code_exec/`` and ``mcp_code_exec.py``), like what Python imports at its
start (``sitecustomize``, ``usercustomize``, a ``.pth`` file) and like every module this test process
has imported, a superset of what the server imports, late ones included (``netrc``, ``ctypes``,
``docker``, ``pwd``...). Each, if the host ever imports it, leaves a mark in a directory of the
host's. Then the user's client starts the server with that directory as its working directory, as
desktop hosts and IDEs start stdio servers in the user's project, in each form the docs recommend
(the console script, ``python -I -m``): a configuration sharing it writable is refused at once, and
with one sharing it read-only a new local service starts (isolated, in its private directory) and
serves; nothing planted ever runs. Under runc and gVisor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_service import live_service_pids, service_dir, stop_services
from _security import runsc_available
from _stdio_front import CONSOLE_SCRIPT, FORMS, line_front, sdk_front, serve_command
from mcp import Client

from mcp_code_exec.config.settings import Config

pytestmark = pytest.mark.anyio
CALL_S = 180  # a call, a service's start included (2 shared cores)
RUNTIMES = [None, pytest.param("runsc", marks=pytest.mark.runsc)]
# Planted in the working directory's own subdirectory too: ``mcp_code_exec.py`` beside no package.
FLAT = "flat"


@pytest.fixture(autouse=True)
def console_script() -> None:
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"no console script at {CONSOLE_SCRIPT} (the package is not installed in this environment)")


@pytest.fixture
def places(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """The user's project (shared with sandboxes), a directory where the client starts the server
    otherwise, the configuration files' directory, and the host's directory for the marks."""
    made = {name: tmp_path / name for name in ("project", "home", "conf", "marks")}
    for path in made.values():
        path.mkdir()
    made["project"].chmod(0o777)  # writable by the sandbox's uid, where a configuration allows it
    yield made
    assert ran_on_the_host(made["marks"]) == []


def ran_on_the_host(marks: Path) -> list[str]:
    return sorted(path.name for path in marks.iterdir())


def planted_names() -> list[str]:
    """Every top-level module this process has imported (the MCP SDK, docker, pydantic, anyio, the
    server's own and the standard library's, late ones included), and the ones Python looks for at
    its start."""
    names = {name.partition(".")[0] for name in sys.modules} | {"sitecustomize", "usercustomize", "netrc", "ctypes"}
    return sorted(name for name in names if name.isidentifier() and not name.startswith("__"))


def plant_cell(marks: Path) -> str:
    mark = f"import os\nopen(os.path.join({str(marks)!r}, 'RAN-' + __name__ + '-' + str(os.getpid())), 'w').close()\n"
    return (
        "import os\n"
        f"names, mark = {json.dumps(planted_names())}, {mark!r}\n"
        "planted = 0\n"
        f"for top in ('/mnt/host/project', '/mnt/host/project/{FLAT}', '/mnt/data'):\n"
        "    os.makedirs(top, exist_ok=True)\n"
        "    for name in names:\n"
        "        path = os.path.join(top, name + '.py')\n"
        "        if not os.path.exists(path):\n"
        "            open(path, 'w').write(mark)\n"
        "            planted += 1\n"
        "    open(os.path.join(top, 'planted.pth'), 'w').write(mark.replace('\\n', '; ').rstrip('; ') + '\\n')\n"
        "for top in ('/mnt/host/project', '/mnt/data'):\n"
        "    os.makedirs(os.path.join(top, 'mcp_code_exec'), exist_ok=True)\n"
        "    for part in ('__init__', '__main__'):\n"
        "        open(os.path.join(top, 'mcp_code_exec', part + '.py'), 'w').write(mark)\n"
        "print(planted)\n"
    )


def write_config(path: Path, config: Config, project: Path, *, writable: bool, runtime: str | None) -> Path:
    path.write_text(
        f"image = {json.dumps(config.image)}\n"
        + (f"runtime = {json.dumps(runtime)}\n" if runtime else "")
        + "[limits]\nmemory_mb = 256\ndefault_timeout_s = 20\nmax_run_s = 60\n"
        "[pool]\nsize = 1\nsession_spares = 0\nacquire_timeout_s = 60\n"
        "[sessions]\ndurable = false\n"  # a stopped service leaves nothing behind (the suite's leak checks)
        f'[[mounts]]\nname = "project"\npath = {json.dumps(str(project))}\nwritable = {json.dumps(writable)}\n'
    )
    return path


def runtime_dir() -> Path:
    return Path(os.environ["MCP_CODE_EXEC_RUNTIME_DIR"])


async def calls(config_path: Path, form: str, cwd: Path, *steps: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One client process that starts the server in ``cwd`` and makes these calls."""
    answers = []
    with anyio.fail_after(CALL_S):
        async with Client(sdk_front(config_path, form=form, cwd=cwd)) as client:
            for tool, arguments in steps:
                result = await client.call_tool(tool, arguments)
                assert not result.is_error, result.content
                assert isinstance(result.structured_content, dict)
                answers.append(result.structured_content)
    return answers


def the_service_runs_isolated_in_its_own_directory() -> None:
    [pid] = live_service_pids(runtime_dir())
    assert os.readlink(f"/proc/{pid}/cwd") == str(service_dir(runtime_dir()))
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1] == b"-I"


async def the_front_leaves_its_clients_directory(config_path: Path, form: str, cwd: Path) -> None:
    with anyio.fail_after(CALL_S):
        async with line_front(config_path, form=form, cwd=cwd) as front:
            assert "result" in await front.initialize()
            assert os.readlink(f"/proc/{front.process.pid}/cwd") == str(service_dir(runtime_dir()))


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_modules_a_sandbox_plants_never_run_on_the_host(
    places: dict[str, Path], config: Config, runtime: str | None
) -> None:
    if runtime == "runsc" and not runsc_available():
        pytest.skip("gVisor (runsc) is not registered with the engine")
    project, marks = places["project"], places["marks"]
    shared = write_config(places["conf"] / "shared.toml", config, project, writable=True, runtime=runtime)
    # The client starts the server elsewhere; a configuration shares the project writable.
    sid = (await calls(shared, "console script", places["home"], ("new_session", {})))[0]["session_id"]
    [planted] = await calls(
        shared, "console script", places["home"], ("run_python", {"code": plant_cell(marks), "session_id": sid})
    )
    assert planted["status"] == "ok" and int(planted["stdout"]) > 300, planted
    assert (project / "mcp_code_exec" / "__init__.py").is_file() and (project / FLAT / "mcp_code_exec.py").is_file()
    assert stop_services(runtime_dir()) == []
    # The client now starts the server in the project itself, which this configuration shares
    # read-only, each time with a service to start: the console script, then the isolated interpreter.
    read_only = write_config(places["conf"] / "read-only.toml", config, project, writable=False, runtime=runtime)
    for form, cwd in (("console script", project), ("python -I -m", project / FLAT)):
        try:
            [ran] = await calls(read_only, form, cwd, ("run_python", {"code": "import json, netrc\nprint(6*7)"}))
            the_service_runs_isolated_in_its_own_directory()
            await the_front_leaves_its_clients_directory(read_only, form, cwd)
        finally:
            assert ran_on_the_host(marks) == [], form  # before any other failure: it says what ran
        assert ran["stdout"] == "42\n", (form, ran)
        assert stop_services(runtime_dir()) == []
    # Served in the front's own process (a client's ``--in-process``), in the project too.
    with anyio.fail_after(CALL_S):
        params = sdk_front(read_only, form="console script", cwd=project)
        params.args.append("--in-process")
        async with Client(params) as client:
            served = await client.call_tool("run_python", {"code": "print(6*7)"})
    assert ran_on_the_host(marks) == []
    assert served.structured_content is not None and served.structured_content["stdout"] == "42\n"


@pytest.mark.parametrize("form", FORMS)
async def test_a_writable_mount_that_holds_the_servers_working_directory_is_refused_at_load(
    places: dict[str, Path], config: Config, form: str
) -> None:
    project = places["project"]
    (project / "sub").mkdir()
    shared = write_config(places["conf"] / "shared.toml", config, project, writable=True, runtime=None)
    for cwd, extra in ((project, []), (project / "sub", []), (project, ["--in-process"])):
        command = [*serve_command(shared, form), *extra]
        with anyio.fail_after(60):
            done = await anyio.run_process(command, cwd=cwd, check=False, stdin=subprocess.DEVNULL)
        said = done.stderr.decode()
        assert done.returncode == 2, (cwd, extra, said)
        assert f"{shared}: mounts[0].writable: {project.resolve()} holds {cwd.resolve()}, the directory" in said, said
        assert done.stdout == b""  # not even the handshake's answer
    http = [*FORMS[form], "serve", "--transport", "streamable-http", "--port", "0", "--config", str(shared)]
    with anyio.fail_after(60):
        done = await anyio.run_process(http, cwd=project, check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and b"the directory the server was started in" in done.stderr, done.stderr
    assert live_service_pids(runtime_dir()) == []  # no service was started for it
