"""``mcp-code-exec install HOST`` and ``uninstall HOST``: this server's entry in a desktop host's
configuration file, merged with what is there (docs/clients.md, "One-step install").

The file is the user's: only our key changes. A file that is not plain JSON (a comment, a trailing
comma, a broken edit) is refused with one sentence and left untouched; otherwise the file as it
was is copied byte for byte beside it (``NAME.mcp-code-exec.bak``) before the new one replaces it
in one step (a host never reads half a file), with the same mode. Standard library only: the
command line builds its parser from here before it chooses the stdio front.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOST_NAMES = ("claude-desktop", "claude-code", "vscode", "cursor")  # hosts.HOSTS, without importing it
DEFAULT_NAME = "python"
BACKUP_SUFFIX = ".mcp-code-exec.bak"
BOM = b"\xef\xbb\xbf"


def add_parsers(commands: Any) -> None:
    """``install``, ``uninstall`` and ``bundle`` on the command line's subparsers."""
    name_help = f"the server's key in the file (default {DEFAULT_NAME})"
    install = commands.add_parser("install", help="add this server to a desktop host's configuration")
    install.add_argument("host", choices=HOST_NAMES)
    install.add_argument("--name", default=DEFAULT_NAME, help=name_help)
    install.add_argument("--config", help="configuration file (TOML) the entry names; also MCP_CODE_EXEC_CONFIG")
    install.add_argument("--print", dest="print_only", action="store_true", help="print the entry; change nothing")
    uninstall = commands.add_parser("uninstall", help="remove this server from a desktop host's configuration")
    uninstall.add_argument("host", choices=HOST_NAMES)
    uninstall.add_argument("--name", default=DEFAULT_NAME, help=name_help)
    bundle = commands.add_parser("bundle", help="build the .mcpb bundle (Claude Desktop's extension installer)")
    bundle.add_argument("--out", default="dist", help="directory to write it to (default: dist)")


def run(args: argparse.Namespace) -> int:
    from .hosts import HOSTS, InstallRefused, Place, entry, entry_env, server_command

    try:
        if args.command == "bundle":
            from .bundle import build

            path, digest = build(Path(args.out))
            print(f"{path}\nsha256 {digest}")
            return 0
        host, place = HOSTS[args.host], Place.here()
        path = host.locate(place)
        if args.command == "uninstall":
            say(uninstall(path, host.servers_key, args.name))
            return 0
        env = entry_env(args.config, place.environ)
        value = entry(host, server_command(env), env)
        if args.print_only:
            print(json.dumps(value, indent=2))
            say(f'this goes in {path}, as "{host.servers_key}" → "{args.name}"')
            return 0
        say(install(path, host.servers_key, args.name, value) + f"; restart {host.title} to start it")
        return 0
    except (InstallRefused, OSError) as exc:
        say(str(exc))
        return 1


def say(message: str) -> None:
    print(f"mcp-code-exec: {message}", file=sys.stderr)


@dataclass
class Document:
    """A configuration file as read: its bytes (None: no file yet), and its JSON object."""

    path: Path
    original: bytes | None
    content: dict[str, Any]


def install(path: Path, servers_key: str, name: str, value: dict[str, Any]) -> str:
    """Put ``value`` under ``servers_key`` → ``name`` in ``path``; say what was done."""
    from .hosts import InstallRefused, is_ours

    document = read(path, servers_key)
    servers = document.content.setdefault(servers_key, {})
    if name in servers and not is_ours(servers[name]):
        raise InstallRefused(
            f'{path} already has a server "{name}" that is not mcp-code-exec; it was left untouched '
            "(--name chooses another key)"
        )
    if servers.get(name) == value:
        return f'"{name}" in {path} is already this entry; nothing changed'
    servers[name] = value
    backup = write(document)
    if backup is None:
        return f'wrote {path} with "{name}"'
    return f'added "{name}" to {path} (the file as it was: {backup})'


def uninstall(path: Path, servers_key: str, name: str) -> str:
    """Remove ``servers_key`` → ``name`` from ``path`` if it is ours; say what was done."""
    from .hosts import InstallRefused, is_ours

    if not path.exists():
        return f"there is no {path}; nothing changed"
    document = read(path, servers_key)
    servers = document.content.get(servers_key, {})
    if name not in servers:
        return f'{path} has no server "{name}"; nothing changed'
    if not is_ours(servers[name]):
        raise InstallRefused(f'"{name}" in {path} is not mcp-code-exec; it was left untouched')
    del servers[name]
    return f'removed "{name}" from {path} (the file as it was: {write(document)})'


def read(path: Path, servers_key: str) -> Document:
    """The file's JSON, refused (with one sentence naming it) unless it is plain JSON holding an
    object, whose ``servers_key`` (if there) is an object too."""
    from .hosts import InstallRefused

    target = path.resolve()  # a link (dotfiles) stays a link: its target is the file rewritten
    try:
        original: bytes | None = target.read_bytes()
    except FileNotFoundError:
        original = None
    if original is None or not original.removeprefix(BOM).strip():
        return Document(target, original, {})
    untouched = "it was left untouched: fix it, or add the entry by hand (`--print` prints it)"
    try:
        text = original.removeprefix(BOM).decode("utf-8")
    except UnicodeDecodeError:
        raise InstallRefused(f"{path} is not UTF-8 text; {untouched}") from None
    try:
        content = json.loads(text)
    except json.JSONDecodeError as exc:
        near = text[exc.pos : exc.pos + 2]
        comment = " (a comment: JSON with comments is not plain JSON)" if near in ("//", "/*") else ""
        raise InstallRefused(
            f"{path} is not plain JSON ({exc.msg} at line {exc.lineno} column {exc.colno}{comment}); {untouched}"
        ) from None
    if not isinstance(content, dict):
        raise InstallRefused(f"{path} does not hold a JSON object; {untouched}")
    if not isinstance(content.get(servers_key, {}), dict):
        raise InstallRefused(f'"{servers_key}" in {path} is not a JSON object; {untouched}')
    return Document(target, original, content)


def write(document: Document) -> Path | None:
    """Replace the file in one step, in the layout it had (indent, line ends, a BOM), keeping its
    mode; first copy it as it was beside it. Returns the copy's path (None: there was no file)."""
    path, original = document.path, document.original
    mode, backup = 0o600, None  # a new file may come to hold other servers' tokens
    if original is not None:
        mode = path.stat().st_mode & 0o777
        backup = path.with_name(path.name + BACKUP_SUFFIX)
        replace(backup, original, mode)
    layout = original or b""
    text = json.dumps(document.content, indent=indent_of(layout), ensure_ascii=False)
    if not layout or layout.endswith(b"\n"):
        text += "\n"
    if b"\r\n" in layout:
        text = text.replace("\n", "\r\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    replace(path, (BOM if layout.startswith(BOM) else b"") + text.encode("utf-8"), mode)
    return backup


def indent_of(layout: bytes) -> str | int:
    """The indent of the file's first indented line: a tab (VS Code's), else its spaces (2 if none)."""
    found = re.search(rb"\n([ \t]+)\S", layout)
    if found is None:
        return 2
    return "\t" if found.group(1).startswith(b"\t") else len(found.group(1))


def replace(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a new file beside ``path`` (made with ``mode``, so never readable by more
    than that), then rename it over ``path``."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, mode)  # the umask narrowed what os.open made
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
