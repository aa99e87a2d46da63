"""``mcp-code-exec bundle``: this server as an MCP Bundle (``.mcpb``), the file Claude Desktop's
extension installer takes (docs/clients.md, "The bundle").

A bundle is a zip with ``manifest.json`` at its root. Its server type is ``uv`` (manifest 0.4): the
host installs Python and the dependencies from the bundle's ``pyproject.toml``, which is the only
type that carries compiled dependencies (pydantic, cryptography) to every platform. It holds the
package as installed (the image's build context inside it, as a wheel has it), a ``pyproject.toml``
made from the installation's own metadata, ``server/main.py`` and an icon. The same tree gives the
same bytes (sorted entries, fixed times and modes), so its SHA-256 can be given in ``server.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tomllib
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAME = "mcp-code-exec"
PACKAGE = Path(__file__).resolve().parents[1]
ENTRY_POINT = "server/main.py"
MAIN = '''"""The bundle's entry point: the MCP server on stdio (the host runs it with uv, in the bundle's
own environment). Given arguments, it is the command line (``image build`` builds the sandbox image)."""

import sys

from mcp_code_exec.commands.cli import main

sys.exit(main(sys.argv[1:]))
'''
IGNORED = ("__pycache__", "*.pyc", "*.pyo", ".mypy_cache", ".pytest_cache", ".ruff_cache")
MCPBIGNORE = "".join(f"{pattern}\n" for pattern in (".venv/", "__pycache__/", "*.pyc", "uv.lock"))
ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # the zip format's first date: the bundle's bytes do not depend on when it was made
TOOLS = {  # what the extension installer shows before the server runs (the server lists its own)
    "run_python": "Run Python code, statelessly or in a session: output, the last value, figures, files",
    "get_run": "Follow a run that is still going",
    "new_session": "Open a session whose variables, imports and files persist between calls",
    "list_files": "List the files a run or a session wrote",
    "read_file": "Read a file a run or a session wrote",
    "view_session": "Show a session as a notebook",
}


IMAGES = ("python", "egress")  # the sandbox's image and the egress proxy's


@dataclass(frozen=True)
class Source:
    """What the bundle is made of: this package and the image's build context, with the metadata
    of the project it was installed from."""

    images: Path
    version: str
    requires_python: str
    dependencies: list[str]


def source() -> Source:
    """A source checkout (``pyproject.toml`` beside the package), else the installed distribution."""
    root = PACKAGE.parent
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        project = None
    if project is not None and project.get("name") == NAME:
        return Source(root / "images", project["version"], project["requires-python"], project["dependencies"])
    from importlib import metadata

    distribution = metadata.distribution(NAME)
    # The extras' requirements are marked with `extra == "..."`: the bundle installs none of them.
    plain = [line for line in distribution.requires or [] if "extra ==" not in line.replace("'", '"')]
    requires_python = distribution.metadata["Requires-Python"] or ">=3.11"
    return Source(PACKAGE / "_images", distribution.version, requires_python, plain)


def manifest(made_from: Source) -> dict[str, Any]:
    return {
        "manifest_version": "0.4",
        "name": NAME,
        "display_name": "Python code interpreter (Docker sandboxes)",
        "version": made_from.version,
        "description": "Runs model-written Python in hardened Docker containers: output, figures, files, sessions.",
        "long_description": (
            "Needs a Docker engine (Docker Desktop, Colima, Podman, OrbStack) and the sandbox image, built once "
            "with `mcp-code-exec image build` of the same version; the server says so while it is missing."
        ),
        "author": {"name": "mcp-code-exec"},
        "license": "MIT",
        "icon": "icon.png",
        "keywords": ["python", "code-interpreter", "sandbox", "docker", "jupyter"],
        "server": {
            "type": "uv",
            "entry_point": ENTRY_POINT,
            # Hosts that run uv themselves need no more; the bundle CLI's schema (2.1.2) requires it for "uv".
            "mcp_config": {
                "command": "uv",
                "args": ["run", "--directory", "${__dirname}", "--no-dev", ENTRY_POINT],
                # Empty when the user names no file: the server reads an empty variable as unset.
                "env": {"MCP_CODE_EXEC_CONFIG": "${user_config.config_file}"},
            },
        },
        "tools_generated": True,
        "tools": [{"name": name, "description": text} for name, text in TOOLS.items()],
        "user_config": {
            "config_file": {
                "type": "file",
                "title": "Configuration file",
                "description": "An mcp-code-exec TOML file (optional; engine_wait_s = 120 waits for Docker at login)",
                "required": False,
                "default": "",
            }
        },
        "compatibility": {"platforms": ["darwin", "linux", "win32"], "runtimes": {"python": made_from.requires_python}},
    }


def pyproject(made_from: Source) -> str:
    """The project uv installs: the package (its image context inside) and its dependencies."""
    strings = json.dumps  # a JSON string is a TOML basic string
    dependencies = "".join(f"    {strings(line)},\n" for line in made_from.dependencies)
    return (
        '[build-system]\nrequires = ["hatchling>=1.21"]\nbuild-backend = "hatchling.build"\n\n'
        f"[project]\nname = {strings(NAME)}\nversion = {strings(made_from.version)}\n"
        f"requires-python = {strings(made_from.requires_python)}\ndependencies = [\n{dependencies}]\n\n"
        '[tool.hatch.build.targets.wheel]\npackages = ["mcp_code_exec"]\n'
    )


def stage(made_from: Source, directory: Path) -> None:
    """Lay the bundle's files out in ``directory`` (which must not exist)."""
    ignored = shutil.ignore_patterns(*IGNORED)
    shutil.copytree(PACKAGE, directory / "mcp_code_exec", ignore=shutil.ignore_patterns(*IGNORED, "_images"))
    for image in IMAGES:  # the build contexts, where the wheel puts them
        shutil.copytree(made_from.images / image, directory / "mcp_code_exec" / "_images" / image, ignore=ignored)
    (directory / "server").mkdir()
    (directory / ENTRY_POINT).write_text(MAIN)
    (directory / "pyproject.toml").write_text(pyproject(made_from))
    (directory / "icon.png").write_bytes(icon())
    (directory / ".mcpbignore").write_text(MCPBIGNORE)
    (directory / "manifest.json").write_text(json.dumps(manifest(made_from), indent=2) + "\n")


