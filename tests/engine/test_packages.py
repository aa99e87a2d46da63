"""`pip install` in a cell works while the sandbox keeps no network: the server fetches the wheels
with its own pip configuration and copies them in before the cell runs. The packages used here
(humanize, toolz, termcolor, tomli-w, emoji) are on the machine's index and not in the image."""

from __future__ import annotations

import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from _support import make_test_config
from mcp import Client

from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.models import RunResult
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
OWNER = "packages"


@pytest.fixture(scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SandboxService]:
    """A service of its own, with a wheel cache of its own (so the first install really downloads)."""
    cache = tmp_path_factory.mktemp("wheels")
    config = make_test_config(
        pool={"size": 1, "session_spares": 1}, packages={"deny": ["emoji"], "cache_dir": str(cache)}
    )
    assert config.network is False
    async with SandboxService.start(config) as svc:
        await svc.wait_ready()
        yield svc


async def session_run(service: SandboxService, sid: str, code: str) -> RunResult:
    return await service.run(OWNER, code, session_id=sid, timeout=60)


async def test_pip_install_in_a_session_without_network_is_importable_in_the_same_cell_and_the_next(
    service: SandboxService,
) -> None:
    sid = (await service.new_session(OWNER)).session_id
    try:
        first = await session_run(service, sid, "%pip install humanize\nimport humanize\nhumanize.intcomma(1234567)")
        assert first.status == "ok", first.error
        assert first.result == "'1,234,567'"
        assert "Successfully installed humanize" in first.stdout
        assert first.files == []  # the installed package and the wheelhouse are not the user's files
        later = await session_run(
            service, sid, "import os\nprint(humanize.naturalsize(10**6))\nsorted(os.listdir('/sys/class/net'))"
        )
        assert later.status == "ok", later.error
        assert later.stdout == "1.0 MB\n"
        assert later.result == "['lo']"  # still no network interface but loopback
        left = await session_run(service, sid, "import os\nsorted(set(os.listdir('/mnt/data')) - {'.mcpx'})")
        assert left.result == "['.packages']"  # the wheelhouse went after the cell
        listed, _ = await service.list_files(OWNER, sid)
        assert listed == []
    finally:
        await service.close_session(OWNER, sid)


async def test_a_second_session_installing_the_same_package_is_served_from_the_cache(service: SandboxService) -> None:
    stats = service.packages.stats
    sid = (await service.new_session(OWNER)).session_id
    try:
        first = await session_run(service, sid, "%pip install -q tomli-w\nimport tomli_w\ntomli_w.dumps({'a': 1})")
        assert first.status == "ok", first.error
    finally:
        await service.close_session(OWNER, sid)
    before = (stats.resolutions, stats.resolution_hits, stats.downloaded, stats.cached)
    sid = (await service.new_session(OWNER)).session_id
    try:
        again = await session_run(service, sid, "%pip install -q tomli-w\nimport tomli_w\ntomli_w.dumps({'a': 1})")
        assert again.status == "ok", again.error
        assert again.result == "'a = 1\\n'"
    finally:
        await service.close_session(OWNER, sid)
    after = (stats.resolutions, stats.resolution_hits, stats.downloaded, stats.cached)
    # not resolved again, not downloaded again: served from memory and the disk cache
    assert after == (before[0], before[1] + 1, before[2], before[3] + 1)


async def test_a_shell_escape_and_a_bare_pip_line_install_too(service: SandboxService) -> None:
    sid = (await service.new_session(OWNER)).session_id
    try:
        cell = "!pip install -q toolz > /dev/null 2>&1\npip install termcolor\nimport toolz, termcolor\nprint(toolz.identity(7))"
        result = await session_run(service, sid, cell)
        assert result.status == "ok", result.error
        assert result.stdout.endswith("7\n")
        assert "Successfully installed termcolor" in result.stdout and "toolz" not in result.stdout
    finally:
        await service.close_session(OWNER, sid)


