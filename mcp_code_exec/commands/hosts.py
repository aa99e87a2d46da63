"""The desktop hosts ``install`` knows: where each keeps its MCP servers, the entry it expects, and
the command that entry starts (docs/clients.md, "One-step install").

Standard library only. Every place is computed from a ``Place`` (platform, home, environment), so
the tests lay out macOS, Windows and Linux homes in temporary directories.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__

SCRIPT = "mcp-code-exec"
# What a host started from the desktop has of the user's environment, at least: a GUI app on macOS
# does not inherit the shell's (no PYTHONPATH, no DOCKER_HOST, no virtualenv on the PATH).
DESKTOP_VARIABLES = ("HOME", "USER", "LOGNAME", "USERPROFILE", "APPDATA", "LOCALAPPDATA", "SYSTEMROOT", "TEMP", "TMP")
# The variables that choose the engine: carried into the entry when set where ``install`` runs.
ENGINE_VARIABLES = ("DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG")


class InstallRefused(Exception):
    """One sentence for the user; nothing was changed."""


@dataclass(frozen=True)
class Place:
    """Where ``install`` looks: the platform (``sys.platform``), the user's home, the environment."""

    platform: str
    home: Path
    environ: Mapping[str, str]

    @classmethod
    def here(cls) -> Place:
        return cls(sys.platform, Path.home(), os.environ)

    def directory(self, variable: str, default: Path) -> Path:
        """A directory an environment variable names (``~`` meaning this place's home), else ``default``."""
        value = self.environ.get(variable, "")
        if value == "~" or value.startswith(("~/", "~\\")):
            return self.home / value[2:]
        return Path(value) if value and os.path.isabs(value) else default

    def appdata(self) -> Path:
        return self.directory("APPDATA", self.home / "AppData" / "Roaming")

    def config_home(self) -> Path:
        """Linux's per-user configuration directory (XDG), where Electron apps keep their files."""
        return self.directory("XDG_CONFIG_HOME", self.home / ".config")

    def application_support(self) -> Path:
        return self.home / "Library" / "Application Support"


def claude_desktop_file(place: Place) -> Path:
    name = "claude_desktop_config.json"
    if place.platform == "darwin":
        return place.application_support() / "Claude" / name
    if place.platform == "win32":
        return (windows_package_directory(place) or place.appdata() / "Claude") / name
    return place.config_home() / "Claude" / name


def windows_package_directory(place: Place) -> Path | None:
    """Claude Desktop installed as an MSIX package (the Windows installer's default) reads its files
    from the package's own copy of %APPDATA%, not %APPDATA% itself: a file written there is never
    read. One package: its directory; several: the one that holds a configuration already."""
    packages = place.directory("LOCALAPPDATA", place.home / "AppData" / "Local") / "Packages"
    try:
        found = sorted(path for path in packages.glob("Claude_*") if path.is_dir())
    except OSError:
        return None
    directories = [path / "LocalCache" / "Roaming" / "Claude" for path in found]
    if len(directories) > 1:
        directories = [path for path in directories if (path / "claude_desktop_config.json").is_file()]
        if len(directories) != 1:
            names = ", ".join(str(path) for path in found)
            raise InstallRefused(f"several Claude Desktop packages are installed ({names}): edit the right one by hand")
    return directories[0] if directories else None


def claude_code_file(place: Place) -> Path:
    """User scope: the top-level ``mcpServers`` of ``.claude.json`` in ``$CLAUDE_CONFIG_DIR`` or the home."""
    return place.directory("CLAUDE_CONFIG_DIR", place.home) / ".claude.json"


def vscode_file(place: Place) -> Path:
    """The default profile's user ``mcp.json`` (VS Code 1.102 and later)."""
    if place.platform == "darwin":
        return place.application_support() / "Code" / "User" / "mcp.json"
    if place.platform == "win32":
        return place.appdata() / "Code" / "User" / "mcp.json"
    return place.config_home() / "Code" / "User" / "mcp.json"


def cursor_file(place: Place) -> Path:
    return place.home / ".cursor" / "mcp.json"


@dataclass(frozen=True)
class Host:
    title: str
    servers_key: str  # the object of the file that holds one entry per server
    typed: bool  # the entry says "type": "stdio"
    locate: Callable[[Place], Path]


