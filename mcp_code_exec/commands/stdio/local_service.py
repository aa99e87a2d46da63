"""Where a user's local service (the daemon that stdio fronts connect to) lives, and how each side
reaches the other: the front's connect and hello, the service's ready pipe and pid file.

Standard library only: the front (``serve`` over stdio) imports this and ``front``, and nothing of the
MCP SDK, docker or pydantic, so a new front answers its client's handshake as soon as the service does.

One service per OS user and effective configuration: its files are named by a hash of what the
configuration is made of (the config file's path and bytes, the environment variables that change it,
the interpreter and the package), in a private directory (0700) of the user's runtime directory. A
front with another configuration gets another service. Nobody else can reach the socket (0600, in a
0700 directory, and the service checks each peer's uid).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pwd
import re
import socket
import stat
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ... import __version__

ENV_CONFIG = "MCP_CODE_EXEC_CONFIG"
ENV_IDENTITY = "MCP_CODE_EXEC_IDENTITY"
ENV_RUNTIME_DIR = "MCP_CODE_EXEC_RUNTIME_DIR"
# Every variable that changes the effective configuration (the file's path, the token, the engine).
CONFIG_ENVIRONMENT = (ENV_CONFIG, "MCP_CODE_EXEC_TOKEN", "DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG")
IDENTITY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
HELLO_MAX_BYTES = 4096
SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with its NUL
RUN_USER = "/run/user"  # logind's private runtime directories, one per uid
SHARED_TMP = "/tmp"


class LocalServiceError(Exception):
    """The local service cannot be reached or started; the message says why, for a person, and
    ``exit_code`` is the command's (2: the configuration is wrong, 1: anything else)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Place:
    """The files of one local service: its socket, the lock fronts take to start it, the file its
    process holds locked while it lives (with its pid), its log, and the handshake answers it gave
    (``handshake``); and, for every service of this build, whether the front may compose its answer."""

    directory: Path
    name: str

    @property
    def socket(self) -> Path:
        return self.directory / f"{self.name}.sock"

    @property
    def start_lock(self) -> Path:
        return self.directory / f"{self.name}.lock"

    @property
    def pid_file(self) -> Path:
        return self.directory / f"{self.name}.pid"

    @property
    def log(self) -> Path:
        return self.directory / f"{self.name}.log"

    @property
    def answers(self) -> Path:
        return self.directory / f"{self.name}.answers.json"

    @property
    def composing_refused(self) -> Path:
        """Present when a service of this build answered a handshake unlike the composed answer."""
        return self.directory / f"build-{build_fingerprint()}.composing-refused"


def config_path(explicit: str | None, environ: dict[str, str] | os._Environ[str]) -> str | None:
    path = explicit or environ.get(ENV_CONFIG) or None
    return os.path.abspath(path) if path else None


def build_parts() -> dict[str, object]:
    """What makes this build: the package, its version and the interpreter that runs it."""
    return {"version": __version__, "package": str(Path(__file__).resolve().parents[2]), "python": sys.executable}


def build_fingerprint() -> str:
    return hashlib.sha256(json.dumps(build_parts(), sort_keys=True).encode()).hexdigest()[:16]


def config_fingerprint(path: str | None, environ: dict[str, str] | os._Environ[str]) -> str:
    """A name for the effective configuration: two fronts share a service only when it is the same."""
    digest = hashlib.sha256()
    parts = {
        **build_parts(),
        "config": path,
        "environment": {name: environ.get(name) for name in CONFIG_ENVIRONMENT},
    }
    digest.update(json.dumps(parts, sort_keys=True).encode())
    if path is not None:
        with contextlib.suppress(OSError):  # the service reports an unreadable file when it loads it
            digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def file_settings(path: str | None) -> dict[str, object]:
    """The few settings the front reads itself (no pydantic here): an unreadable or invalid file
    gives none, and the service, loading it properly, says what is wrong."""
    return parsed_file(path) or {}


def parsed_file(path: str | None) -> dict[str, object] | None:
    """The configuration file as TOML (empty: no file), or None when it cannot be read or parsed."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError):
        return None


def identity_name(settings: dict[str, object], environ: dict[str, str] | os._Environ[str]) -> str | None:
    """The configured stdio identity name (``MCP_CODE_EXEC_IDENTITY``, else ``[stdio] identity``),
    or None: the OS user's name then serves."""
    chosen = environ.get(ENV_IDENTITY)
    if not chosen:
        section = settings.get("stdio")
        chosen = section.get("identity") if isinstance(section, dict) else None
    return chosen if isinstance(chosen, str) and chosen else None


def stdio_identity(name: str | None, uid: int) -> str:
    """The identity a stdio client has: the configured name, else its OS user (by uid). Raises
    ``ValueError`` for a name outside ``IDENTITY_NAME``."""
    if name is not None:
        if not IDENTITY_NAME.fullmatch(name):
            raise ValueError(f"identity {name[:80]!r} is not a name: use 1 to 64 letters, digits, '.', '_', '@' or '-'")
        return f"local:{name}"
    try:
        return f"user:{pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"user:{uid}"