async def test_installed_packages_outlive_the_sessions_container(service: SandboxService) -> None:
    sid = (await service.new_session(OWNER)).session_id
    try:
        assert (await session_run(service, sid, "%pip install -q humanize")).status == "ok"
        session = service.sessions.get(sid, OWNER)
        assert session.sandbox is not None
        await session.sandbox.destroy()  # the container dies; the volume stays
        result = await session_run(service, sid, "import humanize\nhumanize.intword(3_000_000)")
        assert result.status == "ok", result.error
        assert result.session_restarted
        assert result.result == "'3.0 million'"
    finally:
        await service.close_session(OWNER, sid)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("%pip install emoji", "emoji is denied by this server's policy ([packages] deny)"),
        ("!pip install nosuch-package-mcpx-h3", "no such package on the server's index: nosuch-package-mcpx-h3"),
        ("%pip install -e .", "editable installs build from source"),
    ],
)
async def test_a_refused_install_is_an_error_and_nothing_of_the_cell_runs(
    service: SandboxService, line: str, says: str
) -> None:
    sid = (await service.new_session(OWNER)).session_id
    try:
        result = await session_run(service, sid, f"open('ran', 'w').write('yes')\n{line}")
        assert result.status == "error"
        assert result.error is not None and result.error.type == "PackageError"
        assert says in result.error.message and "Nothing of the cell was run" in result.error.message
        after = await session_run(service, sid, "import os\nos.path.exists('ran')")
        assert after.result == "False"
    finally:
        await service.close_session(OWNER, sid)


def sdist_only_index(root: Path) -> tuple[Path, Path]:
    """A find-links directory holding only a source package whose setup.py leaves a mark if run."""
    marker = root / "setup-py-ran"
    source = root / "src"
    (source / "onlysource").mkdir(parents=True)
    (source / "onlysource" / "__init__.py").write_text("")
    (source / "setup.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('built')\n"
        "from setuptools import setup\nsetup(name='onlysource-mcpx', version='1.0', packages=['onlysource'])\n"
    )
    links = root / "links"
    links.mkdir()
    with tarfile.open(links / "onlysource_mcpx-1.0.tar.gz", "w:gz") as tar:
        tar.add(source, arcname="onlysource_mcpx-1.0")
    return links, marker


async def test_a_package_with_only_source_gets_no_wheel_and_nothing_is_built(
    service: SandboxService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The machine's index has no source-only package: this test makes one, next to the index.
    links, marker = sdist_only_index(tmp_path)
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    result = await service.run(OWNER, "print('ran')\n%pip install onlysource-mcpx", timeout=60)
    assert result.status == "error" and result.stdout == ""
    assert result.error is not None and result.error.type == "PackageError"
    assert "no wheel of onlysource-mcpx for the sandbox (CPython 3.11" in result.error.message
    assert "source packages are never built here" in result.error.message
    assert not marker.exists()  # neither resolving nor looking it up ran its setup.py


async def test_a_stateless_run_gets_its_packages_and_the_next_run_has_none_and_pip_lines_work_there_too(
    service: SandboxService,
) -> None:
    result = await service.run(OWNER, "import humanize\nhumanize.intcomma(1000)", packages=["humanize"], timeout=60)
    assert result.status == "ok", result.error
    assert result.result == "'1,000'" and result.files == []
    clean = await service.run(OWNER, "import importlib.util, os\n(importlib.util.find_spec('humanize'), os.listdir())")
    assert clean.result == "(None, [])"
    in_cell = await service.run(OWNER, "%pip install -q humanize\nimport humanize\nhumanize.intcomma(2000)", timeout=60)
    assert in_cell.status == "ok", in_cell.error
    assert in_cell.result == "'2,000'" and in_cell.files == []


async def test_a_model_reads_how_to_install_and_passes_packages_through_the_tool(service: SandboxService) -> None:
    async with Client(build_server(service)) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        run_python = tools["run_python"]
        assert "%pip install NAME" in (run_python.description or "")
        assert "packages" in run_python.input_schema["properties"]
        answer = await client.call_tool(
            "run_python",
            {"code": "import termcolor\ntermcolor.colored('x', 'red', force_color=True)", "packages": ["termcolor"]},
        )
        assert answer.structured_content is not None
        assert answer.structured_content["status"] == "ok", answer.structured_content["error"]
        assert answer.structured_content["result"] == "'\\x1b[31mx\\x1b[0m'"
        refused = await client.call_tool("run_python", {"code": "print(1)", "packages": ["emoji"]})
        assert refused.structured_content is not None and not refused.is_error
        assert refused.structured_content["status"] == "error"
        assert refused.structured_content["error"]["type"] == "PackageError"