HOSTS = {
    "claude-desktop": Host("Claude Desktop", "mcpServers", typed=False, locate=claude_desktop_file),
    "claude-code": Host("Claude Code", "mcpServers", typed=True, locate=claude_code_file),
    "vscode": Host("VS Code", "servers", typed=True, locate=vscode_file),
    "cursor": Host("Cursor", "mcpServers", typed=False, locate=cursor_file),
}


def entry(host: Host, command: list[str], env: Mapping[str, str]) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "stdio"} if host.typed else {}
    value |= {"command": command[0], "args": command[1:]}
    if env:
        value["env"] = dict(env)
    return value


def is_ours(value: object) -> bool:
    """Whether an entry already in a file starts this server (so ``install`` may replace it and
    ``uninstall`` remove it): the console script, or ``-m mcp_code_exec``."""
    if not isinstance(value, dict) or not isinstance(value.get("command"), str):
        return False
    program = Path(value["command"].replace("\\", "/")).name.lower().removesuffix(".exe")
    args = value.get("args")
    return program == SCRIPT or (isinstance(args, list) and "mcp_code_exec" in args)


def entry_env(config: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The entry's ``env``: the configuration file (``--config``, else MCP_CODE_EXEC_CONFIG where
    ``install`` runs) as an absolute path, and the variables that choose the engine, if set: the
    host does not see the shell they were set in."""
    env: dict[str, str] = {}
    config = config or environ.get("MCP_CODE_EXEC_CONFIG") or None
    if config is not None:
        path = os.path.abspath(config)
        try:
            with open(path, "rb") as file:
                tomllib.load(file)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InstallRefused(f"the configuration {path} cannot be used: {exc}") from None
        env["MCP_CODE_EXEC_CONFIG"] = path
    for name in ENGINE_VARIABLES:
        if environ.get(name):
            env[name] = os.path.abspath(environ[name]) if name == "DOCKER_CONFIG" else environ[name]
    return env


def console_scripts() -> list[Path]:
    """The installation's ``mcp-code-exec`` script: where its record says pip put it (a virtualenv,
    ``--user``, pipx, an editable install), then beside this interpreter."""
    from importlib import metadata

    found: list[Path] = []
    try:
        files = metadata.distribution(SCRIPT).files or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.parent.name in ("bin", "Scripts") and file.name.lower().removesuffix(".exe") == SCRIPT:
            found.append(Path(os.path.normpath(file.locate())))
    found.append(Path(sys.executable).parent / (f"{SCRIPT}.exe" if sys.platform == "win32" else SCRIPT))
    return list(dict.fromkeys(path for path in found if path.is_file()))


def server_command(
    env: Mapping[str, str], scripts: Iterable[Path] | None = None, python: str = sys.executable
) -> list[str]:
    """The absolute command the entry starts, tried first as the host will run it (``--version``
    from an empty directory, with a desktop app's environment and ``env``).

    The console script comes first: its own directory is its ``sys.path[0]``, never the directory
    the host starts it in, where a module a sandbox wrote could wait. Else ``python -I -m``
    (isolated: the working directory is not on the path). ``-I`` also leaves out the user's site
    directory, which is where ``pip install --user`` puts the package, so such an installation is
    served by its script (``~/.local/bin``), found through pip's record of it."""
    candidates = [[os.fspath(path)] for path in (console_scripts() if scripts is None else scripts)]
    candidates.append([python, "-I", "-m", "mcp_code_exec"])
    tried = []
    for command in candidates:
        why = starts(command, env)
        if why is None:
            return [*command, "serve"]
        tried.append(f"{' '.join(command)}: {why}")
    raise InstallRefused(
        f"no command starts this installation of mcp-code-exec as a desktop host would ({'; '.join(tried)}): "
        "install it (a virtual environment, pipx or `pip install --user` with its script), then run its install"
    )


def starts(command: list[str], env: Mapping[str, str]) -> str | None:
    """None if ``command --version`` names this version, run as a desktop host would; else why not."""
    import tempfile

    inherited = {name: os.environ[name] for name in DESKTOP_VARIABLES if name in os.environ}
    with tempfile.TemporaryDirectory(prefix="mcp-code-exec-install-") as empty:
        try:
            done = subprocess.run(
                [*command, "--version"],
                cwd=empty,
                env={"PATH": os.defpath, **inherited, **env},
                capture_output=True,
                text=True,
                timeout=120,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return str(exc)
    if done.returncode == 0 and done.stdout.split() == [SCRIPT, __version__]:
        return None
    said = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or [""])[-1]
    return f"exit {done.returncode} {said}".strip()
