"""``mcp-code-exec bundle``: the .mcpb Claude Desktop's extension installer takes, checked with the
bundle CLI from npm (``@anthropic-ai/mcpb``, pinned in tests/engine/fixtures/mcpb). The CLI is a
node program that needs no engine and answers in about a second a call, so this runs in the
unit tier; it is skipped, saying why, where the fixture is not installed."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import tomllib
import zipfile
import zlib
from pathlib import Path

import pytest
from _fake_agent import FakeAgent
from mcp import Client
from test_service_in_memory import running, settings

from mcp_code_exec.commands.bundle import ENTRY_POINT, build, icon, source
from mcp_code_exec.commands.cli import main
from mcp_code_exec.mcp_server import build_server

REPO = Path(__file__).resolve().parents[2]
MCPB = REPO / "tests" / "engine" / "fixtures" / "mcpb" / "node_modules" / ".bin" / "mcpb"
needs_mcpb = pytest.mark.skipif(
    not MCPB.exists() or shutil.which("node") is None,
    reason="the bundle CLI is not installed (npm ci --prefix tests/engine/fixtures/mcpb)",
)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, digest = build(tmp_path_factory.mktemp("bundle"))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    return path


def mcpb(*args: str | Path, cwd: Path) -> str:
    done = subprocess.run([str(MCPB), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_bundle_holds_the_package_its_image_context_and_an_entry_point(bundle: Path) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert bundle.name == f"mcp-code-exec-{project['version']}.mcpb"
    with zipfile.ZipFile(bundle) as archive:
        names = archive.namelist()
        manifest = json.loads(archive.read("manifest.json"))
        bundled = tomllib.loads(archive.read("pyproject.toml").decode())
        main_py = archive.read(ENTRY_POINT).decode()
        images = {name: archive.read(name) for name in names if name.startswith("mcp_code_exec/_images/python/")}
    assert {"manifest.json", "icon.png", ".mcpbignore", "mcp_code_exec/__init__.py"} <= set(names)
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    # The image context byte for byte: the image the bundled server asks for is the one `image build` makes.
    context = REPO / "images" / "python"
    expected = {
        f"mcp_code_exec/_images/python/{path.relative_to(context).as_posix()}": path.read_bytes()
        for path in context.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }
    assert images == expected
    assert bundled["project"]["dependencies"] == project["dependencies"]
    assert bundled["project"]["version"] == manifest["version"] == project["version"]
    assert bundled["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["mcp_code_exec"]
    assert manifest["server"]["entry_point"] == ENTRY_POINT and "main(sys.argv[1:])" in main_py


def test_the_same_tree_makes_the_same_bytes_so_server_json_can_name_its_hash(bundle: Path, tmp_path: Path) -> None:
    again, _ = build(tmp_path)
    assert again.read_bytes() == bundle.read_bytes()


def test_the_icon_is_a_512_pixel_png_made_without_an_imaging_library() -> None:
    png = icon()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    width, height, depth, colour = struct.unpack(">IIBB", png[16:26])
    assert (width, height, depth, colour) == (512, 512, 8, 2)
    length = struct.unpack(">I", png[33:37])[0]
    pixels = zlib.decompress(png[41 : 41 + length])
    assert len(pixels) == 512 * (1 + 512 * 3)
    rgb = b"".join(pixels[row * 1537 + 1 : (row + 1) * 1537] for row in range(512))  # without each row's filter byte
    assert len({rgb[i : i + 3] for i in range(0, len(rgb), 3)}) == 2  # a background and an ink


@pytest.mark.anyio
async def test_the_tools_the_manifest_shows_are_tools_the_server_lists(bundle: Path) -> None:
    with zipfile.ZipFile(bundle) as archive:
        shown = {tool["name"] for tool in json.loads(archive.read("manifest.json"))["tools"]}
    async with running(FakeAgent(), settings()) as (service, _), Client(build_server(service)) as client:
        listed = {tool.name for tool in (await client.list_tools()).tools}
    assert shown and shown <= listed


def test_the_command_line_writes_the_bundle_and_prints_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bundle", "--out", str(tmp_path / "dist")]) == 0
    path, digest = capsys.readouterr().out.split("\n")[:2]
    assert digest == f"sha256 {hashlib.sha256(Path(path).read_bytes()).hexdigest()}"
    assert Path(path).parent == tmp_path / "dist" and [p.name for p in (tmp_path / "dist").iterdir()] == [
        Path(path).name
    ]


def test_a_checkout_is_the_source_next_to_its_pyproject() -> None:
    assert source().images == REPO / "images"


@needs_mcpb
def test_the_bundle_cli_validates_reads_and_repacks_the_bundle(bundle: Path, tmp_path: Path) -> None:
    info = mcpb("info", bundle, cwd=tmp_path)
    assert "mcp-code-exec" in info or bundle.name in info
    unpacked = tmp_path / "unpacked"
    mcpb("unpack", bundle, unpacked, cwd=tmp_path)
    with zipfile.ZipFile(bundle) as archive:
        assert sorted(archive.namelist()) == sorted(
            path.relative_to(unpacked).as_posix() for path in unpacked.rglob("*") if path.is_file()
        )
    assert "Manifest schema validation passes" in mcpb("validate", unpacked / "manifest.json", cwd=tmp_path)
    mcpb("pack", unpacked, tmp_path / "repacked.mcpb", cwd=tmp_path)
    assert (tmp_path / "repacked.mcpb").stat().st_size > 100_000


@needs_mcpb
def test_the_bundle_cli_refuses_a_manifest_it_should(bundle: Path, tmp_path: Path) -> None:
    """The check can fail: without ``mcp_config`` the CLI's 0.4 schema refuses a ``uv`` server."""
    with zipfile.ZipFile(bundle) as archive:
        manifest = json.loads(archive.read("manifest.json"))
        (tmp_path / "icon.png").write_bytes(archive.read("icon.png"))
    del manifest["server"]["mcp_config"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    done = subprocess.run(
        [str(MCPB), "validate", str(tmp_path / "manifest.json")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "mcp_config" in done.stdout + done.stderr
