"""``[code_mode]``: the upstream MCP servers that sandbox code may call (``import mcp_tools``), who
may call them, and the budgets of one run. Checked as the file loads: a bad entry is one clear line
at start, never a failure at the first call.

A stdio upstream runs on the host, so nothing a sandbox can write may decide what it runs: its
``cwd`` (where ``python3 -m NAME`` finds ``NAME.py`` first) and its program may not be in or hold a
writable ``[[mounts]]`` directory, and no place its arguments or environment name (``--repository
DIR``, where git runs the ``core.fsmonitor`` of ``DIR/.git/config``; ``PYTHONPATH``; the ``PATH`` it
finds ``git`` on) may lie in one (``upstream_refusal``); without ``cwd`` it starts in a private
empty directory, never the server's own working directory."""

from __future__ import annotations

import keyword
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .mounts import overlap
from .principals import principal_matches
from .sections import Section
from .units import MIB

SERVER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")
ENV_REFERENCE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")  # a header value taken from the host's environment
MAX_SERVERS = 32


def refused(message: str) -> PydanticCustomError:
    return PydanticCustomError("code_mode", message)


class UpstreamServer(Section):
    name: str = Field(description="the name sandbox code uses: mcp_tools.<name>.<tool>(...)")
    command: str | None = Field(None, description="stdio: the program to start (on PATH, or a path)")
    args: list[str] = Field(default_factory=list, description="stdio: its arguments")
    env: dict[str, str] = Field(
        default_factory=dict, description="stdio: its environment besides the SDK's default (PATH, HOME, ...)"
    )
    cwd: str | None = Field(
        None, description="stdio: its working directory (absolute, or under ~); default: a private empty one"
    )
    url: str | None = Field(None, description="streamable HTTP: the server's URL")
    headers: dict[str, str] = Field(
        default_factory=dict, description='HTTP headers; a value "${NAME}" is read from the host environment'
    )
    allow: list[str] = Field(default_factory=list, description="tool-name globs called without asking")
    ask: list[str] = Field(default_factory=list, description="tool-name globs that need a human's approval")
    deny: list[str] = Field(default_factory=list, description="tool-name globs never called")
    principals: list[str] | None = Field(
        None,
        description='who may use this server (default: all): a token name, "local" (every stdio client), '
        '"local:NAME" or "user:NAME" (one stdio identity)',
    )

    @field_validator("name")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not SERVER_NAME.match(value) or keyword.iskeyword(value):
            raise refused(f"{value[:60]!r} is not a Python identifier of at most 40 characters (sandbox code uses it)")
        return value

    @field_validator("command")
    @classmethod
    def _exists(cls, value: str | None) -> str | None:
        if value is not None and shutil.which(value) is None:
            raise refused(f"the command {value[:200]!r} does not exist or is not executable")
        return value

    @field_validator("cwd")
    @classmethod
    def _resolved(cls, value: str | None) -> str | None:
        """Resolved once, here: what is checked against the mounts is where it starts."""
        if value is None:
            return None
        path = Path(value).expanduser()
        if not path.is_absolute():
            raise refused(f"cwd {value[:200]!r} is not an absolute path (start it with / or ~/)")
        if not path.is_dir():
            raise refused(f"cwd {value[:200]!r} is not a directory")
        return str(path.resolve())

    @field_validator("headers")
    @classmethod
    def _variables_exist(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        environ = (info.context or {}).get("environ", os.environ)
        for header, text in value.items():
            reference = ENV_REFERENCE.match(text)
            if reference and reference.group(1) not in environ:
                raise refused(f"header {header!r} names ${{{reference.group(1)}}}, which is not set")
        return value

    @model_validator(mode="after")
    def _one_transport(self) -> UpstreamServer:
        if (self.command is None) == (self.url is None):
            raise refused(f"server {self.name!r}: give either command (stdio) or url (streamable HTTP)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise refused(f"server {self.name!r}: url must be http:// or https://")
        return self

    def header_values(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        """The headers with ``${NAME}`` read from the host environment (only ever sent upstream)."""
        environ = dict(os.environ) if environ is None else environ
        values = {}
        for header, text in self.headers.items():
            reference = ENV_REFERENCE.match(text)
            values[header] = environ.get(reference.group(1), "") if reference else text
        return values

    def open_to(self, identity: str) -> bool:
        return principal_matches(identity, self.principals)


class CodeModeSettings(Section):
    servers: list[UpstreamServer] = Field(default_factory=list, max_length=MAX_SERVERS, description="upstream servers")
    ask_timeout_s: float = Field(300.0, gt=0, le=3600, description="how long a call waits for a human's approval")
    max_calls: int = Field(
        50,
        ge=1,
        le=10_000,
        description="tool calls per run (refused ones too); a run that sends twice as many is stopped",
    )
    max_in_flight: int = Field(4, ge=1, le=64, description="tool calls of one run at the same time")
    call_timeout_s: float = Field(30.0, gt=0, le=3600, description="one tool call's time limit")
    max_result_kb: int = Field(
        256, ge=1, le=16_384, description="a tool result's size in the sandbox (head and tail kept)"
    )
    start_timeout_s: float = Field(20.0, gt=0, le=300, description="an upstream's start and handshake")
    max_answer_mb: int = Field(
        4,
        ge=1,
        le=256,
        description="the most read of one upstream message: a larger answer is dropped unread and its call "
        "fails (what the sandbox gets is then capped by max_result_kb)",
    )

    @property
    def max_answer_bytes(self) -> int:
        return self.max_answer_mb * MIB

    @model_validator(mode="after")
    def _answers_hold_a_result(self) -> CodeModeSettings:
        if self.max_answer_mb << 10 < self.max_result_kb:
            raise refused(
                f"max_answer_mb ({self.max_answer_mb}) is less than max_result_kb ({self.max_result_kb} KiB): "
                "no answer that large could be read"
            )
        return self

    @field_validator("servers")
    @classmethod
    def _distinct(cls, value: list[UpstreamServer]) -> list[UpstreamServer]:
        names = [server.name for server in value]
        for name in names:
            if names.count(name) > 1:
                raise refused(f"two servers are named {name!r}")
        return value

    def servers_for(self, identity: str) -> list[UpstreamServer]:
        return [server for server in self.servers if server.open_to(identity)]


def upstream_refusal(
    settings: CodeModeSettings, writable: Iterable[Path], environ: Mapping[str, str] | None = None
) -> str | None:
    """Why a stdio upstream cannot start as configured beside these writable mounts, or None: its
    working directory (``python3 -m NAME`` imports ``NAME.py`` from there first) and its program must
    not be in, nor hold, a directory sandboxes write to; nor may any place its arguments, its
    environment or the ``PATH`` it inherits (``environ``'s) name lie in one. What an upstream does
    with a path it is given cannot be known here (git runs hooks and ``core.fsmonitor`` from a
    repository's own configuration; ``PYTHONPATH`` is imported from; ``PATH`` is run from), so every
    place it is told of counts."""
    mounts = list(writable)
    inherited = (environ if environ is not None else os.environ).get("PATH", "")
    for server in settings.servers:
        if server.command is None:
            continue
        program = shutil.which(server.command)
        places = [("cwd", Path(server.cwd))] if server.cwd is not None else []
        places += [("command", Path(os.path.realpath(program)))] if program is not None else []
        for what, place in places:
            for mount in mounts:
                if overlap(place, mount):
                    return (
                        f"code_mode server {server.name!r}: its {what} {place} overlaps the writable mount {mount}; "
                        "sandboxes could plant what it runs on the host"
                    )
        why = _named_refusal(server, mounts, inherited)
        if why is not None:
            return why
    return None


def _named_refusal(server: UpstreamServer, mounts: list[Path], inherited_path: str) -> str | None:
    base = Path(server.cwd) if server.cwd is not None else Path(tempfile.gettempdir()) / "upstream"
    values = [(f"argument {index + 1}", arg) for index, arg in enumerate(server.args)]
    values += [(f"env {key}", value) for key, value in server.env.items()]
    if "PATH" not in server.env:
        values.append(("inherited PATH", inherited_path))
    for what, value in values:
        for place in named_places(value, base):
            for mount in mounts:
                if place == mount or mount in place.parents:
                    return (
                        f"code_mode server {server.name!r}: its {what} names {place}, in the writable mount {mount}; "
                        "sandboxes could plant what it runs or reads as configuration on the host (mount it "
                        "read-only, or give the server a place outside writable mounts)"
                    )
    return None


PATH_SEPARATORS = re.compile(r"[\s=,;'\"" + re.escape(os.pathsep) + r"]+")


def named_places(value: str, base: Path) -> list[Path]:
    """Every host path a configured argument or environment value may name, resolved: the whole
    value, and each piece between separators (``--opt=PATH``, a ``PATH``-like list, the words of a
    ``sh -c`` line, a ``file:`` URL's path); ``~`` expanded, a relative one from ``base``, where the
    upstream starts. A piece that names no place names one under ``base`` (never in a mount, which
    may not hold ``base``) unless it climbs out with ``..``, which is then judged where it lands."""
    pieces = {value, *PATH_SEPARATORS.split(value)}
    places = []
    for piece in pieces:
        piece = piece.removeprefix("file:")
        if not piece or "\0" in piece:
            continue
        path = Path(os.path.expanduser(piece))
        places.append(Path(os.path.realpath(path if path.is_absolute() else base / path)))
    return places
