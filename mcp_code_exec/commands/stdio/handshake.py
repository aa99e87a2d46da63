"""The answer to a client's handshake that a new front gives at once, before the service it reaches
has imported the MCP SDK (docs/development.md, "A stdio client's first second").

- Kept: the service writes its answer to each handshake request (``initialize``, or the 2026-07-28
  era's ``server/discover``), keyed by the request's method and exact params, to
  ``NAME.answers.json`` in its private directory. ``NAME`` hashes the package, its version, the
  interpreter and the configuration: only a service of this very build and configuration wrote it,
  and it answers the same request the same way (never depending on the engine).
- Composed, with none kept: the SDK's answer depends only on the protocol version, the server's
  capabilities and name, and the instructions, which ``config.greeting`` makes from the
  configuration file as the server makes them from its ``Config``. The unit tests hold it to the
  SDK's own answer for every version. A service that answers otherwise (another SDK under the same
  build) turns composing off for the build (``refuse_composing``).
- Anything else (another first request, a line that is not one JSON-RPC request, params the SDK
  would refuse) is the plain relay.

Standard library only, as the front is.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from ... import __version__
from ...config.greeting import SERVER_NAME

ANSWERED_METHODS = ("initialize", "server/discover")
MAX_FILE_BYTES = 256 * 1024
MAX_ANSWERS = 32  # different clients (each its own params); the oldest are dropped past this
FORMAT = 1
# The MCP SDK's ``initialize`` answer but for its instructions: the versions it negotiates (any other
# gets the latest) and the capabilities the server declares. The unit tests check both against the SDK.
INITIALIZE_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
LATEST_INITIALIZE_VERSION = "2025-11-25"
CAPABILITIES: dict[str, Any] = {
    "prompts": {"listChanged": False},
    "resources": {"listChanged": True, "subscribe": True},
    "tools": {"listChanged": False},
}
# The same for ``server/discover`` (the 2026-07-28 era): the versions it serves, the per-request
# ``_meta`` it reads, and the capabilities it declares there (its extensions included).
DISCOVER_VERSIONS = ("2026-07-28",)
DISCOVER_META = (
    "io.modelcontextprotocol/protocolVersion",
    "io.modelcontextprotocol/clientCapabilities",
    "io.modelcontextprotocol/clientInfo",
)
DISCOVER_CAPABILITIES: dict[str, Any] = {
    "extensions": {"io.modelcontextprotocol/tasks": {}, "io.modelcontextprotocol/ui": {}},
    "prompts": {"listChanged": True},
    "resources": {"listChanged": True, "subscribe": True},
    "tools": {"listChanged": True},
}


def request_key(message: object) -> str | None:
    """The key of a handshake request whose answer may be kept (method and exact params), else None."""
    if not isinstance(message, dict) or message.get("method") not in ANSWERED_METHODS:
        return None
    request_id = message.get("id")
    if not isinstance(request_id, str | int) or isinstance(request_id, bool):
        return None
    return json.dumps([message["method"], message.get("params")], sort_keys=True, separators=(",", ":"))


def load_answers(path: Path) -> dict[str, Any]:
    """The kept answers by request key; none when the file is missing, too big, not a regular file
    of ours or not what the service writes."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        info = os.fstat(handle)
        if not (info.st_uid == os.geteuid() and info.st_size <= MAX_FILE_BYTES and info.st_mode & 0o170000 == 0o100000):
            return {}
        data = json.loads(os.read(handle, MAX_FILE_BYTES + 1))
    except (OSError, ValueError):
        return {}
    finally:
        os.close(handle)
    answers = data.get("answers") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not isinstance(answers, dict):
        return {}
    return {key: result for key, result in answers.items() if isinstance(key, str) and isinstance(result, dict)}


def remember_answer(path: Path, request: dict[str, Any], result: dict[str, Any]) -> None:
    """Keep ``result`` as the answer to ``request`` (the service calls this, off its event loop).
    Written whole (a temporary file renamed over it), so a front reads the old file or the new one."""
    key = request_key(request)
    if key is None:
        return
    answers = load_answers(path)
    if answers.get(key) == result:
        return
    answers.pop(key, None)
    answers[key] = result
    while len(answers) > MAX_ANSWERS:
        answers.pop(next(iter(answers)))
    text = json.dumps({"format": FORMAT, "answers": answers}, separators=(",", ":")).encode()
    if len(text) > MAX_FILE_BYTES:
        return
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(handle, "wb") as file:
            file.write(text)
        os.replace(temporary, path)


