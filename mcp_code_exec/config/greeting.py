"""What the server says of its configuration at the handshake (the ``initialize`` answer's
instructions), from the loaded ``Config`` or straight from the configuration file.

Standard library only. The stdio front reads the file itself to answer a new client's handshake
before the service it starts has imported the MCP SDK (see ``commands/stdio/handshake.py``); the server
builds the same text from its ``Config``. Both go through ``instructions`` here, so they cannot say
different things; ``from_file`` reads only values of exactly the type the configuration takes and
gives up (None) on anything else, so whatever the front says, the service, validating the whole
file, would say too (or refuse the file, which the front then reports).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .mounts import NAME_PATTERN, MountRefused, host_directory, target

if TYPE_CHECKING:
    from .settings import Config

SERVER_NAME = "mcp-code-exec"
LIBRARIES = "numpy, pandas, matplotlib, scipy, sympy, pillow and IPython"
# The defaults of the settings read here (checked against ``Config`` by the unit tests).
DEFAULT_NETWORK = False
DEFAULT_INSTALLS = True
DEFAULT_WRITABLE = False


@dataclass(frozen=True)
class Mounted:
    name: str
    path: str  # resolved, as the server mounts it
    writable: bool


@dataclass(frozen=True)
class Greeting:
    network: bool
    installs: bool
    mounts: tuple[Mounted, ...]
    egress: bool = False  # [egress] allow names hosts


def from_config(config: Config) -> Greeting:
    return Greeting(
        network=config.network,
        installs=config.packages.enabled,
        mounts=tuple(Mounted(mount.name, str(mount.path), mount.writable) for mount in config.mounts),
        egress=config.egress.enabled,
    )


def from_file(
    settings: Mapping[str, object], *, environ: Mapping[str, str], config_file: str | None
) -> Greeting | None:
    """The greeting of the parsed configuration file ``settings``; None when a value it depends on
    is not plainly what the configuration takes (the service, loading the file, says what is wrong)."""
    network = settings.get("network", DEFAULT_NETWORK)
    packages = settings.get("packages", {})
    installs = packages.get("enabled", DEFAULT_INSTALLS) if isinstance(packages, dict) else None
    raw_mounts = settings.get("mounts", [])
    if not (isinstance(network, bool) and isinstance(installs, bool) and isinstance(raw_mounts, list)):
        return None
    egress = settings.get("egress", {})
    allow = egress.get("allow", []) if isinstance(egress, dict) else None
    if not isinstance(allow, list):
        return None
    mounts = []
    for raw in raw_mounts:
        if not isinstance(raw, dict):
            return None
        name, path, writable = raw.get("name"), raw.get("path"), raw.get("writable", DEFAULT_WRITABLE)
        if not (isinstance(name, str) and re.fullmatch(NAME_PATTERN, name)):
            return None
        if not (isinstance(path, str) and isinstance(writable, bool)):
            return None
        try:
            resolved = host_directory(path, environ=environ, config_file=config_file)
        except MountRefused:
            return None
        mounts.append(Mounted(name, os.fspath(resolved), writable))
    return Greeting(network=network, installs=installs, mounts=tuple(mounts), egress=bool(allow))


def instructions(greeting: Greeting) -> str:
    return (
        "Runs Python 3 code in isolated, resource-limited sandboxes.\n"
        f"- Preinstalled: {LIBRARIES}. "
        + (
            "Sandboxes have network access.\n"
            if greeting.network
            else "Sandboxes have no network, but HTTP(S) reaches the hosts the server allows, through its proxy.\n"
            if greeting.egress
            else "There is no network access.\n"
        )
        + ("- `%pip install NAME` in a cell installs more, from the server's own index.\n" if greeting.installs else "")
        + "- run_python without session_id is stateless: a fresh interpreter and an empty /mnt/data each "
        "call. new_session gives variables, imports and files that persist across calls.\n"
        "- /mnt/data is the working directory; files there are listed with each result and readable "
        "with read_file (session_id=... for a session, run_id=... for a stateless run).\n"
        "- A long run answers 'running' with a run_id: get_run(run_id) returns its output and result.\n"
        + (f"- {host_directories(greeting.mounts)}\n" if greeting.mounts else "")
    )


def host_directories(mounts: tuple[Mounted, ...]) -> str:
    """Where the user's mounted directories are, so "analyse ~/data/sales.xlsx" finds its file."""
    listed = "; ".join(
        f"{target(mount.name)} is {mount.path} on the user's machine ({'writable' if mount.writable else 'read-only'})"
        for mount in mounts
    )
    return (
        f"The user's own directories are mounted in every sandbox: {listed}. Read their files there directly "
        "(no upload needed); they are not under /mnt/data, so list_files and read_file do not see them."
    )