def runtime_directory(environ: dict[str, str] | os._Environ[str]) -> Path:
    """``<runtime>/mcp-code-exec``: made 0700 if missing, and refused unless it is a directory of
    this user that nobody else can enter.

    ``<runtime>`` depends on the uid alone, not on the environment a client happens to pass (desktop
    clients and SDKs start servers with a reduced one, without ``XDG_RUNTIME_DIR``): ``/run/user/<uid>``
    when it is this user's private directory (logind makes it), else ``/tmp``, where the directory
    is ``mcp-code-exec-<uid>``; and when that name is not such a directory (in ``/tmp`` anyone may
    take a name first: another user, a link), ``~/.cache/mcp-code-exec/run`` in the user's home
    directory (from the password database). ``MCP_CODE_EXEC_RUNTIME_DIR`` names another ``<runtime>``
    on purpose, and is then the only choice.
    """
    uid = os.geteuid()
    chosen = environ.get(ENV_RUNTIME_DIR)
    if chosen and os.path.isabs(chosen):
        return _private_made(Path(chosen) / "mcp-code-exec", uid)
    if _private_directory(Path(RUN_USER) / str(uid), uid):
        return _private_made(Path(RUN_USER) / str(uid) / "mcp-code-exec", uid)
    try:
        return _private_made(Path(SHARED_TMP) / f"mcp-code-exec-{uid}", uid)
    except LocalServiceError as taken:
        home = _home(uid)
        if home is None:
            raise
        fallback = home / ".cache" / "mcp-code-exec" / "run"
        try:
            os.makedirs(fallback.parent, 0o700, exist_ok=True)
        except OSError as exc:
            raise LocalServiceError(f"{taken}; and cannot make {fallback.parent} ({exc.strerror})") from None
        return _private_made(fallback, uid)


def _private_made(base: Path, uid: int) -> Path:
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise LocalServiceError(f"cannot make the directory {base} ({exc.strerror})") from None
    if not _private_directory(base, uid):
        raise LocalServiceError(
            f"{base} must be a directory of uid {uid} that nobody else can enter (mode 0700); remove it or fix it"
        )
    return base


def _home(uid: int) -> Path | None:
    try:
        home = pwd.getpwuid(uid).pw_dir
    except KeyError:
        return None
    return Path(home) if os.path.isabs(home) else None


def _private_directory(path: Path, uid: int) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid and not info.st_mode & 0o077


def place_for(explicit_config: str | None, environ: dict[str, str] | os._Environ[str]) -> Place:
    path = config_path(explicit_config, environ)
    place = Place(runtime_directory(environ), config_fingerprint(path, environ))
    if len(os.fsencode(place.socket)) > SOCKET_PATH_MAX:
        raise LocalServiceError(
            f"the socket path {place.socket} is too long; set MCP_CODE_EXEC_RUNTIME_DIR to a shorter directory"
        )
    return place


def service_alive(place: Place) -> bool:
    """Whether a service process holds its pid file's lock (it does for its whole life)."""
    try:
        handle = os.open(place.pid_file, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(handle)
    return False


def service_pid(place: Place) -> int | None:
    try:
        text = place.pid_file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and service_alive(place) else None


def connect(place: Place) -> socket.socket | None:
    """A connection to the service, or None when none listens (no socket, or a stale one)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.fspath(place.socket))
    except OSError as exc:
        conn.close()
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
            return None
        raise LocalServiceError(f"cannot connect to {place.socket} ({exc.strerror})") from None
    return conn


def hello(conn: socket.socket, identity: str | None) -> None:
    """The one line before the MCP stream: who the client is. The service answers ``ok`` or why not."""
    conn.sendall(json.dumps({"hello": 1, "identity": identity}).encode() + b"\n")
    answer = bytearray()
    while not answer.endswith(b"\n") and len(answer) < HELLO_MAX_BYTES:
        chunk = conn.recv(HELLO_MAX_BYTES)
        if not chunk:
            break
        answer += chunk
    try:
        reply = json.loads(answer)
    except ValueError:
        raise LocalServiceError("the local service closed the connection before answering") from None
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        why = reply.get("error") if isinstance(reply, dict) else None
        raise LocalServiceError(str(why or "the local service refused the connection"))


def hold_pid_file(place: Place) -> int:
    """Lock the pid file for this process's life and write our pid in it; returns the descriptor.

    A service that is still shutting down holds it: the new one waits for it (the front waiting for
    the new one bounds that wait), so two services never serve one socket.
    """
    handle = os.open(place.pid_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(handle, fcntl.LOCK_EX)
    os.ftruncate(handle, 0)
    os.write(handle, f"{os.getpid()}\n".encode())
    return handle


class ReadyPipe:
    """The pipe a starting service tells its front on, a line at a time: ``listening`` (the front may
    connect: the handshake is answered), then ``ready`` (its sandbox service has started) or
    ``error N: why`` (it could not; N is the exit code), which closes it. ``listening`` also lets go
    of the start lock the front handed over (an exit before then lets go of it too)."""

    def __init__(self, fd: int | None, start_lock: int | None = None) -> None:
        self.fd = fd
        self.start_lock = start_lock  # the front's start lock, held until the service listens

    def listening(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):  # the front gave up waiting
                os.write(self.fd, b"listening\n")
        if self.start_lock is not None:
            os.close(self.start_lock)  # the socket answers now: the next front connects instead
            self.start_lock = None

    def say(self, text: str) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.write(fd, text.encode("utf-8", "replace")[:HELLO_MAX_BYTES] + b"\n")
        except OSError:
            pass  # the front gave up waiting
        finally:
            os.close(fd)
