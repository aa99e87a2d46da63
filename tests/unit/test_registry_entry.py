"""``server.json``, this server's entry in the MCP Registry, keeps the rules the registry checks on
publishing (its 2025-12-11 schema, and the rules around it), written out here rather than copied,
and agrees with the README's ``mcp-name`` marker (the registry's proof that the PyPI package is
this server's) and with the project's version.

``OWNER`` stands for the GitHub account that publishes it, in every place that names it; the mcpb
package's ``fileSha256`` is all zeros until then, and must be the released file's once an owner is
set (docs/clients.md, "The MCP Registry")."""

from __future__ import annotations

import copy
import json
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft7Validator  # type: ignore[import-untyped]

REPO = Path(__file__).resolve().parents[2]
PLACEHOLDER_OWNER = "OWNER"
PLACEHOLDER_SHA256 = "0" * 64
VERSION = r"^\d+\.\d+\.\d+(?:[-+][0-9A-Za-z.+-]+)?$"  # an exact version: no range, no "latest"
STRING = {"type": "string", "minLength": 1}
RULES: dict[str, Any] = {
    "type": "object",
    "required": ["name", "description", "version"],
    "properties": {
        "name": {"type": "string", "minLength": 3, "maxLength": 200, "pattern": r"^[a-zA-Z0-9.-]+/[a-zA-Z0-9._-]+$"},
        "title": {"type": "string", "minLength": 1, "maxLength": 100},
        "description": {"type": "string", "minLength": 1, "maxLength": 100},
        "version": {"type": "string", "maxLength": 255, "pattern": VERSION},
        "repository": {"type": "object", "required": ["url", "source"]},
        "packages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["registryType", "identifier", "transport"],
                "properties": {
                    "registryType": {"enum": ["npm", "pypi", "oci", "nuget", "mcpb"]},
                    "identifier": STRING,
                    "version": {"type": "string", "pattern": VERSION},
                    "transport": {
                        "type": "object",
                        "required": ["type"],
                        "properties": {"type": {"enum": ["stdio", "streamable-http", "sse"]}},
                    },
                    "fileSha256": {"type": "string", "pattern": "^[a-f0-9]{64}$"},
                    "environmentVariables": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"format": {"enum": ["string", "number", "boolean", "filepath"]}},
                        },
                    },
                },
            },
        },
    },
}
MARKER = re.compile(r"mcp-name:\s*(\S+?)(?=\s|-->|<|$)")


def problems(server: dict[str, Any], readme: str, version: str) -> list[str]:
    found = [f"{list(error.absolute_path)}: {error.message}" for error in Draft7Validator(RULES).iter_errors(server)]
    if found:
        return found
    owner = server["name"].removeprefix("io.github.").split("/")[0]
    marker = MARKER.search(readme)
    if marker is None or marker.group(1) != server["name"]:
        found.append(f"the README's mcp-name marker is {marker and marker.group(1)!r}, not {server['name']!r}")
    if not server["name"].startswith("io.github.") or f"github.com/{owner}/" not in server["repository"]["url"]:
        found.append("the name's namespace is not the repository's GitHub owner")
    versions = {server["version"], *(package.get("version") for package in server["packages"])}
    if versions != {version}:
        found.append(f"versions {sorted(map(str, versions))} are not the project's {version}")
    for package in server["packages"]:
        if package["registryType"] != "mcpb":
            continue
        url = f"https://github.com/{owner}/mcp-code-exec/releases/download/v{version}/mcp-code-exec-{version}.mcpb"
        if package["identifier"] != url or "mcp" not in package["identifier"]:
            found.append(f"the mcpb package is not the release's asset {url}")
        sha = package.get("fileSha256")
        if sha is None or (sha == PLACEHOLDER_SHA256 and owner != PLACEHOLDER_OWNER):
            found.append("the mcpb package needs the released file's fileSha256 (mcp-code-exec bundle prints it)")
    return found


def committed() -> tuple[dict[str, Any], str, str]:
    server = json.loads((REPO / "server.json").read_text())
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return server, (REPO / "README.md").read_text(), version


def test_server_json_keeps_the_registrys_rules_and_agrees_with_the_readme_and_the_version() -> None:
    assert problems(*committed()) == []


def set_owner(server: dict[str, Any], readme: str) -> str:
    text = json.dumps(server).replace(PLACEHOLDER_OWNER, "someone")
    server.clear()
    server.update(json.loads(text))
    return readme.replace(PLACEHOLDER_OWNER, "someone")


def mcpb(server: dict[str, Any]) -> dict[str, Any]:
    return next(package for package in server["packages"] if package["registryType"] == "mcpb")


DELETE = object()


def put(target: dict[str, Any], key: str, value: object, readme: str) -> str:
    """Change ``server`` in place (``DELETE``: remove the key); the README stays as it is."""
    if value is DELETE:
        del target[key]
    else:
        target[key] = value
    return readme


BREAKS: dict[str, Callable[[dict[str, Any], str], str]] = {
    "a description over 100 characters": lambda s, r: put(s, "description", "x" * 101, r),
    "version latest": lambda s, r: put(s, "version", "latest", r),
    "a version range": lambda s, r: put(s["packages"][0], "version", "^0.1.0", r),
    "two slashes in the name": lambda s, r: put(s, "name", "io.github.OWNER/mcp/code", r),
    "no description": lambda s, r: put(s, "description", DELETE, r),
    "a package without transport": lambda s, r: put(s["packages"][0], "transport", DELETE, r),
    "an unknown transport": lambda s, r: put(s["packages"][0], "transport", {"type": "pipe"}, r),
    "no fileSha256": lambda s, r: put(mcpb(s), "fileSha256", DELETE, r),
    "an upper-case fileSha256": lambda s, r: put(mcpb(s), "fileSha256", "A" * 64, r),
    "the placeholder hash with an owner set": set_owner,
    "another asset": lambda s, r: put(mcpb(s), "identifier", "https://example.com/code-exec.zip", r),
    "another namespace": lambda s, r: put(s, "name", "io.gitlab.OWNER/mcp-code-exec", r),
    "a README naming another server": lambda s, r: r.replace("OWNER/mcp-code-exec", "OWNER/other"),
    "a README marker run into a full stop": lambda s, r: r.replace("OWNER/mcp-code-exec -->", "OWNER/mcp-code-exec."),
}


@pytest.mark.parametrize("change", BREAKS.values(), ids=BREAKS.keys())
def test_the_rules_refuse_what_the_registry_refuses(change: Callable[[dict[str, Any], str], str]) -> None:
    server, readme, version = committed()
    server = copy.deepcopy(server)
    assert problems(server, change(server, readme), version) != []


def test_a_version_bump_must_reach_server_json() -> None:
    server, readme, _ = committed()
    assert problems(server, readme, "9.9.9") != []
