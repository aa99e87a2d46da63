"""The package's layers, as folders, and the one direction imports may run between them.

From the top: ``commands`` (the CLI, doctor, image builds, the benchmark) → ``mcp_server`` (the MCP
face) → ``service`` (runs, sessions, files, packages) → ``sandbox`` (one container and its agent,
the pool, volumes) → ``protocol`` and ``runtime`` (the wire to the agent; the engine port and its
adapters). ``config``, ``errors`` and ``models`` lie below all of them. A module may import its own
layer and any layer below, never one above. Two layers have rooms, sub-folders held to the same
rule inside the layer (``ROOMS``). The foreign libraries each have one home: ``docker``
only in ``runtime/docker``, ``mcp`` only in ``mcp_server`` and ``commands`` (the benchmark is an
MCP client), ``prometheus_client`` and ``opentelemetry`` only in ``observability``. This test is the source of truth for the layout; docs/development.md explains it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mcp_code_exec"

# Highest first. A layer is the first part of a module's path inside the package.
LAYERS = [
    "commands",
    "mcp_server",
    "service",
    "broker",
    "sandbox",
    "egress",
    "protocol|runtime",
    "ledger",
    "config|errors|models|observability",
]
# ``broker`` (code mode) is an MCP client of the upstream servers sandbox code calls, so it imports
# ``mcp`` too; it sits below the service, which wires it into runs, and above the sandbox, whose
# channel carries the calls. ``observability`` lies at the bottom with config: every layer records
# into it (runs in the service, pools in the sandbox layer, HTTP refusals in the MCP layer), and it
# needs nothing of theirs. ``ledger`` (quotas over time, the audit log, usage reports) is bookkeeping
# every layer above records into or admits through, and knows no engine: its counts are kept on the
# engine by the sandbox layer (``sandbox/ledgers``), which hands it a store.
# ``egress`` (the proxy sandboxes reach the network through) sits just above
# the engine port, whose adapter runs its container: the sandbox layer starts sandboxes with its
# socket and variables, the service gives each run its grant, and it knows neither.
HOMES = {
    "docker": ("runtime/docker",),
    "mcp": ("mcp_server", "commands", "broker"),
    "prometheus_client": ("observability",),
    "opentelemetry": ("observability",),
}
# Rooms inside a layer, highest first ("." is the layer's own modules, outside its sub-folders): a
# module imports its own room and those below it in its layer, never one above. ``commands``: the
# CLI's commands, the benchmark, and the stdio front below both (it starts before anything heavy is
# imported: standard library only, which test_local_service.py holds). ``mcp_server``: the hosts
# mount the MCP surface (".") and it knows neither: ``http`` (SSE and streamable HTTP) and ``local``
# (the local service, and the server over stdio in one process, whose ``--metrics-port`` is the
# HTTP host's metrics listener).
ROOMS = {
    "commands": [".", "bench", "stdio"],
    "mcp_server": ["local", "http", "."],
}
TOP_LEVEL = {"__init__", "__main__"}  # the package's face and entry point may import anything


def layer_rank(part: str) -> int:
    for rank, names in enumerate(LAYERS):
        if part in names.split("|"):
            return rank
    raise AssertionError(f"mcp_code_exec/{part} belongs to no layer: add it to LAYERS in {Path(__file__).name}")


def room_of(layer: str, parts: list[str]) -> str:
    """The room of ``layer`` that the module ``parts`` (its path below the layer) is in."""
    return parts[0] if parts and parts[0] in ROOMS[layer] else "."


def climbs_a_room(layer: str, own: list[str], theirs: list[str]) -> str | None:
    """The room above its own that a module of ``layer`` reaches for, if it does."""
    mine, target = room_of(layer, own), room_of(layer, theirs)
    if ROOMS[layer].index(target) >= ROOMS[layer].index(mine):
        return None
    return layer if target == "." else f"{layer}/{target}"


def module_parts(path: Path) -> list[str]:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_modules(path: Path, source: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports, as a dotted name (relative imports resolved), with its line."""
    own = module_parts(path)
    package = own if path.name == "__init__.py" else own[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["mcp_code_exec", *package[: len(package) - (node.level - 1)]]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def violations(path: Path, source: str | None = None) -> list[str]:
    own = module_parts(path)
    where = f"{path.relative_to(PACKAGE.parent)}"
    if not own or own[0] in TOP_LEVEL:
        return []
    mine = layer_rank(own[0])
    found: list[str] = []
    reported: set[tuple[int, str]] = set()
    for line, module in imported_modules(path, path.read_text() if source is None else source):
        parts = module.split(".")
        if parts[0] in HOMES and not any("/".join(own).startswith(home) for home in HOMES[parts[0]]):
            found.append(f"{where}:{line} imports {parts[0]}, which only {' and '.join(HOMES[parts[0]])} may")
        if parts[0] != "mcp_code_exec" or len(parts) < 2 or parts[1] in TOP_LEVEL:
            continue
        try:
            theirs = layer_rank(parts[1])
        except AssertionError:
            continue  # a name imported from the package's face, not a module
        if theirs < mine and (line, parts[1]) not in reported:
            reported.add((line, parts[1]))
            found.append(f"{where}:{line} imports {module}: {own[0]} may not import the layer above it ({parts[1]})")
        room = climbs_a_room(own[0], own[1:], parts[2:]) if theirs == mine and own[0] in ROOMS else None
        if room is not None and (line, room) not in reported:
            reported.add((line, room))
            found.append(f"{where}:{line} imports {module}: a room may not import the room above it ({room})")
    return found


def test_every_import_runs_down_the_layers_and_foreign_libraries_stay_home() -> None:
    found = [problem for path in sorted(PACKAGE.rglob("*.py")) for problem in violations(path)]
    assert found == [], "\n".join(found)


def test_every_folder_of_the_package_is_a_known_layer() -> None:
    for path in PACKAGE.iterdir():
        if path.name.startswith(("_", ".")) or (path.is_file() and path.suffix != ".py"):
            continue
        layer_rank(path.stem)


def test_every_sub_folder_of_a_layer_with_rooms_is_a_known_room() -> None:
    for layer, rooms in ROOMS.items():
        folders = {path.name for path in (PACKAGE / layer).iterdir() if path.is_dir() and not path.name.startswith("_")}
        assert folders == set(rooms) - {"."}, f"add the rooms of {layer}/ to ROOMS in {Path(__file__).name}"


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "mcp_server/app.py",
            "from .http.host import serve_http\n",
            "may not import the room above it (mcp_server/http)",
        ),
        ("mcp_server/tools.py", "from .local import stdio\n", "may not import the room above it (mcp_server/local)"),
        ("mcp_server/http/host.py", "from ..local.stdio import serve_stdio\n", "the room above it (mcp_server/local)"),
        ("commands/stdio/front.py", "from ..cli import main\n", "may not import the room above it (commands)"),
        ("commands/stdio/front.py", "from ..bench import bench\n", "may not import the room above it (commands/bench)"),
    ],
)
def test_an_import_up_the_rooms_of_a_layer_is_caught(module: str, source: str, expected: str) -> None:
    """The surface mounted by the hosts never reaches for them, nor the stdio front for the CLI."""
    assert any(expected in problem for problem in violations(PACKAGE / module, source))


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from ..mcp_server import build_server\n", "may not import the layer above it (mcp_server)"),
        ("import docker\n", "imports docker, which only runtime/docker may"),
        ("from mcp import types\n", "imports mcp, which only mcp_server and commands and broker may"),
        ("import prometheus_client\n", "imports prometheus_client, which only observability may"),
        ("from opentelemetry import trace\n", "imports opentelemetry, which only observability may"),
    ],
)
def test_an_upward_or_foreign_import_is_caught(source: str, expected: str) -> None:
    """The check itself fails where it must: a module of the sandbox layer that reaches up or out."""
    assert any(expected in problem for problem in violations(PACKAGE / "sandbox" / "pool.py", source))


def test_the_package_face_exports_the_embedding_api_and_loads_it_on_first_use() -> None:
    import subprocess
    import sys

    probe = (
        "import sys, mcp_code_exec as m; assert 'docker' not in sys.modules and 'pydantic' not in sys.modules;"
        "assert m.SandboxService.__name__ == 'SandboxService' and callable(m.load_config);"
        "assert m.Config.__name__ == 'Config' and issubclass(m.SandboxError, Exception)"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=PACKAGE.parent)