def build(out: Path) -> tuple[Path, str]:
    """Write ``OUT/mcp-code-exec-VERSION.mcpb``; return its path and SHA-256."""
    import tempfile

    made_from = source()
    out.mkdir(parents=True, exist_ok=True)
    bundle = out / f"{NAME}-{made_from.version}.mcpb"
    with tempfile.TemporaryDirectory(prefix="mcp-code-exec-bundle-") as work:
        tree = Path(work) / "bundle"
        stage(made_from, tree)
        temporary = out / f".{bundle.name}.{os.getpid()}.tmp"
        try:
            zip_tree(tree, temporary)
            os.replace(temporary, bundle)
        finally:
            temporary.unlink(missing_ok=True)
    return bundle, hashlib.sha256(bundle.read_bytes()).hexdigest()


def zip_tree(tree: Path, destination: Path) -> None:
    """Zip ``tree`` so that the same files always give the same bytes."""
    files = sorted(path for path in tree.rglob("*") if path.is_file())
    with zipfile.ZipFile(destination, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for path in files:
            info = zipfile.ZipInfo(path.relative_to(tree).as_posix(), date_time=ZIP_TIME)
            info.create_system = 3  # Unix, so the mode below means the same wherever it was made
            info.external_attr = 0o100644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())


def icon(size: int = 512) -> bytes:
    """The bundle's icon, a prompt (``>_``) on a dark square, as a PNG made without an imaging library."""
    background, ink = b"\x1e\x28\x3c", b"\xf0\xc8\x3c"
    unit = size // 16
    rows = []
    for y in range(size):
        row = bytearray(background * size)
        lean = abs(y - size // 2)
        if lean <= 4 * unit:  # the chevron: two strokes meeting at the middle of its height
            start = 3 * unit + (4 * unit - lean)
            row[3 * start : 3 * (start + 2 * unit)] = ink * (2 * unit)
        if 11 * unit <= y < 12 * unit + unit // 2:  # the underscore
            row[3 * 9 * unit : 3 * 13 * unit] = ink * (4 * unit)
        rows.append(b"\x00" + bytes(row))  # each row: filter type 0, then RGB pixels

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    body = zlib.compress(b"".join(rows), 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")