def forget_answers(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def answer_line(request: dict[str, Any], result: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": result}).encode() + b"\n"


def answer_to(line: bytes, request_id: object) -> dict[str, Any] | None:
    """``line`` as the response to ``request_id`` (a result or an error), else None."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    if isinstance(message, dict) and message.get("id") == request_id and ("result" in message or "error" in message):
        return message
    return None


def read_first_line(fd: int, chunk: int) -> bytes:
    """The client's first bytes: up to and including its first line's end (a little more, perhaps),
    or all it sent before it closed; at most ``MAX_FILE_BYTES`` and a chunk."""
    buffer = bytearray()
    while b"\n" not in buffer and len(buffer) <= MAX_FILE_BYTES:
        try:
            data = os.read(fd, chunk)
        except OSError:
            break
        if not data:
            break
        buffer += data
    return bytes(buffer)


def first_request(first: bytes) -> dict[str, Any] | None:
    """The handshake request ``first`` begins with (a whole line), else None."""
    line, newline, _ = first.partition(b"\n")
    if not newline:
        return None
    try:
        request = json.loads(line)
    except ValueError:
        return None
    return request if request_key(request) is not None else None


def kept_answer(first: bytes, answers: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The client's first request and the kept answer to it, when ``first`` holds one that has one."""
    request = first_request(first)
    result = answers.get(request_key(request) or "") if request is not None else None
    return (request, result) if request is not None and result is not None else None


def composed_answer(first: bytes, instructions: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The client's first request and the SDK's answer to it, when it is an ``initialize`` or a
    ``server/discover`` whose params the SDK takes (those it would refuse get no answer here: the
    service answers them)."""
    request = first_request(first)
    params = request.get("params") if request is not None else None
    if request is None or not isinstance(params, dict):
        return None
    if request["method"] == "initialize":
        result = _initialize_result(params, instructions)
    else:
        result = _discover_result(params, instructions)
    return None if result is None else (request, result)


def _initialize_result(params: dict[str, Any], instructions: str) -> dict[str, Any] | None:
    version, capabilities, client = params.get("protocolVersion"), params.get("capabilities"), params.get("clientInfo")
    if not (isinstance(version, str) and isinstance(capabilities, dict) and _implementation(client)):
        return None
    return {
        "capabilities": json.loads(json.dumps(CAPABILITIES)),
        "instructions": instructions,
        "protocolVersion": version if version in INITIALIZE_VERSIONS else LATEST_INITIALIZE_VERSION,
        "serverInfo": {"name": SERVER_NAME, "version": __version__},
    }


def _discover_result(params: dict[str, Any], instructions: str) -> dict[str, Any] | None:
    meta = params.get("_meta")
    if set(params) != {"_meta"} or not isinstance(meta, dict) or set(meta) - set(DISCOVER_META):
        return None
    version, capabilities = meta.get(DISCOVER_META[0]), meta.get(DISCOVER_META[1])
    if version not in DISCOVER_VERSIONS or not isinstance(capabilities, dict):
        return None
    if DISCOVER_META[2] in meta and not _implementation(meta[DISCOVER_META[2]]):
        return None
    return {
        "cacheScope": "private",
        "capabilities": json.loads(json.dumps(DISCOVER_CAPABILITIES)),
        "instructions": instructions,
        "resultType": "complete",
        "supportedVersions": list(DISCOVER_VERSIONS),
        "ttlMs": 0,
        "_meta": {"io.modelcontextprotocol/serverInfo": {"name": SERVER_NAME, "version": __version__}},
    }


def _implementation(client: object) -> bool:
    """A ``clientInfo`` the SDK takes (its name and version are strings)."""
    return isinstance(client, dict) and isinstance(client.get("name"), str) and isinstance(client.get("version"), str)


def composing_refused(marker: Path) -> bool:
    return os.path.lexists(marker)


def refuse_composing(marker: Path) -> None:
    """A service of this build answered ``initialize`` unlike the composed answer: compose no more."""
    with contextlib.suppress(OSError):
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
